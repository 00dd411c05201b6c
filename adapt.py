"""Stage 1 of CLIP4IDC: adapt CLIP to image *pairs* by contrastive pair <-> text retrieval (paper Sec. 3.2).

    python adapt.py --data clevr                 # writes adapted.pt
    python adapt.py --data clevr --n-inter 0     # all blocks intra, none inter (Table 7: 12 + 0; the mini: 6 + 0)

The pair encoder (model.py) turns (before, after) into a vector v, CLIP's text tower the caption into g; the
symmetric InfoNCE loss over the batch (eq. 6-8) pulls each pair to its own caption. Retrieval (both ways, ranked as
the authors rank) on val after every epoch chooses the checkpoint (paper preset: by text->pair R@1, as the authors
on test); test is evaluated once, at the end. The paper preset's step is the authors' (BertAdam, their schedule).

Presets (printed in a banner, every value overridable by its flag): paper (OpenAI's ViT-B/32 found, or --clip PATH:
the authors' settings); mini (no OpenAI weights found: the small CLIP pretrain.py pretrained on synthetic scenes,
shipped in assets/, minutes on a CPU); compare (not the paper's: mini whose inter blocks are taught to compare);
scratch (a small CLIP-shaped model from nothing).
"""
import argparse
import math
import os
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

import clip_load
import data
import plots
from model import CLIP, INPUT_EMBEDDINGS, PAIR_KEYS, CLIPConfig, authors_fp16_, share_joint_positions_
from train_utils import (GraphedStep, HelpFormatter, Progress, at_least, authors_decays, authors_schedule,
                         check_resume, check_sizes, freeze, improved, interrupted, last_path, load_resume, log,
                         make_optimizer, param_groups, policy_table, restore, rng_state, run_flags, save_atomic, setup,
                         train_epoch, warmup_cosine, where)

# -----------------------------------------------------------------------------
# presets: the authors' settings; the shipped small pretrained CLIP and a small from-scratch model, minutes on a CPU

PRESETS = {
    "paper": dict(clip="ViT-B/32", n_inter=3, image_size=224, batch_size=128, epochs=12, lr_new=1e-4, lr_clip=1e-7,
                  weight_decay=0.2, workers=8, draw_captions=False, optimizer="bertadam", select="text->pair R@1"),
    # mini: the shipped small CLIP (6 blocks, 12x12 patches of 8 px: an object spans several), 4 + 2 blocks, the
    # authors' policy scaled down (CLIP at their 1e-7, so the captions keep what pretraining saw)
    "mini": dict(clip="mini12-synth", n_inter=2, image_size=96, batch_size=32, epochs=1, lr_new=1e-3, lr_clip=1e-7,
                 weight_decay=0.05, workers=0, draw_captions=True, optimizer="adamw", select="R@mean"),
    # scratch (the from-scratch ablation): ViT-B/32's 9 + 3 blocks at 1/12 of its width; nothing frozen, one rate
    "scratch": dict(clip=None, n_inter=3, image_size=96, batch_size=32, epochs=3, lr_new=3e-4, lr_clip=3e-4,
                    weight_decay=0.05, workers=0, vision_width=64, vision_layers=12, patch_size=16, text_width=128,
                    text_layers=3, embed_dim=128, draw_captions=False, optimizer="adamw", select="R@mean"),
}
# compare (not the paper's): mini whose inter blocks learn to compare: the intra blocks frozen, the rest at 3e-4, p
# alike for a position in both images
PRESETS["compare"] = dict(PRESETS["mini"], epochs=12, lr_clip=3e-4, shared_p=10.0, freeze_blocks=4)


