"""Stage 0 in miniature: pretrain a small CLIP on single synthetic scenes, image <-> description.

    python pretrain.py                                # render data/clevr_pretrain once, train, evaluate
    python pretrain.py --resume                       # continue a killed run exactly (mid-epoch too)
    python pretrain.py --eval-only --ckpt mini64-synth     # held-out figures of a checkpoint (the shipped one)
    python pretrain.py --export clip_mini64_synth.pt  # the run's latest weights as the shipped fp16 file

CLIP4IDC adapts a CLIP that already sees objects; the quickstart has none, so this file makes one in miniature:
model.py's CLIP (OpenAI's names and shape: it loads as ViT-B-32.pt does), trained with CLIP's contrastive loss on
single images of synthetic scenes (another seed than the quickstart's set) and descriptions naming every object's
size, colour, material and shape. Each image also meets hard negatives (NegCLIP: its description with one attribute
changed or swapped); `--object-loss` makes the patch token under each object pick its own phrase (as FILIP); the
image tower's attention starts mimetically (Trockman and Kolter 2023). The defaults are the shipped
assets/clip_mini64_synth.pt's recipe.
"""
import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict
from functools import partial
from multiprocessing import Pool
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

import adapt
import clip_load
import data
import synth
from model import CLIP, PAIR_KEYS, CLIPConfig, heads_for
from train_utils import (HelpFormatter, Progress, Settings, at_least, check_resume, check_sizes, concrete_amp,
                         end_epoch, fmt_time, freeze, given_flags, last_path, load_resume, log, new_run, param_groups,
                         pick_device, resume_run, run_flags, save_atomic, save_state, setup, train_epoch, where)

ROOT = "data/clevr_pretrain"
# the shipped mini64-synth's recipe: 12x12 patches of 8 px (an object spans several); words and tokens 64 wide, as
# the authors' captioner needs (the word table 6.3 MB in fp16)
DEFAULTS = dict(scenes=12000, image_size=96, patch_size=8, vision_width=128, vision_layers=6, text_width=64,
                text_layers=4, embed_dim=64, context_length=77, batch_size=128, negatives=1, lr=5e-4,
                weight_decay=0.1, warmup=0.02, samples=150_000, eval_every=150)
