"""Benchmarks, one subcommand each (`python bench.py SUBCOMMAND --help`; their figures in BENCHMARKS.md): adapt (the
ViT-B/32 adaptation step, eager / compiled / one CUDA graph), decode (greedy captions/s with and without the key/value
cache), e2e (the adaptation loop with its data), matmul (this CPU's fp32 GFLOP/s: quote it beside any timing).
Every subcommand runs on a CPU too (the compiled and captured steps on CUDA only). Decoding runs all --max-len steps.
"""
import argparse
import os
import tempfile
import time
from dataclasses import asdict
from types import SimpleNamespace

import torch

from model import CLIP, CLIPConfig, Captioner, CaptionerConfig, generate
from train_utils import (BertAdam, GraphedStep, HelpFormatter, at_least, authors_decays, authors_schedule,
                         device_arg, freeze, matmul_gflops, param_groups, setup, where)

# -----------------------------------------------------------------------------
# decode: what the key/value cache buys (model.Captioner.generate)

SIZES = {  # the captioners caption.py's presets build, and the pair-encoder memory they read
    "paper": dict(width=512, heads=8, enc_layers=3, dec_layers=3, memory_len=100, vocab_size=49408),  # ViT-B/32
    "mini": dict(width=64, heads=4, enc_layers=2, dec_layers=2, memory_len=290, vocab_size=49408),  # mini64-synth
}


def new_captioner(name, vocab=None, max_len=32):
    """The preset's captioner; it ties CLIP's word and position embeddings, random ones here."""
    sizes = {**SIZES[name], "max_len": max_len, "dropout": 0.0, "vocab_size": vocab or SIZES[name]["vocab_size"]}
    words = SimpleNamespace(token_embedding=torch.nn.Embedding(sizes["vocab_size"], sizes["width"]),
                            positional_embedding=torch.nn.Parameter(torch.randn(77, sizes["width"])))
    return Captioner(CaptionerConfig(**sizes), words)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats):
    """Median wall time of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], out


def bench_decode(args):
    device, amp, where = device_and_amp(args)
    print(f"greedy decoding, batch {args.batch}, {args.max_len} tokens per caption, {where}, torch {torch.__version__}")
    print(f"{'captioner':<44} {'cache':>5} {'captions/s':>11} {'ms/step':>8} {'speedup':>8}")
    torch.manual_seed(0)
    for name in args.sizes:
        model = new_captioner(name, args.vocab, args.max_len).to(device).eval()
        cfg = model.cfg
        memory = torch.randn(args.batch, cfg.memory_len, cfg.width, device=device)
        label = f"{name}: {cfg.enc_layers}+{cfg.dec_layers} layers, {cfg.width} wide, {cfg.vocab_size} words"
        with amp:  # eos = -1: never stops early, every caption takes max_len steps
            results = {c: timed(lambda: generate(model, memory, bos=1, eos=-1, use_kv_cache=c), device, args.repeats)
                       for c in (True, False)}
        for use_kv_cache in (True, False):
            seconds = results[use_kv_cache][0]
            speedup = f"{results[False][0] / seconds:.1f}x" if use_kv_cache else "1.0x"
            print(f"{label:<44} {'yes' if use_kv_cache else 'no':>5} {args.batch / seconds:>11.1f} "
                  f"{1000 * seconds / args.max_len:>8.2f} {speedup:>8}")
        same = torch.equal(results[True][1], results[False][1])
        note = ""
        if device.type == "cuda":  # bf16 rounds the two paths' sums differently: random logits are near ties
            torch.backends.cuda.matmul.allow_tf32 = False
            ids = [generate(model, memory, bos=1, eos=-1, use_kv_cache=c) for c in (True, False)]
            torch.backends.cuda.matmul.allow_tf32 = True
            note = f" (bf16); in fp32: {torch.equal(*ids)}"
        print(f"{'':<44} identical ids with and without the cache: {same}{note}")


# -----------------------------------------------------------------------------
# pair / adapt: the full-size ViT-B/32 pair encoder, random weights


def device_and_amp(args):
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    ctx = setup(0, args.device)  # as the stages
    return ctx.device, ctx.amp, where(ctx, speed=True)


# ---- FLOPs and the GPU's peak: what MFU is measured against


def transformer_flops(seqs, length, width, layers, causal=False):
    """Forward FLOPs of `layers` CLIP blocks over `seqs` sequences of `length` tokens, matmuls only:
    projections 4 w^2 and MLP 8 w^2 per token, attention 2 * length^2 * w twice per sequence (causal in full)."""
    return layers * (seqs * length * 2 * 12 * width ** 2 + seqs * 2 * 2 * length ** 2 * width)


def adapt_step_flops(cfg, batch, text_len):
    """Model FLOPs of one adaptation step (paper preset), both towers, backward twice the forward (the
    frozen patch convolution: its forward alone)."""
    grid = cfg.image_resolution // cfg.vision_patch_size
    n, w, e = grid * grid + 1, cfg.vision_width, cfg.embed_dim
    conv = 2 * batch * 2 * grid * grid * 3 * cfg.vision_patch_size ** 2 * w  # both images
    vision = transformer_flops(2 * batch, n, w, cfg.vision_layers - cfg.n_inter) + \
        transformer_flops(batch, 2 * n, w, cfg.n_inter) + 2 * batch * 2 * n * w * e  # ln_post @ proj, all tokens
    text = transformer_flops(batch, text_len, cfg.transformer_width, cfg.transformer_layers) + \
        2 * batch * cfg.transformer_width * e  # the end-of-text token @ text_projection
    return conv + 3 * (vision + text)


DATASHEET_BF16 = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "A100": 312e12,
                  "L40S": 362e12, "A10": 125e12, "4090": 165e12}  # dense bf16 (tensor cores), vendor figures


def gpu_peak(device):
    """(datasheet dense bf16 FLOP/s or None, measured bf16 FLOP/s of an 8192^3 matmul)."""
    sheet = next((v for k, v in DATASHEET_BF16.items() if k in torch.cuda.get_device_name(device)), None)
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    return sheet, 2 * 8192 ** 3 / throughput(lambda: a @ b, device, steps=20, warmup=3)


def throughput(fn, device, steps=10, warmup=3):
    """Seconds per call of `fn` run back to back (the GPU waited for once, at the end)."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / steps