def get_args(argv=None):
    pre = lambda k: "[" + ", ".join(f"{n}: {v[k]}" for n, v in PRESETS.items() if k in v) + "]"  # presets' values
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    # data
    p.add_argument("--data", default="clevr", choices=["clevr", "spot", "ier", "levir"], help="dataset")
    p.add_argument("--data-root", help="dataset directory (default data/<name>; clevr: a synthetic set when absent)")
    p.add_argument("--skip-missing", action="store_true", help="drop pairs whose images are missing (counted)")
    p.add_argument("--swap-prob", type=at_least(0.0, float, most=1.0), default=None,
                   help="CLEVR: probability of replacing the before image by its non-semantic version (default: "
                        "0.5, the authors'; 0 on the synthetic set)")
    p.add_argument("--draw-captions", action=argparse.BooleanOptionalAction, default=None, help="one caption drawn "
                   f"per pair and epoch, not every caption once, as the authors {pre('draw_captions')}")
    p.add_argument("--workers", type=at_least(0), default=None, help=f"DataLoader worker processes {pre('workers')}")
    p.add_argument("--image-cache", action=argparse.BooleanOptionalAction, default=None, help="decode every image "
                   "once into a uint8 file ($CLIP4IDC_IMAGE_CACHE, else ~/.cache/clip4idc/images); default: if it fits")
    # model
    p.add_argument("--preset", default="auto", choices=["auto", "paper", "mini", "compare", "scratch"],
                   help="auto: paper when OpenAI's weights are found (or --clip names a file), else mini (the "
                        "small CLIP pretrained on synthetic scenes, in assets/); compare: mini whose inter blocks "
                        "learn to compare (not the paper's); scratch: a small model from nothing")
    p.add_argument("--clip", type=clip_load.weights_arg, default=None, help="CLIP weights: a path, ViT-B/32 "
                   f"(downloaded) or a shipped {' or '.join(clip_load.SHIPPED)} {pre('clip')}")
    p.add_argument("--n-inter", type=at_least(0), default=None, help=f"inter blocks (the rest intra) {pre('n_inter')}")
    p.add_argument("--image-size", type=at_least(1), help=f"input size (a CLIP file has its own) {pre('image_size')}")
    p.add_argument("--context-length", type=at_least(2), default=32, help="caption tokens incl. start/end")
    p.add_argument("--shared-p", type=at_least(0.0, float), default=None, help="not the paper's: p alike for a "
                   "patch's position in both images, codes of this norm (model.share_joint_positions_); 0 (the other "
                   f"presets): the authors' random p {pre('shared_p')}")
    for name in ("vision-width", "vision-layers", "patch-size", "text-width", "text-layers", "embed-dim"):
        p.add_argument(f"--{name}", type=at_least(1), default=None, help=f"model size {pre(name.replace('-', '_'))}")
    # optimization
    p.add_argument("--epochs", type=at_least(1), default=None, help=f"training epochs {pre('epochs')}")
    p.add_argument("--batch-size", type=at_least(1), default=None, help=f"pairs per step {pre('batch_size')}")
    p.add_argument("--lr-new", type=at_least(0.0, float), default=None, help=f"lr of e1, e2, p, ln_mid {pre('lr_new')}")
    p.add_argument("--lr-clip", type=at_least(0.0, float), default=None, help=f"lr of CLIP's weights {pre('lr_clip')}")
    p.add_argument("--freeze-blocks", type=at_least(0), default=None, help="not the paper's: CLIP's first N image "
                   f"blocks frozen (4 of 4 + 2: the intra blocks); the other presets: 0 {pre('freeze_blocks')}")
    p.add_argument("--weight-decay", type=at_least(0.0, float), help=f"weight decay {pre('weight_decay')}")
    p.add_argument("--optimizer", choices=["bertadam", "adamw"], default=None, help="bertadam: the authors' (their "
                   "schedule and decay sets); adamw: ours (cosine after the warmup, no decay on 1-D tensors) "
                   f"{pre('optimizer')}")
    # run
    run_flags(p)
    p.add_argument("--authors-numerics", action="store_true", help="the authors' fp16 (model.authors_fp16_) and "
                   "two-GPU gradient (two_gpu_gradient_); with bertadam")
    p.add_argument("--out", default="adapted.pt", help="best-on-val checkpoint; resumable state in *.last.pt")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the training step (CUDA), static shapes: captions padded to --context-length")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the training step (forward, backward, clip, AdamW) as one CUDA graph replayed each "
                        "step (train_utils.GraphedStep; static shapes; not on a CPU): default on for the paper preset")
    p.add_argument("--eval-batch-size", type=at_least(1), default=256, help="pairs per batch when encoding for eval")
    args = p.parse_args(argv)
    if args.preset == "auto":
        # the paper's settings for any CLIP file, or OpenAI's found in the cache; the mini CLIP's own otherwise
        cached = args.clip is None and (clip_load.CACHE / "ViT-B-32.pt").is_file()
        args.preset = "paper" if args.clip not in (None, *clip_load.SHIPPED) or cached else "mini"
    spot = {"epochs": 20} if args.preset == "paper" and args.data == "spot" else {}  # retrieve_spot.sh
    vars(args).update({k: v for k, v in {"shared_p": 0.0, "freeze_blocks": 0, **PRESETS[args.preset], **spot}.items()
                       if getattr(args, k, None) is None})  # a flag given wins
    check_resume(p, args)
    if args.authors_numerics and args.optimizer != "bertadam":
        p.error("argument --authors-numerics: their fp16 state is BertAdam's: give --optimizer bertadam")
    if not args.clip:
        check_sizes(p, args.image_size, args.patch_size, {"--vision-width": args.vision_width,
                                                           "--text-width": args.text_width})
        if args.n_inter > args.vision_layers:
            p.error(f"argument --n-inter: {args.n_inter} inter blocks, but --vision-layers is {args.vision_layers}: "
                    f"give 0 to {args.vision_layers}")
    return args