MODES = {  # what each mode but training reads: another flag given is an error
    "--export": {"export", "out"},
    "--eval-only": {"eval_only", "ckpt", "out", "root", "scenes", "render_seed", "workers", "eval_images",
                    "clevr_root", "device", "amp", "seed"}}


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    d = DEFAULTS
    p.add_argument("--root", default=ROOT, help="the pretraining scenes, rendered there on first use")
    p.add_argument("--scenes", type=at_least(3), default=d["scenes"], help="scenes to render (3 images each)")
    p.add_argument("--render-seed", type=int, default=1, help="the scenes' seed (the quickstart's set uses 0)")
    sizes = {"image-size": "input size", "patch-size": "ViT patch size", "vision-width": "image tower width "
             "(heads = width / 64)", "vision-layers": "image tower blocks", "text-width": "text tower width (heads = "
             "width / 64)", "text-layers": "text tower blocks", "embed-dim": "joint embedding size", "context-length":
             "text positions", "batch-size": "images per step", "negatives": "hard-negative descriptions per image"}
    for name, what in sizes.items():
        low = {"negatives": 0, "context-length": 2}.get(name, 1)
        p.add_argument(f"--{name}", type=at_least(low), default=d[name.replace("-", "_")], help=what)
    p.add_argument("--lr", type=at_least(0.0, float), default=d["lr"], help="peak learning rate (AdamW)")
    p.add_argument("--weight-decay", type=at_least(0.0, float), default=d["weight_decay"],
                   help="AdamW weight decay (matrices)")
    run_flags(p, warmup=d["warmup"])
    p.add_argument("--object-loss", type=at_least(0.0, float), default=1.0, help="weight of the per-object loss "
                   f"(0: off): each object's patch token picks its phrase among all {len(OBJECTS)}")
    p.add_argument("--mimetic-init", action=argparse.BooleanOptionalAction, default=True, help="the image tower's "
                   "attention initialized mimetically (mimetic_init_)")
    p.add_argument("--samples", type=at_least(1), default=d["samples"], help="training images seen in all (the "
                   "schedule)")
    p.add_argument("--eval-every", type=at_least(1), default=d["eval_every"], help="steps between held-out "
                   "evaluations, each also writing the resumable state")
    p.add_argument("--eval-images", type=at_least(1), default=1000, help="held-out images evaluated")
    p.add_argument("--out", default="pretrained.pt", help="the run's weights (fp32); resumable state in *.last.pt")
    p.add_argument("--time-limit", type=at_least(0.0, float), default=None,
                   help="minutes: stop after the first evaluation past this (the state is saved; --resume continues)")
    p.add_argument("--eval-only", action="store_true", help="evaluate --ckpt on the held-out scenes and stop")
    p.add_argument("--ckpt", type=clip_load.weights_arg, help="with --eval-only: a CLIP checkpoint (default: --out)")
    p.add_argument("--clevr-root", default=None, help="with --eval-only: also probe the images of this set of "
                   "CLEVR's own renders")
    p.add_argument("--export", default=None, help="write --out's weights as a shipped fp16 file at this path and stop")
    p.add_argument("--workers", type=at_least(1), default=None, help="render/decode processes (default: all cores)")
    args, given = p.parse_args(argv), given_flags(p, argv)
    s = vars(args)
    check_sizes(p, args.image_size, args.patch_size, {"--vision-width": args.vision_width,
                                                      "--text-width": args.text_width})
    mode = next((f"--{m}" for m in ("export", "eval-only") if s[m.replace("-", "_")]), "")
    unread = given - MODES[mode] if mode else given & {"ckpt", "clevr_root"}
    if unread:
        flag = "--" + sorted(unread)[0].replace("_", "-")
        p.error(f"argument {flag}: not read " + (f"with {mode}" if mode else "when training: it goes with --eval-only"))
    if args.clevr_root and not (Path(args.clevr_root) / "scenes.json").is_file():  # before any scene is rendered
        p.error(f"argument --clevr-root: no scenes.json (CLEVR's scene records) in {args.clevr_root}")
    check_resume(p, args.resume, args.out)
    for flag, wants in (("--export", args.export), ("--eval-only", args.eval_only and not args.ckpt)):
        if wants and not os.path.isfile(args.out):
            p.error(f"argument {flag}: no run's weights at --out {args.out}: give the --out a run wrote"
                    + (", or --ckpt" if flag == "--eval-only" else ""))
    if args.eval_only:  # the checkpoint's sizes
        cfg = clip_load.clip_config(args.ckpt or args.out)
        s.update(image_size=cfg.image_resolution, context_length=cfg.context_length)
    s["device"] = pick_device(args.device)
    s["amp"] = concrete_amp(args.amp, s["device"])
    return Settings(**s)


# -----------------------------------------------------------------------------
# data: every image of the rendered scenes with the objects a viewer sees in it


def scene_images(root, split, workers=None):
    """[(image path, [(object, (u, v))])] of one split of a synthetic set: each scene's three images with their
    objects, but those with an object cut or hidden (synth.views)."""
    meta = json.loads((root / "synth.json").read_text())
    ids = [int(i) for i in json.loads((root / "splits.json").read_text())[split]]
    with Pool(workers or os.cpu_count()) as pool:
        seen = pool.map(partial(synth.views, seed=meta["seed"], size=tuple(meta["size"])), ids)
    return [(str(root / f"{name}_{i:06d}.png"), objs)
            for i, v in zip(ids, seen) for name, objs in v.items() if objs is not None]


def clevr_images(root):
    """scene_images of a set with CLEVR's own scene records: each object at CLEVR's pixel_coords, as fractions."""
    out = []
    for s in json.loads((Path(root) / "scenes.json").read_text())["scenes"]:
        for kind in ("default", "semantic", "nonsemantic"):
            if f"{kind}_scene" in s:
                image = Path(root) / s[f"{kind}_image"]
                w, h = Image.open(image).size
                out.append((str(image), [({a: o[a] for a in synth.ATTRS}, (o["pixel_coords"][0] / w,
                                                                          o["pixel_coords"][1] / h))
                                         for o in s[f"{kind}_scene"]["objects"]]))
    return out


