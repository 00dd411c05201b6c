"""Stage 1 of CLIP4IDC: adapt CLIP to image *pairs* by contrastive pair <-> text retrieval (paper Sec. 3.2).

    python adapt.py --data clevr                          # writes adapted.pt
    python adapt.py --data clevr --n-inter 0              # every block intra, none inter (Table 7: 12 + 0; mini: 6 + 0)
    python adapt.py --data clevr --lr-new 0 --lr-clip 0   # nothing trains: not adapted (Table 5), p as adapted's starts

The pair encoder (model.py) turns (before, after) into a vector v, CLIP's text tower the caption into g; a
symmetric InfoNCE loss (eq. 6-8) pulls each pair to its own caption. It sees change pairs only (CLEVR-Change's
"semantic" setting), each caption once an epoch; --swap-prob swaps in the before image's moved-camera view. One
method, presets of values: paper (the authors'), mini (the shipped small CLIP, minutes on a CPU), scratch (a small CLIP
from nothing).
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
import synth
from model import CLIP, INPUT_EMBEDDINGS, PAIR_KEYS, CLIPConfig, authors_fp16_, heads_for, share_joint_positions_
from train_utils import (BertAdam, GraphedStep, HelpFormatter, Progress, Settings, at_least, authors_decays,
                         authors_schedule, check_resume, check_sizes, concrete_amp, end_epoch, freeze, given_flags,
                         image_cache_flag, interrupted, load_resume, log, new_run, over_preset, param_groups,
                         pick_device, policy_table, preset_values, resume_run, run_flags, save_atomic, save_state,
                         setup, train_epoch, where)

# -----------------------------------------------------------------------------
# settings: a literal preset (None: decided by the weights, data or device), the flags given over it

SIZES = dict(image_size=None, vision_width=None, vision_layers=None, patch_size=None, text_width=None,
             text_layers=None, embed_dim=None)  # None: the CLIP file's own
PRESETS = {
    # the authors' (main_task_retrieval.py, scripts/retrieve_clevr.sh); epochs None: 12, on spot 20 (retrieve_spot.sh)
    "paper": dict(clip="ViT-B/32", n_inter=3, **SIZES, batch_size=128, epochs=None, lr_new=1e-4, lr_clip=1e-7,
                  weight_decay=0.2, betas=(0.9, 0.98), eps=1e-6, warmup=0.1, grad_clip=1.0, workers=8, swap_prob=None,
                  shared_p=0.0, freeze_blocks=0, cuda_graphs=None),
}
# the paper in miniature: the shipped small CLIP (12x12 patches of 8 px), 4 + 2 blocks; its 4 intra blocks fixed
# (their tokens computed once), p alike in both images, so that the inter blocks learn to compare
PRESETS["mini"] = {**PRESETS["paper"], "clip": "mini64-synth", "n_inter": 2, "batch_size": 32, "epochs": 2,
                   "lr_new": 1e-3, "lr_clip": 3e-4, "weight_decay": 0.05, "workers": 0, "shared_p": 10.0,
                   "freeze_blocks": 4}
# the from-scratch ablation: ViT-B/32's 9 + 3 blocks at 1/12 of its width, one rate
PRESETS["scratch"] = {**PRESETS["mini"], "clip": None, "n_inter": 3, "image_size": 96, "vision_width": 64,
                      "vision_layers": 12, "patch_size": 16, "text_width": 128, "text_layers": 3, "embed_dim": 128,
                      "epochs": 3, "lr_new": 3e-4, "lr_clip": 3e-4, "shared_p": 0.0, "freeze_blocks": 0}
SELECT = "text->pair R@1"  # picks the epoch on val, a tie the later one (the authors', main_task_retrieval.py 447, 558)


def parser():
    pre = preset_values(PRESETS)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    # data
    p.add_argument("--data", default="clevr", choices=list(data.ROOTS), help="dataset (pairs: your own, README "
                   "'Your own image pairs')")
    p.add_argument("--data-root", help="dataset directory (default data/<name>; clevr: a synthetic set when absent)")
    p.add_argument("--skip-missing", action="store_true", help="drop pairs whose images are missing")
    p.add_argument("--swap-prob", type=at_least(0.0, float, most=1.0), default=None, help="CLEVR: chance "
                   "of the before image's distractor, camera moved (default: the authors' 0.5; 0 on the synthetic set)")
    p.add_argument("--workers", type=at_least(0), default=None, help=f"DataLoader worker processes {pre('workers')}")
    image_cache_flag(p)
    # model
    p.add_argument("--preset", default=None, choices=list(PRESETS), help="default: mini for a shipped --clip, paper "
                   "for another; without --clip, paper on a real dataset, else mini")
    p.add_argument("--clip", type=clip_load.weights_arg, default=None, help="CLIP weights: a file, a Hugging Face "
                   f"folder, one of OpenAI's {', '.join(clip_load.MODELS)} (downloaded) or a shipped "
                   f"{' or '.join(clip_load.SHIPPED)} {pre('clip')}")
    clip_load.activation_flag(p)
    p.add_argument("--n-inter", type=at_least(0), default=None, help="inter blocks, the last of the image tower (the "
                   f"rest intra; ViT-L/14: 21 + 3, where the authors' code fixes 9 + 15) {pre('n_inter')}")
    p.add_argument("--context-length", type=at_least(2), default=32, help="caption tokens incl. start/end")
    p.add_argument("--shared-p", type=at_least(0.0, float), default=None, help="not the paper's: p alike in both "
                   f"images, codes of this norm; 0: the authors' random p {pre('shared_p')}")
    for name in ("image-size", "vision-width", "vision-layers", "patch-size", "text-width", "text-layers",
                 "embed-dim"):
        p.add_argument(f"--{name}", type=at_least(1), default=None, help="model size, without a CLIP file "
                       f"{pre(name.replace('-', '_'))}")
    # optimization
    p.add_argument("--epochs", type=at_least(1), default=None, help=f"training epochs {pre('epochs')} (paper: 12, on "
                   "spot 20)")
    p.add_argument("--batch-size", type=at_least(1), default=None, help="captions (each with its pair) per step "
                   f"{pre('batch_size')}")
    p.add_argument("--lr-new", type=at_least(0.0, float), default=None, help=f"lr of e1, e2, p, ln_mid {pre('lr_new')}")
    p.add_argument("--lr-clip", type=at_least(0.0, float), default=None, help=f"lr of CLIP's weights {pre('lr_clip')}"
                   " (0 with --lr-new 0: nothing trains, the encoder not adapted)")
    p.add_argument("--freeze-blocks", type=at_least(0), default=None, help="not the paper's: CLIP's first N image "
                   f"blocks frozen {pre('freeze_blocks')}")
    p.add_argument("--weight-decay", type=at_least(0.0, float), help=f"weight decay {pre('weight_decay')}")
    # run
    run_flags(p, pre=pre)
    p.add_argument("--authors-numerics", action="store_true", help="the authors' fp16 (model.authors_fp16_) and "
                   "two-GPU gradient (two_gpu_gradient_)")
    p.add_argument("--out", default="adapted.pt", help="best-on-val checkpoint; resumable state in *.last.pt")
    p.add_argument("--compile", action="store_true", help="torch.compile the training step (CUDA)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None, help="the training step as "
                   "one CUDA graph, on a CPU run uncaptured (default: on CUDA without --compile, --authors-numerics)")
    p.add_argument("--eval-batch-size", type=at_least(1), default=256, help="pairs per evaluation batch")
    return p


def settings(argv=None):
    """Every setting, decided once: the preset, the flags given over it, what the CLIP, data and device decide."""
    p = parser()
    flags, given = p.parse_args(argv), given_flags(p, argv)
    if flags.clip:  # a shipped small CLIP means the miniature, any other weights the paper
        preset = flags.preset or ("mini" if flags.clip in clip_load.SHIPPED else "paper")
    else:  # a real dataset means the paper (with ViT-B/32), the synthetic set the miniature
        preset = flags.preset or ("paper" if data.is_real(flags.data, flags.data_root) else "mini")
    bad = lambda flag, why: p.error(f"argument {flag}: {why}")
    s = over_preset(flags, given, PRESETS, preset, bad)
    if "swap_prob" in given and flags.data != "clevr":
        bad("--swap-prob", f"only CLEVR-Change has images to swap in, not {flags.data}")
    check_resume(p, s["resume"], s["out"])
    if s["clip"]:
        if preset == "scratch":
            bad("--clip", "the scratch preset trains a model from nothing: give --preset mini or paper")
        if given_sizes := sorted(given & SIZES.keys()):
            bad("--" + given_sizes[0].replace("_", "-"), f"{s['clip']} has its own sizes: leave it out")
        cfg = clip_load.clip_config(s["clip"], flags.activation)  # downloaded if need be
        s.update(activation=cfg.activation, image_size=cfg.image_resolution, vision_width=cfg.vision_width,
                 vision_layers=cfg.vision_layers, patch_size=cfg.vision_patch_size, text_width=cfg.transformer_width,
                 text_layers=cfg.transformer_layers, embed_dim=cfg.embed_dim)
    else:
        check_sizes(p, s["image_size"], s["patch_size"], {"--vision-width": s["vision_width"],
                                                          "--text-width": s["text_width"]})
        s["activation"] = s["activation"] or "quick_gelu"
    if s["n_inter"] > s["vision_layers"]:
        bad("--n-inter", f"the image tower has {s['vision_layers']} blocks")
    root = data.resolve_root(flags.data, flags.data_root)  # the synthetic set rendered on first use
    if s["swap_prob"] is None:  # off on the synthetic set, whose distractors move the camera more
        s["swap_prob"] = 0.5 if flags.data == "clevr" and data.is_real("clevr", root) else 0.0
    if s["epochs"] is None:
        s["epochs"] = 20 if flags.data == "spot" else 12
    s.update(data_root=str(root), device=pick_device(s["device"]))
    s["amp"] = concrete_amp(s["amp"], s["device"])
    if s["cuda_graphs"] is None:
        s["cuda_graphs"] = s["device"] != "cpu" and not (s["compile"] or s["authors_numerics"])
    return Settings(**s)


# -----------------------------------------------------------------------------
# model, loss, learning-rate rule


def new_model(args):
    """CLIP from a file, or from nothing, with fresh pair parameters."""
    clip = clip_load.load_clip(args.clip, n_inter=args.n_inter, activation=args.activation) if args.clip else CLIP(
        CLIPConfig(args.embed_dim, args.image_size, args.vision_layers, args.vision_width, args.patch_size,
                   args.context_length, transformer_width=args.text_width, transformer_layers=args.text_layers,
                   transformer_heads=heads_for(args.text_width), n_inter=args.n_inter, activation=args.activation))
    if args.shared_p:
        share_joint_positions_(clip.visual, args.shared_p)
    return clip


class PairText(torch.nn.Module):
    """The training forward (what --compile compiles): pair vectors, caption features, scale."""

    def __init__(self, clip):
        super().__init__()
        self.clip = clip

    def forward(self, before, after, ids, intra=None):
        """intra: fixed_intra's tokens (B, 2, n+1, width), cast to the tower's dtype (fp16 under --authors-numerics)."""
        if intra is None:
            v = self.clip.encode_pair(before, after)
        else:
            v = self.clip.visual.inter(intra.flatten(1, 2).to(self.clip.visual.conv1.weight.dtype))
        return v.vector, self.clip.encode_text(ids), self.clip.logit_scale


@torch.no_grad()
def fixed_intra(model, items, args, ctx, cache):
    """Where nothing before the inter blocks trains (the mini preset), the training pairs' intra-block tokens
    (pairs, 2, n+1, width), computed once; else None. Without a CLIP file (scratch) the input embeddings train; a
    swap (--swap-prob) changes a before image from epoch to epoch."""
    n_intra = model.cfg.vision_layers - model.cfg.n_inter
    if not (args.clip and (args.freeze_blocks >= n_intra or args.lr_clip == 0) and args.swap_prob == 0):
        return None
    loader = data.make_loader(data.ImageDataset(items, args.image_size, cache=cache), args.eval_batch_size,
                              workers=args.workers, device=ctx.device)
    out = []
    for batch in loader:
        with ctx.amp:
            x = model.visual.intra(model.visual.stem(torch.cat(data.pair_images(batch, ctx.device))))
        out.append(torch.stack(x.float().chunk(2), 1).cpu())
    return torch.cat(out)


def two_gpu_gradient_(model):
    """The authors' two GPUs: AllGather's backward keeps a rank's slice (until_module.py 265-269) and
    DDP averages: every gradient but logit_scale's halved."""
    for p in model.parameters():
        if p.requires_grad and p is not model.logit_scale:
            p.register_hook(lambda g: g * 0.5)
    return model