# ---- adapt: one training step (fp32 master weights + bf16 autocast)


def paper_adapt_args():
    """adapt.py's paper preset (its settings but the CLIP file's, which a random ViT-B/32 stands for here)."""
    from adapt import PRESETS
    return SimpleNamespace(**PRESETS["paper"])


def our_adapt_step(device, amp, compile=False, batch=128, text_len=32, graphs=False, cfg=None):
    """adapt.py's paper-preset step on a random ViT-B/32 (or a CLIP of `cfg`); graphs: as one CUDA graph,
    compile: compiled inside it."""
    from adapt import PairText, contrastive_loss, lr_rule
    import clip_load
    args = paper_adapt_args()
    torch.manual_seed(0)  # random weights, the same in every run
    model = CLIP(cfg or CLIPConfig()).to(device).train()
    size = model.cfg.image_resolution
    net = torch.compile(PairText(model)) if compile else PairText(model)
    freeze(model.named_parameters(), lr_rule(args))
    groups = param_groups(model.named_parameters(), lr_rule(args), args.weight_decay, authors_decays(model))
    optimizer = BertAdam(groups, lr=args.lr_new, betas=args.betas, eps=args.eps)
    scheduler = authors_schedule(optimizer, 1000, args.warmup)
    params = [p for g in groups for p in g["params"]]
    ctx = SimpleNamespace(amp=amp, device=device)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, batch, 3, size, size), dtype=torch.uint8, generator=g).to(device)
    ids = random_ids(batch, text_len, device)

    def update(b):  # adapt.py's; b a loader's batch (None: the fixed one)
        if b is None:  # the paper's 32 tokens
            before, after, text = images[0], images[1], ids
        else:  # as adapt.py: trimmed, or static shapes when compiled
            text = clip_load.trim(b["ids"], static=compile or graphs)
            before, after, text = (t.to(device, non_blocking=True) for t in (b["before"], b["after"], text))
        with amp:
            loss = contrastive_loss(*net(clip_load.normalize(before), clip_load.normalize(after), text))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        optimizer.step()
        return loss.detach()
    if graphs:  # a loader's batch, or the fixed one, through the captured step
        graphed = GraphedStep(ctx, update, optimizer, scheduler, params)
        return model, lambda b=None: graphed(b if b is not None else {"before": images[0], "after": images[1],
                                                                      "ids": ids})

    def step(b=None):
        optimizer.zero_grad(set_to_none=True)
        loss = update(b)
        scheduler.step()
        return loss
    return model, step


def random_ids(batch, text_len, device, seed=0):
    ids = torch.randint(1, 49000, (batch, text_len), generator=torch.Generator().manual_seed(seed))
    ids[:, 0], ids[:, 20], ids[:, 21:] = 49406, 49407, 0  # <start> 19 words <end>, padding
    return ids.to(device)