OBJECTS = [(s, c, m, h) for s in synth.SIZES for c in synth.COLORS for m in synth.MATERIALS for h in synth.SHAPES]


def cell(u, v, grid):
    """The token index (after [CLS]) of the patch at (u, v), fractions of the image's width and height."""
    return 1 + min(grid - 1, int(v * grid)) * grid + min(grid - 1, int(u * grid))


class Descriptions(torch.utils.data.Dataset):
    """Image k -> (uint8 image [3, S, S], its description, `negatives` hard negatives), drawn from (seed, epoch, k)."""

    def __init__(self, images, cache, negatives, context_length, patch_size, seed=0, objects=False):
        self.images, self.cache, self.negatives, self.context_length = images, cache, negatives, context_length
        self.patch_size, self.seed, self.objects = patch_size, seed, objects

    def __len__(self):
        return len(self.images)

    def texts(self, k, epoch):
        objs = [o for o, _ in self.images[k][1]]
        wording = int(data.sample_rng(self.seed, epoch, k).integers(2 ** 31))
        rng = random.Random(wording)
        return [synth.description(objs, wording)] + [synth.description(synth.hard_negative(rng, objs), wording)
                                                    for _ in range(self.negatives)]

    def batch(self, keys, epoch):
        """-> {"images": (B, 3, S, S) uint8, "ids": (B * (1 + negatives), L): the descriptions, then each
        image's first negative, then its second...}; with `objects` also "objects" (image, patch cell, index in
        OBJECTS) rows and "phrases" (len(OBJECTS), L)."""
        images = self.cache.batch([self.images[k][0] for k in keys])
        texts = [self.texts(k, epoch) for k in keys]
        ordered = [t[j] for j in range(1 + self.negatives) for t in texts]
        batch = {"images": images, "ids": clip_load.tokenize(ordered, self.context_length, truncate=True)}
        if not self.objects:  # its 96 phrases are tokenized only where the object loss reads them
            return batch
        grid = self.cache.data.shape[-1] // self.patch_size
        objects = torch.tensor([(b, cell(u, v, grid), OBJECTS.index(tuple(o[a] for a in synth.ATTRS)))
                                for b, k in enumerate(keys) for o, (u, v) in self.images[k][1]])
        rng = random.Random(f"objects-{self.seed}-{epoch}-{keys[0]}")  # the wording, again the same on resume
        phrases = ["a " + " ".join(rng.choice(synth.SAY.get(w, (w,))) for w in o) for o in OBJECTS]
        return {**batch, "objects": objects, "phrases": clip_load.tokenize(phrases, self.context_length)}


class Steps:
    """The batches of global steps [start, stop), a function of the step alone: a run resumes mid-epoch exactly."""

    def __init__(self, dataset, batch_size, seed, start, stop):
        self.ds, self.B, self.seed, self.start, self.stop = dataset, batch_size, seed, start, stop
        self.per_epoch = len(dataset) // batch_size

    def __len__(self):
        return self.stop - self.start

    def __iter__(self):
        order, order_epoch = None, None
        for s in range(self.start, self.stop):
            epoch, b = divmod(s, self.per_epoch)
            if epoch != order_epoch:  # drawn once per epoch
                g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                order, order_epoch = torch.randperm(len(self.ds), generator=g), epoch
            yield self.ds.batch(order[b * self.B:(b + 1) * self.B].tolist(), epoch)


# -----------------------------------------------------------------------------
# the losses: CLIP's (adapt.contrastive_loss, each image's hard negatives among its texts), and the objects'


def object_loss(obj, phrases, target, logit_scale):
    """Cross entropy of each object's patch token obj (N, D) over the phrases (len(OBJECTS), D) of every object."""
    obj, phrases = F.normalize(obj.float(), dim=-1), F.normalize(phrases.float(), dim=-1)
    return F.cross_entropy(logit_scale.float().clamp(max=math.log(100)).exp() * obj @ phrases.t(), target)