def contrastive_loss(v, g, logit_scale):
    """eq. (6)-(8): with s = exp(logit_scale) <= 100 (the temperature >= 0.01; theirs clamps after each step
    only), L = (CE(s v g^T, i) + CE(s g v^T, i)) / 2 over the batch's B pairs and their captions, in fp32 (a pair's
    other captions in the batch are negatives, as theirs). pretrain.py, which shares it, adds hard negatives as g's
    rows B.."""
    with torch.autocast(v.device.type, enabled=False):
        v, g = F.normalize(v.float(), dim=-1), F.normalize(g.float(), dim=-1)
        scale = logit_scale.float().clamp(max=math.log(100)).exp()
        logits = scale * v @ g.t()
        labels = torch.arange(len(v), device=v.device)
        # text -> pair over the batch's own texts: a hard negative (g's rows B..) has no pair of its own
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits[:, :len(v)].t(), labels)) / 2


def lr_rule(args):
    """What trains, at which rate: parameter name -> learning rate (None: fixed). e1, e2, p, ln_mid at lr_new; CLIP's
    weights at lr_clip, except that a CLIP file's input embeddings (the authors') and the first --freeze-blocks image
    blocks stay fixed. A rate of 0 fixes."""
    def lr(name):
        if name.startswith(PAIR_KEYS):
            return args.lr_new or None
        first = name.startswith("visual.transformer.resblocks.") and int(name.split(".")[3]) < args.freeze_blocks
        fixed = first or (args.clip and name.startswith(INPUT_EMBEDDINGS))
        return None if fixed else args.lr_clip or None
    return lr