def report_step(label, seconds, batch, flops, peaks, device):
    sheet, measured = peaks
    tflops = flops / seconds / 1e12
    mfu = f"{100 * flops / seconds / sheet:.1f}% MFU" if sheet else "MFU n/a (unknown GPU)"
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    print(f"{label:<44} {1000 * seconds:7.1f} ms/step {batch / seconds:8.0f} pairs/s {tflops:6.1f} TFLOP/s "
          f"{mfu} ({100 * flops / seconds / measured:.0f}% of the measured matmul) peak memory {peak:.1f} GiB",
          flush=True)


# bench.py adapt --impl: name -> (compiled, one CUDA graph)
ADAPT_IMPLS = {"ours": (False, False), "ours+compile": (True, False), "ours+graphs": (False, True),
               "ours+compile+graphs": (True, True)}


def bench_adapt(args):
    """One training step as adapt.py's paper preset runs it: eager, compiled, captured as one CUDA graph."""
    device, amp, where = device_and_amp(args)
    cfg = CLIPConfig()
    flops = adapt_step_flops(cfg, args.batch, args.text_len)
    print(f"adaptation step, ViT-B/32 9 + 3 at 224 px, batch {args.batch} pairs x {args.text_len} tokens, {where}, "
          f"torch {torch.__version__}; model FLOPs per step {flops / 1e12:.2f} T (bench.adapt_step_flops: matmuls, "
          f"backward = 2x forward)")
    if device.type != "cuda":
        for name in args.impl or ["ours"]:
            compiled, graphs = ADAPT_IMPLS[name]
            _, step = our_adapt_step(device, amp, compiled, args.batch, args.text_len, graphs)
            seconds = throughput(step, device, args.repeats, 1)
            print(f"{name}, fp32 on the CPU: {1000 * seconds:.0f} ms/step, {args.batch / seconds:.1f} pairs/s, "
                  f"{flops / seconds / 1e9:.0f} GFLOP/s")
        return
    peaks = gpu_peak(device)
    print(f"GPU peak: datasheet dense bf16 {peaks[0] / 1e12 if peaks[0] else float('nan'):.0f} TFLOP/s, measured "
          f"8192^3 bf16 matmul {peaks[1] / 1e12:.0f} TFLOP/s; MFU = model FLOPs / step time / datasheet peak")
    for name in args.impl or list(ADAPT_IMPLS):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        compiled, graphs = ADAPT_IMPLS[name]
        model, step = our_adapt_step(device, amp, compiled, args.batch, args.text_len, graphs)
        how = ", compiled" * compiled + ", one CUDA graph" * graphs
        seconds = throughput(step, device, args.repeats, warmup=5 if compiled else 3)
        report_step(f"ours (fp32 weights, bf16 autocast{how})", seconds, args.batch, flops, peaks, device)
        if args.profile and name in args.profile:  # CUDA time by kernel, largest first
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                sync(device)
            print(f"--- {name}: CUDA time over 3 steps, by kernel")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        del model, step


# ---- end to end: adapt.py's loop with its data


def loop_rate(loader, step, device, batches, warmup=1):
    """pairs/s of `step` fed by `loader` (step None: the loader alone) over `batches` batches after `warmup`
    (start-up, compilation, prefetched batches), and the GPU's mean utilization meanwhile (None without pynvml)."""
    import threading
    warmup = max(warmup, 1 + loader.num_workers * (loader.prefetch_factor or 0))
    it, n, busy, stop = iter(loader), 0, [], threading.Event()

    def sample():
        while not stop.wait(0.05):
            try:
                busy.append(torch.cuda.utilization(device))
            except Exception:
                return
    thread = threading.Thread(target=sample, daemon=True)
    for k in range(warmup + batches):
        if k == warmup:
            sync(device)
            thread.start()
            t0 = time.perf_counter()
        if (batch := next(it, None)) is None:  # the loader's next pass
            it = iter(loader)
            batch = next(it)
        if step is None:
            for key in ("before", "after", "ids"):
                batch[key].to(device, non_blocking=True)
        else:
            step(batch)
        if k >= warmup:
            n += len(batch["ids"])
    sync(device)
    seconds = time.perf_counter() - t0
    stop.set()
    thread.join()
    return n / seconds, sum(busy) / len(busy) if busy else None