# -----------------------------------------------------------------------------
# held-out evaluation


def image_tokens(visual, x):
    """Images (B, 3, S, S) -> every output token (B, n+1, D), as the pair encoder's."""
    return visual.ln_post(visual.transformer(visual.stem(x))) @ visual.proj


def encode_images(model, images, cache, size, ctx, batch=256):
    """Images -> their CLIP features (N, D) normalized, the patch token under each object (N_objects, D) and the
    objects' attributes {attr: [N_objects]}."""
    grid = size // model.visual.conv1.kernel_size[0]
    clip_feats, feats, attrs = [], [], {a: [] for a in synth.ATTRS}
    for i in range(0, len(images), batch):
        chunk = images[i:i + batch]
        with torch.no_grad(), ctx.amp:
            x = clip_load.normalize(cache.batch([p for p, _ in chunk]).to(ctx.device))
            tok = image_tokens(model.visual, x).float().cpu()
        clip_feats.append(F.normalize(tok[:, 0], dim=-1))
        for b, (_, objs) in enumerate(chunk):
            for o, (u, v) in objs:
                feats.append(tok[b, cell(u, v, grid)])
                for a in synth.ATTRS:
                    attrs[a].append(o[a])
    return torch.cat(clip_feats), torch.stack(feats), attrs


@torch.no_grad()
def evaluate(model, held_out, probe_train, cache, args, ctx, negatives=8):
    """Held-out figures: image -> description R@1 among its hard negatives, image <-> text R@1 among all held-out
    descriptions, and a linear probe of each attribute (trained on training images' objects)."""
    model.eval()
    rng = random.Random(12345)  # the same texts at every evaluation
    img, xte, yte = encode_images(model, held_out, cache, args.image_size, ctx)
    own, negs = [], []
    for _, objs in held_out:
        objs = [o for o, _ in objs]
        seed = rng.randrange(2 ** 31)
        own.append(synth.description(objs, seed))
        negs += [synth.description(synth.hard_negative(rng, objs), seed) for _ in range(negatives)]

    def encode(texts):  # -> (N, D), normalized, 512 at a time
        ids = [clip_load.tokenize(texts[i:i + 512], args.context_length, True) for i in range(0, len(texts), 512)]
        with ctx.amp:
            return torch.cat([F.normalize(model.encode_text(t.to(ctx.device)).float(), dim=-1).cpu() for t in ids])
    own_t, neg_t = encode(own), encode(negs)
    N = len(img)
    pos = (img * own_t).sum(-1)  # (N,)
    neg = torch.einsum("nd,nkd->nk", img, neg_t.view(N, negatives, -1))
    sim = img @ own_t.t()
    out = {"hard-negative R@1": 100 * (pos > neg.max(1).values).float().mean().item(),
           "image->text R@1": 100 * (sim.argmax(1) == torch.arange(N)).float().mean().item(),
           "text->image R@1": 100 * (sim.argmax(0) == torch.arange(N)).float().mean().item()}
    _, xtr, ytr = encode_images(model, probe_train, cache, args.image_size, ctx)
    for a in synth.ATTRS:
        out[f"probe {a}"] = synth.linear_probe(xtr, ytr[a], xte, yte[a])
        out[f"chance {a}"] = 100 * max(yte[a].count(v) for v in set(yte[a])) / len(yte[a])
    return out


def fmt(m):
    probes = " ".join(f"{a[:3]} {m[f'probe {a}']:.0f}" for a in synth.ATTRS)
    return (f"hard-neg R@1 {m['hard-negative R@1']:.1f} | img->txt R@1 {m['image->text R@1']:.1f} txt->img "
            f"{m['text->image R@1']:.1f} | probe % {probes}")


# -----------------------------------------------------------------------------
# the run: AdamW, warmup then cosine (CLIP's own pretraining, not CLIP4IDC's)