# -----------------------------------------------------------------------------
# retrieval evaluation


@torch.no_grad()
def pair_vectors(model, items, args, ctx, cache=None):
    """The pairs' vectors v (P, D), eq. (5)."""
    model.eval()
    ds = data.ImageDataset(items, args.image_size, cache=cache)
    loader = data.make_loader(ds, args.eval_batch_size, workers=args.workers, device=ctx.device)
    pairs = []
    for batch in loader:
        with ctx.amp:
            pairs.append(model.encode_pair(*data.pair_images(batch, ctx.device)).vector.float())
    return torch.cat(pairs)


@torch.no_grad()
def encode_split(model, items, args, ctx, cache=None):
    """Pair vectors (P, D) and caption features (T, D), normalized; owner[t] = index of caption t's pair."""
    pairs = pair_vectors(model, items, args, ctx, cache)
    owner, captions = map(list, zip(*[(i, c) for i, it in enumerate(items) for c in it.captions]))
    owner = torch.tensor(owner)
    texts = []
    for i in range(0, len(captions), args.eval_batch_size):
        ids = clip_load.tokenize(captions[i:i + args.eval_batch_size], args.context_length, truncate=True)
        with ctx.amp:
            texts.append(model.encode_text(ids.to(ctx.device)).float())
    return F.normalize(pairs, dim=-1).cpu(), F.normalize(torch.cat(texts), dim=-1).cpu(), owner