# -----------------------------------------------------------------------------
# model, loss, learning-rate rule


def new_model(args):
    """CLIP (a file: OpenAI's, the shipped mini one; or a small one from nothing) with fresh pair parameters: the
    authors' random p, or with --shared-p one code per position, alike in both images."""
    clip = clip_load.load_clip(args.clip, n_inter=args.n_inter) if args.clip else CLIP(CLIPConfig(
        args.embed_dim, args.image_size, args.vision_layers, args.vision_width, args.patch_size, args.context_length,
        transformer_width=args.text_width, transformer_layers=args.text_layers,
        transformer_heads=max(1, args.text_width // 64), n_inter=args.n_inter))
    if args.shared_p and args.n_inter:
        share_joint_positions_(clip.visual, args.shared_p)
    return clip


class PairText(torch.nn.Module):
    """One training forward (what --compile compiles): pair vectors, caption features, scale."""

    def __init__(self, clip):
        super().__init__()
        self.clip = clip

    def forward(self, before, after, ids, intra=None):
        """intra: the pairs' intra-block tokens (B, 2, n+1, width) computed already (fixed_intra), for the images."""
        v = self.clip.encode_pair(before, after) if intra is None else self.clip.visual.inter(intra.flatten(1, 2))
        return v.vector, self.clip.encode_text(ids), self.clip.logit_scale


@torch.no_grad()
def fixed_intra(model, items, args, ctx, cache):
    """When nothing before the inter blocks trains (the compare preset), each training pair's intra-block tokens
    (eq. 2) are the same every epoch: computed here once, (pairs, 2, n+1, width) on the CPU; else None."""
    n_intra = model.cfg.vision_layers - model.cfg.n_inter
    if not (args.clip and args.freeze_blocks >= n_intra and args.swap_prob == 0 and model.cfg.n_inter):
        return None
    loader = data.make_loader(data.ImageDataset(items, args.image_size, cache=cache), args.eval_batch_size,
                              workers=args.workers, device=ctx.device)
    out = []
    for batch in loader:
        before, after = (clip_load.normalize(batch[k].to(ctx.device, non_blocking=True)) for k in ("before", "after"))
        with ctx.amp:
            x = model.visual.intra(model.visual.stem(torch.cat([before, after])))
        out.append(torch.stack(x.float().chunk(2), 1).cpu())
    return torch.cat(out)


def two_gpu_gradient_(model):
    """The authors' stage 1 on two GPUs: their AllGather's backward keeps each rank's slice (until_module.py 265-269)
    and DDP averages the ranks, so each gradient but logit_scale's is half the full batch's."""
    for p in model.parameters():
        if p.requires_grad and p is not model.logit_scale:
            p.register_hook(lambda g: g * 0.5)
    return model


def contrastive_loss(v, g, logit_scale):
    """eq. (6)-(8): InfoNCE over the batch, pair -> text and text -> pair, averaged. v: pair vectors (B, D), g:
    caption features (B * (1 + K), D), row i v's row i's; rows B.. are hard negatives (pretrain.py's), in v -> g
    only. In fp32, autocast off: at scale 100 bf16 would shift the logits."""
    with torch.autocast(v.device.type, enabled=False):
        v, g = F.normalize(v.float(), dim=-1), F.normalize(g.float(), dim=-1)
        scale = logit_scale.float().clamp(max=math.log(100)).exp()  # temperature >= 0.01, as the authors clamp it
        logits = scale * v @ g.t()  # (B, B(1+K)) cosine similarities
        labels = torch.arange(len(v), device=v.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits[:, :len(v)].t(), labels)) / 2


def lr_rule(args):
    """The learning-rate rule, parameter name -> learning rate (None: frozen): the new pair parameters at lr_new,
    CLIP's at lr_clip; the authors' frozen embeddings only when from CLIP, and the first --freeze-blocks image
    blocks. Weight decay: train_utils.param_groups."""
    def lr(name):
        if name.startswith(PAIR_KEYS):  # e1, e2, p, ln_mid (at N + 0 too, as the authors')
            return args.lr_new
        # --freeze-blocks: the first blocks keep what pretraining taught them (compare: the intra)
        first = name.startswith("visual.transformer.resblocks.") and int(name.split(".")[3]) < args.freeze_blocks
        return None if (args.clip and name.startswith(INPUT_EMBEDDINGS)) or first else args.lr_clip
    return lr


# -----------------------------------------------------------------------------
# retrieval evaluation


@torch.no_grad()
def encode_split(model, items, args, ctx, cache=None):
    """Pair vectors (P, D) and caption features (T, D), normalized; owner[t] = index of caption t's pair."""
    model.eval()
    ds = data.ImageDataset(items, args.image_size, cache=cache)
    loader = data.make_loader(ds, args.eval_batch_size, workers=args.workers, device=ctx.device)
    pairs = []
    for batch in loader:
        before, after = (clip_load.normalize(batch[k].to(ctx.device, non_blocking=True)) for k in ("before", "after"))
        with ctx.amp:
            pairs.append(model.encode_pair(before, after).vector.float())
    # every caption is a retrieval target (load_items has dropped the empty ones)
    owner, captions = map(list, zip(*[(i, c) for i, it in enumerate(items) for c in it.captions]))
    owner = torch.tensor(owner)
    texts = []
    for i in range(0, len(captions), args.eval_batch_size):
        ids = clip_load.tokenize(captions[i:i + args.eval_batch_size], args.context_length, truncate=True)
        with ctx.amp:
            texts.append(model.encode_text(ids.to(ctx.device)).float())
    return F.normalize(torch.cat(pairs), dim=-1).cpu(), F.normalize(torch.cat(texts), dim=-1).cpu(), owner


def retrieval_metrics(sim, owner):
    """sim (P, T) pair-caption similarities, owner[t] caption t's pair, ranked as the authors rank (their
    metrics.py): text -> pair, the caption's own pair among all pairs; pair -> text, the pair's own caption *set*
    among all sets, a set scoring its best caption. Ranks 1-based, ties pessimistic (theirs: arbitrary). MdR as
    theirs: np.median (pair -> text), torch.median, the lower (text -> pair)."""
    P, T = sim.shape
    own = sim[owner, torch.arange(T)]  # (T,)
    t2p = (sim >= own[None, :]).sum(0)  # (T,)
    sets = torch.full((P, P), float("-inf")).scatter_reduce(1, owner.expand(P, T), sim.float(), "amax")  # pair x set
    p2t = (sets >= sets.diagonal()[:, None]).sum(1)  # (P,)
    out = {}
    for name, ranks in (("pair->text", p2t), ("text->pair", t2p)):
        r = ranks.float()
        out.update({f"{name} R@{k}": 100 * (r <= k).float().mean().item() for k in (1, 5, 10)})
        out[f"{name} MnR"] = r.mean().item()
        out[f"{name} MdR"] = (r.quantile(0.5) if name == "pair->text" else r.median()).item()
    out["R@mean"] = sum(out[f"{d} R@{k}"] for d in ("pair->text", "text->pair") for k in (1, 5, 10)) / 6
    return out


def chance_metrics(P):
    """The same figures for random similarities: R@K = K / P, mean and median ranks (P + 1) / 2, both ways (in
    pair -> text a larger set ranks higher, but each ranking gives the P sets the P ranks once)."""
    out = {}
    for d in ("pair->text", "text->pair"):
        out.update({f"{d} R@{k}": 100 * min(k, P) / P for k in (1, 5, 10)})
        out[f"{d} MdR"] = out[f"{d} MnR"] = (P + 1) / 2
    return out


def evaluate(model, items, args, ctx, cache=None):
    """Retrieval figures on `items`, or None when the features are not finite (a diverged model: a NaN similarity
    would rank first, R@1 100, and be saved as the best)."""
    v, g, owner = encode_split(model, items, args, ctx, cache)
    return retrieval_metrics(v @ g.t(), owner) if torch.isfinite(v).all() and torch.isfinite(g).all() else None


def diverged(epoch):
    return (f"evaluation after epoch {epoch}: the encoder's features are NaN/inf (the weights diverged): stopping. "
            f"The best checkpoint so far is kept; check the data, or start again with a lower learning rate "
            f"(--resume would keep the old one).")


def fmt(m):
    return (f"pair->text R@1/5/10 {m['pair->text R@1']:.1f}/{m['pair->text R@5']:.1f}/{m['pair->text R@10']:.1f} "
            f"MdR {m['pair->text MdR']:.0f} | text->pair R@1/5/10 {m['text->pair R@1']:.1f}/"
            f"{m['text->pair R@5']:.1f}/{m['text->pair R@10']:.1f} MdR {m['text->pair MdR']:.0f}")


# -----------------------------------------------------------------------------
# the run: the pieces of main(), in the order it uses them


def banner(ctx, args):
    """What is being adapted, said plainly, and every setting."""
    log(f"== adapt.py: preset '{args.preset}' on {where(ctx)} ==")
    paper = f"For the paper's results put OpenAI's ViT-B-32.pt in ~/.cache/clip/ or pass --clip ({clip_load.WEIGHTS})."
    if args.preset in ("mini", "compare") and args.clip in clip_load.SHIPPED:
        log(f"   no OpenAI weights given or found: adapting the SMALL CLIP PRETRAINED ON SYNTHETIC SCENES that "
            f"ships in assets/ ({clip_load.SHIPPED[args.clip][0]}, made by pretrain.py; the paper in miniature, "
            f"a CPU demo; --preset scratch trains a small model from nothing instead). {paper}")
    elif args.preset == "mini":
        log(f"   adapting the CLIP in {args.clip} with the settings made for the small CLIPs pretrained on "
            f"synthetic scenes (--preset mini; for OpenAI's ViT-B-32.pt use --preset paper)")
    if args.preset == "scratch":
        log("   training a SMALL CLIP-shaped model FROM SCRATCH (a CPU demo, the from-scratch ablation; the "
            f"default adapts the small CLIP pretrained on synthetic scenes). {paper}")
    log("   " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())))