def warmup_cosine(optimizer, total_steps, warmup_frac=0.1):
    """Linear warmup over `warmup_frac` of the steps, then a cosine to 0."""
    warmup = max(1, int(warmup_frac * total_steps))

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def mimetic_init_(visual, a1=0.7, b1=0.7, a2=0.4, b2=0.4):
    """Mimetic initialization of the image tower's attention (Trockman and Kolter 2023), in place: per head
    W_q^T W_k ~ a1 Z + b1 I (a token attends to tokens like itself), W_o W_v = a2 Z' - b2 I, Z, Z' ~ N(0, 1/width)."""
    for block in visual.transformer.resblocks:
        attn, W = block.attn, block.attn.in_proj_weight  # W's rows: W_q, W_k, W_v
        C = W.shape[1]
        hs, eye = C // attn.heads, torch.eye(C)
        with torch.no_grad():
            for h in range(attn.heads):
                Z = torch.randn(C, C) / C ** 0.5
                U, S, Vh = torch.linalg.svd(a1 * Z + b1 * eye)
                root = S[:hs].sqrt()
                W[h * hs:(h + 1) * hs] = (U[:, :hs] * root).T  # q = W_q x, k = W_k x: q.k = x^T U S V^T x
                W[C + h * hs:C + (h + 1) * hs] = (Vh[:hs].T * root).T
            Z = torch.randn(C, C) / C ** 0.5
            U, S, Vh = torch.linalg.svd(a2 * Z - b2 * eye)
            W[2 * C:] = S.sqrt()[:, None] * Vh
            attn.out_proj.weight.copy_(U * S.sqrt())
            attn.in_proj_bias.zero_()
            attn.out_proj.bias.zero_()


def export(args):
    """--out's weights as the shipped file holds them: fp16 tensors, OpenAI's keys, no pair parameters."""
    ckpt = torch.load(args.out, map_location="cpu", weights_only=False)
    meta = {k: ckpt[k] for k in ("args", "history") if k in ckpt}
    meta["activation"] = ckpt["config"].get("activation", "quick_gelu")
    model = {k: v.half() for k, v in ckpt["model"].items() if not k.startswith(PAIR_KEYS)}
    save_atomic({"model": model, "pretrain": meta}, args.export)
    size = os.path.getsize(args.export) / 2 ** 20
    print(f"{args.out} -> {args.export} ({size:.1f} MiB, fp16), SHA256 {clip_load.sha256(args.export)}")