def retrieval_metrics(sim, owner):
    """sim (P, T), owner[t] caption t's pair, ranked as the authors' metrics.py: text -> pair among the pairs,
    pair -> text among the caption sets (a set's best caption); ties pessimistic (theirs: arbitrary); MdR/MnR the
    median/mean rank, MdR np.median's (pair -> text), torch's (text -> pair). Worked by hand:
    test_all.py's test_retrieval_metrics_by_hand."""
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
    return out


def chance_metrics(P):
    """Random similarities' figures: R@K = K / P, mean and median ranks (P + 1) / 2."""
    out = {}
    for d in ("pair->text", "text->pair"):
        out.update({f"{d} R@{k}": 100 * min(k, P) / P for k in (1, 5, 10)})
        out[f"{d} MdR"] = out[f"{d} MnR"] = (P + 1) / 2
    return out


def evaluate(model, items, args, ctx, cache=None):
    v, g, owner = encode_split(model, items, args, ctx, cache)
    return retrieval_metrics(v @ g.t(), owner) if torch.isfinite(v).all() and torch.isfinite(g).all() else None


def diverged(epoch):
    return (f"evaluation after epoch {epoch}: the encoder's features are NaN/inf (the weights diverged): stopping. "
            f"The best checkpoint is kept; start again with a lower learning rate.")