def load_data(args, root, ctx, model):
    """The splits, the image cache and the training loader (data.CaptionDataset, CLEVR's distractor swap; the
    intra-block tokens in place of the images where those blocks are fixed: fixed_intra)."""
    split = lambda s: data.load_items(args.data, root, s, setting="semantic", skip_missing=args.skip_missing)
    splits = {s: split(s) for s in ("train", "val", "test")}
    # decode once: a PNG costs more to decode than the small model's step, or than a GPU step's share
    cache = data.open_image_cache([it for v in splits.values() for it in v], args.image_size, args.image_cache)
    intra = fixed_intra(model, splits["train"], args, ctx, cache)
    samples = data.CaptionDataset(splits["train"], args.image_size, args.context_length, swap_prob=args.swap_prob,
                                  cache=cache, seed=args.seed, draw=args.draw_captions, features=intra)
    loader = data.make_loader(samples, args.batch_size, True, args.workers, ctx.device, drop_last=True, seed=args.seed)
    each = "one caption each, drawn per epoch" if args.draw_captions else f"{len(samples)} captions"
    log(f"   {args.data} at {root}: train {len(splits['train'])} pairs / {each}, val {len(splits['val'])} pairs, test "
        f"{len(splits['test'])} pairs" + (f" | distractor swap p={args.swap_prob:g}" if args.data == "clevr" else "")
        + (" | the frozen intra blocks' tokens computed once (fixed_intra)" if intra is not None else ""))
    return splits, cache, loader