def main(argv=None):
    args = get_args(argv)
    if args.export:
        return export(args)
    ctx = setup(args.seed, args.device, args.amp)
    if args.eval_only:
        model = clip_load.load_clip(args.ckpt or args.out, ctx.device)
    root = synth.resolve_set(args.root, args.scenes, args.render_seed, workers=args.workers)
    log(f"== pretrain.py: a small CLIP pretrained on single synthetic scenes, on {where(ctx)} ==")
    log("   " + args.line())
    train = scene_images(root, "train", args.workers)
    held_out = (scene_images(root, "val", args.workers) + scene_images(root, "test", args.workers))[:args.eval_images]
    probe_train = train[:2 * args.eval_images]
    clevr = clevr_images(args.clevr_root) if args.eval_only and args.clevr_root else []
    items = [data.Item(str(i), p, p, ["-"]) for i, (p, _) in enumerate(train + held_out + clevr)]
    cache = data.open_image_cache(items, args.image_size, True)
    log(f"   {root}: {len(train)} training images, {len(held_out)} held out (other scenes)")

    if args.eval_only:
        path = args.ckpt or args.out
        for name, images in (("held out", held_out), (f"CLEVR's renders in {args.clevr_root}", clevr)):
            if images:
                m = evaluate(model, images, probe_train, cache, args, ctx)
                chance = " ".join(f"{a[:3]} {m[f'chance {a}']:.0f}" for a in synth.ATTRS)
                log(f"{path} on {name} ({len(images)} images): {fmt(m)} | chance: hard-neg R@1 "
                    f"{100 / 9:.1f}, probe % {chance}")
        return m

    # a CLIP from nothing, as adapt.py's scratch preset builds one
    model = CLIP(CLIPConfig(args.embed_dim, args.image_size, args.vision_layers, args.vision_width, args.patch_size,
                            args.context_length, transformer_width=args.text_width,
                            transformer_layers=args.text_layers, transformer_heads=heads_for(args.text_width),
                            n_inter=args.vision_layers // 3))
    if args.mimetic_init:
        mimetic_init_(model.visual)
    model = model.to(ctx.device)
    # one rate; the pair parameters frozen (single images never use them; the shipped file, as OpenAI's, has none)
    rule = lambda name: None if name.startswith(PAIR_KEYS) else args.lr
    freeze(model.named_parameters(), rule)
    groups = param_groups(model.named_parameters(), rule, args.weight_decay)
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.98), eps=1e-6, fused=ctx.device.type == "cuda")
    total = max(1, args.samples // args.batch_size)
    scheduler = warmup_cosine(optimizer, total, args.warmup)
    ds = Descriptions(train, cache, args.negatives, args.context_length, args.patch_size, args.seed,
                      objects=bool(args.object_loss))
    n_params = sum(p.numel() for g in groups for p in g["params"])
    log(f"   model: {n_params / 1e6:.2f}M parameters trained (vision {args.vision_layers}x{args.vision_width}, "
        f"text {args.text_layers}x{args.text_width}); {total} steps of {args.batch_size} images, each with "
        f"{args.negatives} hard negative(s): {total * args.batch_size / len(train):.1f} epochs")

    run = resume_run(load_resume(args.out), model, optimizer, scheduler, args) if args.resume else new_run()

    def step(batch):  # forward, loss, backward, clip, optimizer step, schedule
        optimizer.zero_grad(set_to_none=True)
        images = clip_load.normalize(batch["images"].to(ctx.device))
        ids = clip_load.trim(batch["ids"]).to(ctx.device)  # up to the longest text's end token
        with ctx.amp:
            tokens = image_tokens(model.visual, images) if args.object_loss else None  # token 0: encode_image's
            img = model.encode_image(images) if tokens is None else tokens[:, 0]
            loss = adapt.contrastive_loss(img, model.encode_text(ids), model.logit_scale)
            if args.object_loss:
                objects, phrases = batch["objects"].to(ctx.device), clip_load.trim(batch["phrases"]).to(ctx.device)
                loss = loss + args.object_loss * object_loss(tokens[objects[:, 0], objects[:, 1]],
                                                             model.encode_text(phrases), objects[:, 2],
                                                             model.logit_scale)
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], args.grad_clip)
        optimizer.step()
        scheduler.step()
        return loss.detach()

    # rounds of --eval-every steps, each evaluated on the held-out scenes and saved
    rounds, t_start = math.ceil(total / args.eval_every), time.time()
    while run["step"] < total:
        r = run["step"] // args.eval_every
        stop = min(total, (r + 1) * args.eval_every)
        model.train()
        loss = train_epoch(ctx, Steps(ds, args.batch_size, args.seed, run["step"], stop), step, optimizer, run,
                           Progress(r, rounds, total, args.log_every, unit="images"))
        m = evaluate(model, held_out, probe_train, cache, args, ctx)
        end_epoch(run, loss, {"step": run["step"], "samples": run["step"] * args.batch_size, **m}, 0.0)
        log(f"step {run['step']}/{total} ({run['step'] * args.batch_size:,} images, "
            f"{fmt_time(time.time() - t_start)}) | loss {loss:.4f} | held-out {fmt(m)}")
        save_atomic({"model": model.state_dict(), "config": asdict(model.cfg), "args": vars(args),
                     "history": run["history"]}, args.out)
        save_state(args.out, model, optimizer, scheduler, run, args)
        if args.time_limit is not None and time.time() - t_start > 60 * args.time_limit and run["step"] < total:
            log(f"--time-limit {args.time_limit:g} min reached at step {run['step']}/{total}: the state is in "
                f"{last_path(args.out)}; continue with --resume")
            return run["history"]
    log(f"done: {run['step'] * args.batch_size:,} images in {fmt_time(time.time() - t_start)} "
        f"({where(ctx, speed=True)}): held-out {fmt(run['history'][-1])} -> {args.out}")
    return run["history"]


if __name__ == "__main__":
    main()