def fmt(m):
    return " | ".join(f"{d} R@1/5/10 " + "/".join(f"{m[f'{d} R@{k}']:.1f}" for k in (1, 5, 10)) +
                      f" MdR {m[d + ' MdR']:.0f}" for d in ("pair->text", "text->pair"))


# -----------------------------------------------------------------------------
# the run


def banner(ctx, args):
    log(f"== adapt.py: preset '{args.preset}' on {where(ctx)} ==")
    paper = f"For the paper's results give --clip ViT-B/32 ({clip_load.WEIGHTS})."
    if args.clip in clip_load.SHIPPED:
        log(f"   adapting the SMALL CLIP PRETRAINED ON SYNTHETIC SCENES in assets/ "
            f"({clip_load.SHIPPED[args.clip][0]}): the paper in miniature. {paper}")
    elif args.preset == "scratch":
        log(f"   training a SMALL CLIP-shaped model FROM SCRATCH (the from-scratch ablation). {paper}")
    log("   " + args.line())


def load_data(args, ctx, model):
    # CLEVR-Change's "semantic" setting: the change pairs alone (stage 2's "total" adds the distractor pairs)
    split = lambda s: data.load_items(args.data, args.data_root, s, setting="semantic", skip_missing=args.skip_missing)
    splits = {s: split(s) for s in ("train", "val", "test")}
    cache = data.open_image_cache([it for v in splits.values() for it in v], args.image_size, args.image_cache)
    intra = fixed_intra(model, splits["train"], args, ctx, cache)
    samples = data.CaptionDataset(splits["train"], args.image_size, args.context_length, swap_prob=args.swap_prob,
                                  cache=cache, seed=args.seed, features=intra)  # every caption once an epoch
    loader = data.make_loader(samples, args.batch_size, True, args.workers, ctx.device, drop_last=True, seed=args.seed)
    if not len(loader):
        raise SystemExit(f"--batch-size {args.batch_size}: more than the {len(samples)} training samples, so no step "
                         "would run: give a smaller one")
    once = " | the fixed intra blocks' tokens computed once (fixed_intra)" if intra is not None else ""
    log(f"   {args.data} at {args.data_root}: train {len(splits['train'])} pairs / {len(samples)} captions, val "
        f"{len(splits['val'])} "
        f"pairs, test {len(splits['test'])} pairs{once}")
    return splits, cache, loader


def checkpoint(model, args, metrics):
    """What clip_load.load_clip rebuilds the encoder from, and what produced it."""
    return {"model": model.state_dict(), "config": asdict(model.cfg), "stage": "adapt", "metrics": metrics,
            "tokenizer": {"context_length": args.context_length, "bpe_sha256": clip_load.BPE_SHA256},
            "data": {"name": args.data, "root": args.data_root, "image_size": args.image_size}, "args": vars(args)}


def test_best(model, splits, args, ctx, cache, history, t_start):
    """The best-on-val weights (--out) evaluated once on test; the figures added to --out."""
    ckpt = torch.load(args.out, map_location="cpu", weights_only=False)
    model.load_state_dict(ckpt["model"])
    test = evaluate(model, splits["test"], args, ctx, cache)
    if test is None:
        raise SystemExit(diverged(ckpt["metrics"]["epoch"]) + " (on test)")
    chance = chance_metrics(len(splits["test"]))
    probed = None
    if synth.is_synthetic(args.data_root):  # what v knows of the change, read against the renderer's records
        train, test_items = splits["train"][:1000], splits["test"]
        probed = synth.probe([it.id for it in train], pair_vectors(model, train, args, ctx, cache).cpu(),
                             [it.id for it in test_items], pair_vectors(model, test_items, args, ctx, cache).cpu(),
                             synth.read_scenes(args.data_root))
    ckpt["metrics"].update(test=test, chance=chance, history=history, probe=probed)
    save_atomic(ckpt, args.out)
    log(f"test (best val epoch {ckpt['metrics']['epoch']}): {fmt(test)}")
    log(f"chance:   {fmt(chance)}")
    if probed:
        attrs = ", ".join(f"{k} {v:.0f}%" for k, v in probed.items() if k != "type")
        log(f"what v knows of the change (a linear probe fit on 1,000 training pairs; test): the changed object's "
            f"{attrs}; the change type {probed['type']:.0f}%")
    r1 = ", ".join(f"{d} R@1 {test[d + ' R@1']:.1f} ({test[d + ' R@1'] / chance[d + ' R@1']:.0f}x chance)"
                   for d in ("text->pair", "pair->text"))
    log(f"done in {(time.time() - t_start) / 60:.1f} min ({where(ctx, speed=True)}): test {r1} -> {args.out}")