def checkpoint(model, args, root, metrics):
    """What caption.py and clip_load.load_clip need to rebuild the encoder, plus what produced it."""
    return {"model": model.state_dict(), "config": asdict(model.cfg), "stage": "adapt", "metrics": metrics,
            "tokenizer": {"context_length": args.context_length, "bpe_sha256": clip_load.BPE_SHA256},
            "data": {"name": args.data, "root": str(root), "image_size": args.image_size}, "args": vars(args)}


def save_epoch(model, optimizer, scheduler, args, root, val, epoch, step, best, history):
    """After an epoch: the model when val's `select` figure is at least the best so far (train_utils.improved: a tie
    to the later epoch) to --out, and always the resumable state (*.last.pt)."""
    if improved(val[args.select], best, tie_counts=True):
        best = val[args.select]
        save_atomic(checkpoint(model, args, root, {"val": val, "epoch": epoch}), args.out)
    save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "rng": rng_state(), "epoch": epoch, "step": step, "best": best, "history": history,
                 "args": vars(args)}, last_path(args.out))
    plots.curves(os.path.splitext(args.out)[0] + ".curves.png", history, args.select)  # val, which selects
    return best


def test_best(model, test_items, args, ctx, cache, history, t_start):
    """The best-on-val weights from --out, evaluated once on test; the figures are added to --out."""
    ckpt = torch.load(args.out, map_location="cpu", weights_only=False)
    model.load_state_dict(ckpt["model"])
    test = evaluate(model, test_items, args, ctx, cache)
    if test is None:
        raise SystemExit(diverged(ckpt["metrics"]["epoch"]) + " (on test)")
    chance = chance_metrics(len(test_items))
    ckpt["metrics"].update(test=test, chance=chance, history=history)
    save_atomic(ckpt, args.out)
    log(f"test (best val epoch {ckpt['metrics']['epoch']}): {fmt(test)}")
    log(f"chance:   {fmt(chance)}")
    r1 = ", ".join(f"{d} R@1 {test[d + ' R@1']:.1f} ({test[d + ' R@1'] / chance[d + ' R@1']:.0f}x chance)"
                   for d in ("text->pair", "pair->text"))
    log(f"done in {(time.time() - t_start) / 60:.1f} min ({where(ctx)}): test {r1} -> {args.out}")