def bench_e2e(args):
    """Pairs/s of adapt.py's loop, data included, on a synthetic set at CLEVR-Change's 480x320 (the disk
    cache, bf16): the loader alone, the step alone, the loop, and 12 epochs of CLEVR-Change projected."""
    import data
    import synth
    from pathlib import Path
    device, amp, where = device_and_amp(args)
    cores = os.cpu_count()
    root = Path(args.root) if args.root else Path(args.workdir) / "synth480"
    if not args.root and not (root / "synth.json").is_file():
        t0 = time.time()
        synth.make_synth(root, args.scenes, seed=0, size=(480, 320), workers=cores)
        print(f"rendered {args.scenes} scenes at 480x320 in {time.time() - t0:.0f}s")
    items = data.load_items("clevr", root, "train", "semantic")
    print(f"end to end, adaptation at batch {args.batch}, {len(items)} pairs at 480x320, {where}, {cores} CPU cores, "
          f"torch {torch.__version__}")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)  # a fresh cache each run: its build is measured
    cache = data.ImageCache(items, 224, workers=cores, directory=tempfile.mkdtemp(dir=args.workdir))
    print(f"decode 480x320 PNG -> 224 uint8: {cache.rate:.0f} images/s building the cache on {cores} cores "
          f"({len(cache.index)} images)")
    loader = lambda: data.make_loader(data.CaptionDataset(items, 224, 32, swap_prob=0.5, cache=cache), args.batch,
                                      shuffle=True, workers=args.workers, device=device, drop_last=True)
    rate, _ = loop_rate(loader(), None, device, args.batches)
    print(f"  loader alone: {rate:8.0f} pairs/s", flush=True)
    if device.type != "cuda":
        return
    model, step = our_adapt_step(device, amp, args.compile, args.batch)
    fixed = args.batch / throughput(step, device, 5, 3)
    rate, busy = loop_rate(loader(), step, device, args.batches, 3 if args.compile else 1)  # compiling: one graph
    print(f"  model step alone: {fixed:8.0f} pairs/s | whole loop: {rate:8.0f} pairs/s, GPU utilization "
          f"{busy if busy is None else round(busy)}%", flush=True)
    samples, images = 33_830 * 6, 39_803 * 3  # CLEVR-Change's train scenes, ~6 captions each
    build = images / cache.rate
    print(f"projected, 12 adaptation epochs of CLEVR-Change ({samples:,} samples each, one per change caption): "
          f"{fmt_min(build + 12 * samples / rate)} ({fmt_min(build)} decoding {images:,} images once, then "
          f"{rate:.0f} pairs/s)")


def fmt_min(seconds):
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def bench_matmul(args):
    print(f"fp32 matmul {args.n}^3 on the CPU, {torch.get_num_threads()} threads, torch {torch.__version__}: "
          f"{matmul_gflops(args.n):.0f} GFLOP/s")


# -----------------------------------------------------------------------------
# numerics: how far ViT-B/32's weights move in the authors' fp16 step, rebuilt, and in ours


def bench_numerics(args):
    """--steps stage-1 steps at the paper's peak rates on one random ViT-B/32: ours (fp32 masters) against
    theirs (their module_clip.CLIP, convert_weights, BertAdam): how far the fp16 weights moved."""
    import sys
    import types
    from adapt import contrastive_loss, lr_rule
    if not os.path.isfile(os.path.join(args.authors, "modules", "module_clip.py")):
        raise SystemExit(f"--authors: no modules/module_clip.py in {args.authors}: give a clone of the authors' code")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    sys.modules.setdefault("tqdm", types.SimpleNamespace(tqdm=None))  # their download helper's import
    sys.path.insert(0, args.authors)
    from modules.module_clip import CLIP as TheirCLIP, convert_weights
    from modules.optimization import BertAdam as TheirBertAdam
    cfg, rule = CLIPConfig(), lr_rule(paper_adapt_args())
    torch.manual_seed(0)
    ours = CLIP(cfg)
    theirs = TheirCLIP(*list(asdict(cfg).values())[:10], intra_layers=cfg.vision_layers - cfg.n_inter).float()
    theirs.load_state_dict(ours.state_dict())
    convert_weights(theirs)
    g = torch.Generator().manual_seed(1)
    before, after = torch.randn(2, args.batch, 3, 224, 224, generator=g)
    ids = random_ids(args.batch, 32, "cpu")
    runs = (("ours, fp32 masters", ours, lambda gs: BertAdam(gs, 1e-4, (0.9, 0.98)), lambda: ours.encode_pair(
                before, after).vector),
            ("theirs, fp16", theirs, lambda gs: TheirBertAdam(gs, 1e-4, b2=0.98), lambda: theirs.encode_image(
                torch.stack([before, after], 1).flatten(0, 1).half(), video_frame=2).float()))
    for label, model, make, vector in runs:
        freeze(model.named_parameters(), rule)
        optimizer = make(param_groups(model.named_parameters(), rule, 0.2, authors_decays(model)))
        start = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        t0 = time.time()
        for _ in range(args.steps):
            contrastive_loss(vector(), model.encode_text(ids).float(), model.logit_scale).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        held = (".attn.in_proj_weight", ".attn.in_proj_bias", ".attn.out_proj.weight", ".attn.out_proj.bias",
                "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias", "visual.proj",
                "text_projection")  # held in fp16 by convert_weights, and trained
        d = torch.cat([(p.detach().float() - start[n]).abs().flatten() for n, p in model.named_parameters()
                       if n.endswith(held)])
        print(f"{label}: {args.steps} steps of {args.batch} pairs in {time.time() - t0:.0f}s: of the fp16-held "
              f"weights, {100 * (d > 0).float().mean():.1f} % moved, {100 * (d > 1e-5).float().mean():.1f} % by more "
              f"than 1e-5, the largest by {d.max():.2e} ({where(SimpleNamespace(device=torch.device('cpu')), True)})")
    return 0