def main(argv=None):
    args = settings(argv)
    ctx = setup(args.seed, args.device, args.amp)
    banner(ctx, args)
    model = new_model(args).to(ctx.device)
    if args.authors_numerics:
        authors_fp16_(model)
    splits, cache, loader = load_data(args, ctx, model)

    rule = lr_rule(args)
    freeze(model.named_parameters(), rule)
    log("   what trains:\n" + policy_table(model.named_parameters(), rule))
    groups = param_groups(model.named_parameters(), rule, args.weight_decay, authors_decays(model))
    if not groups:  # every rate 0: the encoder not adapted, evaluated as it starts
        save_atomic(checkpoint(model, args, {"val": evaluate(model, splits["val"], args, ctx, cache), "epoch": 0}),
                    args.out)
        return test_best(model, splits, args, ctx, cache, [], time.time())
    optimizer = BertAdam(groups, lr=args.lr_new, betas=args.betas, eps=args.eps)  # a default: each group has its rate
    total_steps = args.epochs * len(loader)
    scheduler = authors_schedule(optimizer, total_steps, args.warmup)  # warmup, then cosine
    # the temperature clamped after each step, as the authors' (main_task_retrieval.py 287-291)
    optimizer.register_step_post_hook(lambda *_: model.logit_scale.data.clamp_(max=math.log(100)))
    if args.authors_numerics:
        two_gpu_gradient_(model)
    params = [p for g in groups for p in g["params"]]
    log(f"   model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        f"({sum(p.numel() for p in params) / 1e6:.1f}M trained), vision {model.cfg.vision_layers - model.cfg.n_inter} "
        f"intra + {model.cfg.n_inter} inter blocks, {model.cfg.image_resolution}px; {total_steps} steps of batch "
        f"{args.batch_size}")
    run = resume_run(load_resume(args.out), model, optimizer, scheduler, args) if args.resume else new_run()
    net = torch.compile(PairText(model)) if args.compile else PairText(model)

    def update(batch):  # loss, backward, clipping, BertAdam; zeroing and the schedule are the caller's
        ids = clip_load.trim(batch["ids"], static=args.compile or args.cuda_graphs).to(ctx.device, non_blocking=True)
        with ctx.amp:
            if "features" in batch:  # fixed_intra's tokens
                loss = contrastive_loss(*net(None, None, ids, batch["features"].to(ctx.device)))
            else:
                loss = contrastive_loss(*net(*data.pair_images(batch, ctx.device), ids))
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        optimizer.step()
        return loss.detach()

    def eager_step(batch):
        optimizer.zero_grad(set_to_none=True)
        loss = update(batch)
        scheduler.step()
        return loss
    # the step: zero, update, schedule; eagerly, or captured once as a CUDA graph and replayed (GraphedStep)
    step = GraphedStep(ctx, update, optimizer, scheduler, params) if args.cuda_graphs else eager_step

    # select on val, never on test
    t_start = time.time()
    try:
        for epoch in range(run["epoch"], args.epochs):
            data.set_epoch(loader, epoch)
            t0 = time.time()
            model.train()
            loss = train_epoch(ctx, loader, step, optimizer, run, Progress(epoch, args.epochs, total_steps,
                                                                           args.log_every))
            val = evaluate(model, splits["val"], args, ctx, cache)
            if val is None:
                raise SystemExit(diverged(epoch + 1))
            better = end_epoch(run, loss, val, val[SELECT])  # the best val text->pair R@1; a tie: the later epoch
            if better:
                save_atomic(checkpoint(model, args, {"val": val, "epoch": epoch + 1}), args.out)
            log(f"epoch {epoch + 1}/{args.epochs} done in {time.time() - t0:.0f}s | loss {loss:.4f} | "
                f"val {fmt(val)}{' | best so far: saved' if better else ''}")
            save_state(args.out, model, optimizer, scheduler, run, args)
            plots.curves(os.path.splitext(args.out)[0] + ".curves.png", run["history"], SELECT)
    except KeyboardInterrupt:
        interrupted(args.out)
    test_best(model, splits, args, ctx, cache, run["history"], t_start)


if __name__ == "__main__":
    data.run(main)