def main(argv=None):
    args = get_args(argv)
    ctx = setup(args.seed, args.device, "off" if args.authors_numerics else args.amp)  # their fp16: no autocast
    if args.cuda_graphs is None:  # where the step can be captured, the paper's
        args.cuda_graphs = args.preset == "paper" and ctx.device.type == "cuda" and not (args.compile or
                                                                                          args.authors_numerics)
    model = new_model(args).to(ctx.device)  # the model first: a CLIP file decides the input size (and --n-inter fits)
    if args.authors_numerics:
        authors_fp16_(model)
    root = data.resolve_root(args.data, args.data_root)
    # the authors' 0.5; off on the synthetic set, whose distractors move the camera further than a change
    if args.swap_prob is None or args.data != "clevr":  # only CLEVR-Change has distractor images to swap in
        args.swap_prob = 0.5 if args.data == "clevr" and not (root / "synth.json").is_file() else 0.0
    banner(ctx, args)
    if args.clip and args.image_size != model.cfg.image_resolution:
        log(f"   {args.clip} takes {model.cfg.image_resolution}px images: --image-size {args.image_size} -> "
            f"{model.cfg.image_resolution}")
        args.image_size = model.cfg.image_resolution
    splits, cache, loader = load_data(args, root, ctx, model)

    rule = lr_rule(args)
    freeze(model.named_parameters(), rule)
    log("   what trains:\n" + policy_table(model.named_parameters(), rule))
    theirs = args.optimizer == "bertadam"
    decays = authors_decays(model) if theirs else None
    groups = param_groups(model.named_parameters(), rule, args.weight_decay, decays)
    optimizer = make_optimizer(groups, ctx.device, args.cuda_graphs, args.optimizer, betas=(0.9, 0.98))
    total_steps = args.epochs * len(loader)
    scheduler = (authors_schedule if theirs else warmup_cosine)(optimizer, total_steps, args.warmup)
    # the temperature's parameter clamped after each step, as the authors' (main_task_retrieval.py 287-291)
    optimizer.register_step_post_hook(lambda *_: model.logit_scale.data.clamp_(max=math.log(100)))
    if args.authors_numerics:
        two_gpu_gradient_(model)
    n_train = sum(p.numel() for g in groups for p in g["params"])
    log(f"   model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters ({n_train / 1e6:.1f}M "
        f"trained), vision {model.cfg.vision_layers - model.cfg.n_inter} intra + {model.cfg.n_inter} inter "
        f"blocks, {model.cfg.image_resolution}px; {total_steps} steps of {args.batch_size} pairs")
    start, step, best, history = 0, 0, -1.0, []
    if args.resume:
        state = restore(load_resume(args.out), model, optimizer, scheduler)
        start, step, best, history = state["epoch"], state["step"], state["best"], state["history"]
        log(f"   resumed from {last_path(args.out)} after epoch {start} (best val {args.select} {best:.2f})")
    net = torch.compile(PairText(model)) if args.compile else PairText(model)

    def loss_fn(batch):  # eq. (6)-(8) on a batch of pairs and a caption of each
        static = args.compile or args.cuda_graphs  # reading the length makes a GPU wait
        ids = clip_load.trim(batch["ids"], static=static).to(ctx.device, non_blocking=True)
        if "features" in batch:  # fixed_intra's tokens
            return contrastive_loss(*net(None, None, ids, batch["features"].to(ctx.device))), len(ids)
        before, after = (clip_load.normalize(batch[k].to(ctx.device, non_blocking=True)) for k in ("before", "after"))
        return contrastive_loss(*net(before, after, ids)), len(ids)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    graphed = GraphedStep(ctx, loss_fn, optimizer, scheduler, params, args.grad_clip) if args.cuda_graphs else None

    # training, each step loss_fn then train_utils.update (backward, clip, step): select on val, never on test
    t_start = time.time()
    try:
        for epoch in range(start, args.epochs):
            data.set_epoch(loader, epoch)
            t0 = time.time()
            progress = Progress(epoch, args.epochs, step, total_steps, args.log_every)
            loss = train_epoch(ctx, net, loader, loss_fn, optimizer, scheduler, progress, args.grad_clip, graphed)
            step = progress.step
            val = evaluate(model, splits["val"], args, ctx, cache)
            if val is None:
                raise SystemExit(diverged(epoch + 1))
            history.append({"epoch": epoch + 1, "loss": loss, **val})
            log(f"epoch {epoch + 1}/{args.epochs} done in {time.time() - t0:.0f}s | loss {loss:.4f} | "
                f"val {fmt(val)}{' | best so far: saved' if improved(val[args.select], best, True) else ''}")
            best = save_epoch(model, optimizer, scheduler, args, root, val, epoch + 1, step, best, history)
    except KeyboardInterrupt:
        interrupted(args.out)
    test_best(model, splits["test"], args, ctx, cache, history, t_start)


if __name__ == "__main__":
    try:
        main()
    except data.BadImage as e:  # an undecodable image met while training: its name and what to do, no traceback
        raise SystemExit(data.exit_message(e)) from None