def common(q, repeats=3, what="timed steps (the mean of back-to-back steps)"):
    q.add_argument("--repeats", type=at_least(1), default=repeats, help=what)
    q.add_argument("--device", type=device_arg, default=None, help="cpu or cuda (default: cuda when available)")
    q.add_argument("--threads", type=at_least(0), default=0, help="CPU threads (0: torch's default)")


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    add = lambda name, help: sub.add_parser(name, help=help, formatter_class=HelpFormatter)
    d = add("decode", "greedy decoding captions/s, with and without the key/value cache")
    d.add_argument("--batch", type=at_least(1), default=64, help="captions decoded together")
    d.add_argument("--max-len", type=at_least(1), default=32, help="tokens per caption (paper: at most 32)")
    d.add_argument("--vocab", type=at_least(1), default=None,
                   help="vocabulary size (default: CLIP's 49,408 BPE tokens)")
    d.add_argument("--sizes", nargs="+", default=["mini", "paper"], choices=list(SIZES), help="captioner sizes")
    common(d, what="timed runs per setting (the median is reported)")
    q = add("adapt", "one ViT-B/32 adaptation training step (eager, compiled, one CUDA graph): pairs/s, MFU, memory")
    q.add_argument("--batch", type=at_least(1), default=128, help="pairs per step (paper: 128)")
    q.add_argument("--text-len", type=at_least(1), default=32, help="caption tokens (paper: 32)")
    q.add_argument("--impl", nargs="+", default=None, choices=list(ADAPT_IMPLS),
                   help="which steps to time (default: all on CUDA, ours on a CPU)")
    q.add_argument("--profile", nargs="*", default=[], choices=list(ADAPT_IMPLS),
                   help="also print a kernel profile of these --impl steps")
    common(q, repeats=20)
    q = add("e2e", "adapt.py's loop with its data: the loader, the step, the loop; projected to CLEVR-Change")
    q.add_argument("--root", default=None, help="a CLEVR-Change-layout set (default: render --scenes at 480x320)")
    q.add_argument("--workdir", default="data/bench", help="where the rendered set goes")
    q.add_argument("--scenes", type=at_least(1), default=800, help="scenes to render")
    q.add_argument("--batch", type=at_least(1), default=128, help="pairs per step")
    q.add_argument("--workers", type=at_least(0), default=8, help="our loader's workers (adapt.py's paper preset: 8)")
    q.add_argument("--batches", type=at_least(1), default=30, help="batches timed")
    q.add_argument("--compile", action="store_true", help="the step compiled")
    common(q)
    q = add("numerics", "how far ViT-B/32's weights move in the authors' fp16 step (rebuilt) against ours")
    q.add_argument("--steps", type=at_least(1), default=8, help="training steps")
    q.add_argument("--batch", type=at_least(2), default=2, help="pairs per step (fp16 on a CPU is slow)")
    q.add_argument("--authors", default="CLIP4IDC", help="a clone of github.com/sushizixin/CLIP4IDC")
    q.add_argument("--threads", type=at_least(0), default=0, help="CPU threads (0: torch's default)")
    m = add("matmul", "this CPU's fp32 GFLOP/s, the figure to quote beside a timing")
    m.add_argument("--n", type=at_least(1), default=2048, help="matrix size")
    args = p.parse_args(argv)
    if getattr(args, "root", None) and not os.path.isdir(args.root):
        p.error(f"argument --root: no directory at {args.root}: give a CLEVR-Change-layout set, or leave --root out "
                f"to render one")
    return args


def main(argv=None):
    args = get_args(argv)
    return globals()["bench_" + args.command](args)


if __name__ == "__main__":
    raise SystemExit(1 if main() else 0)
