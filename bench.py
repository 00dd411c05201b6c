"""Benchmarks for clip4idc, one subcommand each.

    python bench.py decode                  # greedy captions/s at batch 64: key/value cache vs re-running the prefix
    python bench.py decode --device cuda    # the same on a GPU (bf16 autocast, as caption.py runs there)
    python bench.py pair                    # ViT-B/32 pair encoder forward, 8 pairs (CPU fp32 / CUDA bf16)
    python bench.py adapt --batch 128       # one adaptation training step of ViT-B/32: pairs/s, peak memory
    python bench.py metrics                 # = python metrics.py --bench (8,000 candidates x 6 references)
    python bench.py matmul                  # this CPU's fp32 GFLOP/s (2048^3 matmul): quote it beside any timing

Decoding runs all --max-len steps (no caption stops early), so both paths do the same number of steps and the
figure is the worst case; random weights and memory are enough, since the cost does not depend on the values.
"""
import argparse
import time
from contextlib import nullcontext

import torch

from model import CLIP, CLIPConfig, Captioner, CaptionerConfig
from train_utils import matmul_gflops

# -----------------------------------------------------------------------------
# decode: what the key/value cache buys (model.Captioner.generate)

SIZES = {  # captioner sizes and the pair-encoder memory they read, as caption.py's presets build them
    "paper": dict(width=512, heads=8, enc_layers=3, dec_layers=3, memory_dim=512, memory_len=100),  # ViT-B/32
    "small": dict(width=128, heads=4, enc_layers=0, dec_layers=2, memory_dim=128, memory_len=74),  # adapt small
}


def timed(fn, device, repeats):
    """Median wall time of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def bench_decode(args):
    device, amp, where = device_and_amp(args)
    print(f"greedy decoding, batch {args.batch}, {args.max_len} tokens per caption, vocabulary {args.vocab}, "
          f"{where}, torch {torch.__version__}")
    print(f"{'captioner':<34} {'cache':>5} {'captions/s':>11} {'ms/step':>8} {'speedup':>8}")
    torch.manual_seed(0)
    for name in args.sizes:
        cfg = CaptionerConfig(vocab_size=args.vocab, max_len=args.max_len, dropout=0.0, **SIZES[name])
        model = Captioner(cfg).to(device).eval()
        memory = torch.randn(args.batch, cfg.memory_len, cfg.memory_dim, device=device)
        label = f"{name}: {cfg.enc_layers}+{cfg.dec_layers} layers, {cfg.width} wide"
        results = {}
        for use_cache in (True, False):
            def run():
                with amp:  # eos = -1: never stops early, every caption takes max_len steps
                    return model.generate(memory, bos=1, eos=-1, use_cache=use_cache)
            results[use_cache] = timed(run, device, args.repeats)
        for use_cache in (True, False):
            seconds = results[use_cache][0]
            speedup = f"{results[False][0] / seconds:.1f}x" if use_cache else "1.0x"
            print(f"{label:<34} {'yes' if use_cache else 'no':>5} {args.batch / seconds:>11.1f} "
                  f"{1000 * seconds / args.max_len:>8.2f} {speedup:>8}")
        same = torch.equal(results[True][1], results[False][1])
        print(f"{'':<34} identical ids with and without the cache: {same}")


# -----------------------------------------------------------------------------
# pair / adapt: the full-size ViT-B/32 pair encoder (random weights: speed does not depend on their values)


def vit_b32(device, n_inter=3):
    torch.manual_seed(0)
    return CLIP(CLIPConfig(n_inter=n_inter)).to(device)


def device_and_amp(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads:
        torch.set_num_threads(args.threads)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU, {torch.get_num_threads()} threads, {matmul_gflops():.0f} GFLOP/s fp32"
    return device, amp, where


def bench_pair(args):
    device, amp, where = device_and_amp(args)
    model = vit_b32(device).eval()
    x = torch.randn(args.batch, 3, 224, 224, device=device)
    with torch.no_grad():
        seconds, (tokens, v) = timed(lambda: _amp_call(amp, model.encode_pair, x, x.flip(0)), device, args.repeats)
    print(f"ViT-B/32 pair encoder (9 intra + 3 inter), {args.batch} pairs, {where}, "
          f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}: {1000 * seconds:.0f} ms per batch, "
          f"{args.batch / seconds:.1f} pairs/s; tokens {tuple(tokens.shape)}, pair vector {tuple(v.shape)}")


def _amp_call(amp, fn, *a):
    with amp:
        return fn(*a)


def bench_adapt(args):
    """One training step as adapt.py's paper preset runs it: pair encoder + text tower + contrastive loss."""
    from adapt import PairText, contrastive_loss
    device, amp, where = device_and_amp(args)
    model = vit_b32(device).train()
    net = torch.compile(PairText(model)) if args.compile else PairText(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7, betas=(0.9, 0.98), eps=1e-6)
    B = args.batch
    before, after = torch.randn(B, 3, 224, 224, device=device), torch.randn(B, 3, 224, 224, device=device)
    ids = torch.randint(1, 49000, (B, 32), device=device)
    ids[:, 20] = 49407

    def step():
        with amp:
            loss = contrastive_loss(*net(before, after, ids))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds, _ = timed(step, device, args.repeats)
    peak = f", peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
    print(f"adaptation step, ViT-B/32 9/3, batch {B} pairs x 32 tokens, {where}, "
          f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}{' + compile' if args.compile else ''}: "
          f"{1000 * seconds:.0f} ms/step, {B / seconds:.1f} pairs/s{peak}")


def bench_matmul(args):
    print(f"fp32 matmul {args.n}^3 on the CPU, {torch.get_num_threads()} threads, torch {torch.__version__}: "
          f"{matmul_gflops(args.n):.0f} GFLOP/s")


def bench_metrics(args):
    import metrics
    metrics._bench()


# -----------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decode", help="greedy decoding captions/s, with and without the key/value cache",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--batch", type=int, default=64, help="captions decoded together")
    d.add_argument("--max-len", type=int, default=32, help="tokens per caption (paper: at most 32)")
    d.add_argument("--vocab", type=int, default=100, help="vocabulary size (CLEVR-Change has ~80 words)")
    d.add_argument("--sizes", nargs="+", default=["small", "paper"], choices=list(SIZES), help="captioner sizes")
    d.add_argument("--repeats", type=int, default=3, help="timed runs per setting (the median is reported)")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    d.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    d.set_defaults(func=bench_decode)
    for name, fn, batch, what in (("pair", bench_pair, 8, "ViT-B/32 pair-encoder forward"),
                                  ("adapt", bench_adapt, 128, "one ViT-B/32 adaptation training step")):
        q = sub.add_parser(name, help=what, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        q.add_argument("--batch", type=int, default=batch, help="pairs per batch")
        q.add_argument("--repeats", type=int, default=3, help="timed runs (the median is reported)")
        q.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        q.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
        q.add_argument("--compile", action="store_true", help="torch.compile (adapt, CUDA)")
        q.set_defaults(func=fn)
    sub.add_parser("metrics", help="scoring speed: python metrics.py --bench").set_defaults(func=bench_metrics)
    m = sub.add_parser("matmul", help="this CPU's fp32 GFLOP/s, the figure to quote beside a timing",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m.add_argument("--n", type=int, default=2048, help="matrix size")
    m.set_defaults(func=bench_matmul)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
