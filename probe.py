"""What a pair encoder knows about the change, on a synthetic set: diagnoses of the pair encoder, no stage uses them.

    python probe.py linear --ckpt adapted.pt      # linear probes on the frozen encoder's output tokens
    python probe.py supervised --epochs 8         # a bound: the small encoder trained on the answers themselves
    python probe.py supervised --fusion early     # reference: both images stacked as 6 channels (not CLIP4IDC)
    python probe.py supervised --clip mini-synth  # the pretrained small CLIP whole, adapt.py's policy
    python probe.py supervised --clip mini-synth --align-bias 8   # ... with attention that lines up the images
    python probe.py aligned --clip mini-synth     # frozen per-image tokens + a position-aligned comparator
    python probe.py attention --clip mini-synth   # where the pair encoder's patch tokens look
    python probe.py sees --data-root data/clevr_pretrain   # what the shipped mini CLIP reads, its world and CLEVR's

The renderer records every scene (synth.read_scenes), so each change pair has five answers: the change type and
the changed object's colour, shape, material and size (the object as the reference captions name it: the added
one for "add", else the one before the change). A caption can only name the right object if the encoder's tokens
hold these. `linear` fits one linear classifier per answer on the frozen tokens of the training change pairs and
scores it on the test change pairs. `supervised` asks how much of it the small encoder can learn at all in a
CPU budget: the same from-scratch model as adapt.py's scratch preset, its pair vector v (eq. 5) fed to five linear
heads, trained on the answers directly (cross-entropy, the CLIP4IDC losses replaced by the labels they stand for).
`--fusion early` is the reference of what the data allows: the same ViT with both images stacked as 6 input
channels before the patch embedding, so every patch sees before and after at once (not CLIP4IDC, which encodes
each image alone first). `--clip` starts from a pretrained CLIP instead (the shipped mini-synth, or a file) and
trains it as adapt.py does: input embeddings frozen, CLIP's weights at --lr-clip, the pair parameters and heads at
--lr. Both print test accuracy next to the most frequent class's; `supervised` also reads its last answers as the
quickstart's captions are read (synth.resolve, what synth.judge applies): the right type and the right object.

Two more locate what is missing. `aligned` keeps a CLIP frozen and gives it the comparator CLIP4IDC does not
have: each image's patch tokens after --block blocks, before and after minus before at the same position, a small
MLP shared by all positions, the maximum over positions, five heads. If it reads the change, the per-image tokens
hold it and what the pair encoder lacks is the comparison (`--random`: the same architecture, random weights);
its answers are also read as captions are.
`attention` runs the pair encoder (eq. 2-5, fresh pair parameters) and reports, per inter block, how much
weight a patch gives the patch at its own position in the other image and itself, relative to uniform attention:
CLIP4IDC's inter blocks compare the two images only if such weights stand out. `supervised --align-bias B`
supplies such attention by hand (not CLIP4IDC): in the joint sequence each patch's logits toward itself and toward
the patch at its own position in the other image get +B, [CLS] rows are left alone; what pretrained attention
would have to provide. `sees` asks what a CLIP reads of single images, in its own world and on CLEVR's own
renders: pretrain.py's held-out figures (attribute probes of the patch token under each object, trained on
--data-root's objects; description retrieval) on --data-root's test images and on every image of --clevr-root, a
set with CLEVR's own scene records (each object at its pixel_coords). Diagnoses only: no stage uses them.
"""
import argparse
import json
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

import adapt
import clip_load
import data
import model as M
import pretrain
import synth
from train_utils import at_least, make_optimizer, param_groups, setup, warmup_cosine

ANSWERS = {"type": synth.CHANGES, "color": tuple(synth.COLORS), "shape": synth.SHAPES,
           "material": synth.MATERIALS, "size": tuple(synth.SIZES)}


def changed(scene):
    """The scene the references describe (after for "add", else before) and the changed object's index in it."""
    return scene["after"] if scene["type"] == "add" else scene["before"], scene["changed"]


def answers(items, scenes):
    """(N, 5) class indices, in ANSWERS' order, for change pairs."""
    rows = []
    for it in items:
        s = scenes[it.id]
        objects, i = changed(s)
        rows.append([ANSWERS["type"].index(s["type"])] + [ANSWERS[k].index(objects[i][k]) for k in list(ANSWERS)[1:]])
    return torch.tensor(rows)


def split(root, name, size):
    """One split's change pairs -> normalized before and after images (N, 3, S, S) and their answers."""
    scenes = synth.read_scenes(root)
    if scenes is None:
        raise SystemExit(f"{root} has no scenes.json (--data-root): probes need a set made by synth.py (python "
                         f"synth.py make, or adapt.py on the synthetic set)")
    items = data.load_items("clevr", root, name, "semantic")
    before, after = [], []
    for b, a, _ in data.make_loader(data.ImageDataset(items, size), 256):
        before.append(clip_load.normalize(b))
        after.append(clip_load.normalize(a))
    return torch.cat(before), torch.cat(after), answers(items, scenes)


def named_right(pred, where):
    """Per pair: do the predicted answers name the changed object as a caption would ("size colour material shape",
    read by synth.resolve, the reader synth.judge applies to captions: it must mean that object and no other)?
    `where` holds each test pair's (objects of the scene the references describe, index of the changed one)."""
    keys = list(ANSWERS)[1:]
    right = []
    for p, (objects, i) in zip(pred.tolist(), where):
        words = {k: ANSWERS[k][p[1 + j]] for j, k in enumerate(keys)}
        found = synth.resolve(" ".join(words[k] for k in ("size", "color", "material", "shape")), objects)
        right.append(len(found) == 1 and found[0] is objects[i])
    return torch.tensor(right, dtype=torch.float)


def read_as_captions(pred, y, where):
    """Print the right type and the right object (named_right) of the (N, 5) answers, as synth.judge reads the
    quickstart's captions, overall and per change type."""
    obj, typ = named_right(pred, where), (pred[:, 0] == y[:, 0]).float()
    print(f"read as captions (synth.resolve): right type {typ.mean():.0%}, right object {obj.mean():.0%}; by type "
          + ", ".join(f"{t} {typ[y[:, 0] == i].mean():.0%} / {obj[y[:, 0] == i].mean():.0%}"
                      for i, t in enumerate(ANSWERS["type"]) if (y[:, 0] == i).any()))


def changed_objects(root, name):
    """Each change pair of a split: `changed` of its scene, as synth.judge reads it."""
    scenes = synth.read_scenes(root)
    return [changed(scenes[it.id]) for it in data.load_items("clevr", root, name, "semantic")]


def majority(y):
    return torch.bincount(y).max().item() / len(y)


def report(title, acc, y):
    print(title + "  ".join(f"{k} {a:.0%} (chance {majority(y[:, j]):.0%})"
                            for j, (k, a) in enumerate(zip(ANSWERS, acc))))


@torch.no_grad()
def encode(clip, before, after, batch=128):
    """encode_pair over all pairs in batches -> tokens (N, 2(n+1), D) and pair vectors v (N, D)."""
    parts = [clip.encode_pair(before[i:i + batch], after[i:i + batch]) for i in range(0, len(before), batch)]
    return torch.cat([t for t, _ in parts]), torch.cat([v for _, v in parts])


def linear_probe(x, y, x_test, y_test, steps=300, lr=1e-3, weight_decay=1e-3):
    """Standardized features, one full-batch Adam-trained linear classifier per answer -> (train acc, test acc)."""
    mu, sd = x.mean(0), x.std(0) + 1e-6
    x, x_test = (x - mu) / sd, (x_test - mu) / sd
    train, test = [], []
    for j, classes in enumerate(ANSWERS.values()):
        head = torch.nn.Linear(x.shape[1], len(classes))
        opt = torch.optim.Adam(head.parameters(), lr=lr, weight_decay=weight_decay)
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(head(x), y[:, j]).backward()
            opt.step()
        with torch.no_grad():
            train.append((head(x).argmax(1) == y[:, j]).float().mean().item())
            test.append((head(x_test).argmax(1) == y_test[:, j]).float().mean().item())
    return train, test


def rate(name, args):
    """From scratch everything trains at --lr; a pretrained CLIP as adapt.py trains it (lr_rule): its input
    embeddings frozen, its other weights at --lr-clip, the pair parameters (and the heads) at --lr."""
    if not args.clip or not name.startswith("visual.") or (args.fusion == "early" and "conv1" in name):
        return args.lr  # from scratch, a head, or early fusion's new 6-channel patch embedding
    n_inter = 0 if args.fusion == "early" else args.n_inter
    rule = adapt.lr_rule(argparse.Namespace(clip=args.clip, n_inter=n_inter, lr_new=args.lr, lr_clip=args.lr_clip))
    return rule(name)


def pair_vector(clip, before, after, early):
    """CLIP4IDC's pair vector v (eq. 5), or with early fusion the [CLS] feature of the 6-channel stack."""
    return clip.visual(torch.cat([before, after], dim=1)) if early else clip.encode_pair(before, after).vector


@contextmanager
def aligned_attention(beta, n1):
    """While active, every non-causal attention over 2 * n1 keys (a joint pair sequence of two n1-token images)
    adds beta to each patch's logits toward itself and toward the patch at its own position in the other image;
    the [CLS] rows (0 and n1) keep their own attention, so that they can still pool the patches."""
    real = M.attention

    def biased(q, k, v, causal=False):
        T = k.shape[2]
        if causal or T != 2 * n1 or q.shape[2] != T:
            return real(q, k, v, causal)
        rows = torch.tensor([t for t in range(T) if t % n1], device=q.device)
        bias = torch.zeros(T, T, dtype=q.dtype, device=q.device)
        bias[rows, rows] = beta
        bias[rows, (rows + n1) % T] = beta
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    M.attention = biased
    try:
        yield
    finally:
        M.attention = real


def supervised(train, test, args, where=None):
    """Train adapt.py's small encoder from scratch (or --clip's, pretrained) on the answers -> per epoch (mean
    train loss, test accuracies); with `where` (changed_objects of the test split), the last epoch's answers are
    also read as captions are: the right type, and the right object named."""
    early = args.fusion == "early"
    small = argparse.Namespace(**{**adapt.PRESETS["scratch"], "clip": args.clip, "shared_p": args.shared_p,
                                  "n_inter": 0 if early else args.n_inter})
    clip = adapt.new_model(small)
    if early:  # the patch embedding takes both images' channels
        clip.visual.conv1 = torch.nn.Conv2d(6, clip.cfg.vision_width, clip.cfg.vision_patch_size,
                                            clip.cfg.vision_patch_size, bias=False)
    heads = torch.nn.ModuleList(torch.nn.Linear(clip.cfg.embed_dim, len(c)) for c in ANSWERS.values())
    named = [(f"visual.{n}", p) for n, p in clip.visual.named_parameters()] + list(heads.named_parameters())
    params = [p for n, p in named if rate(n, args) is not None]
    opt = make_optimizer(param_groups(named, lambda n: rate(n, args), small.weight_decay), "cpu")  # adapt.py's
    (b, a, y), (bt, at, yt) = train, test
    per_epoch = len(y) // args.batch_size
    sched = warmup_cosine(opt, args.epochs * per_epoch, small.warmup)
    history, t0 = [], time.time()
    for epoch in range(args.epochs):
        clip.train()
        order, total = torch.randperm(len(y)), 0.0
        for s in range(per_epoch):
            i = order[s * args.batch_size:(s + 1) * args.batch_size]
            v = pair_vector(clip, b[i], a[i], early)
            loss = sum(F.cross_entropy(h(v), y[i, j]) for j, h in enumerate(heads))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, small.grad_clip)
            opt.step()
            sched.step()
            total += loss.item()
        clip.eval()
        with torch.no_grad():
            v = torch.cat([pair_vector(clip, bt[i:i + 128], at[i:i + 128], early) for i in range(0, len(bt), 128)])
            pred = torch.stack([h(v).argmax(1) for h in heads], dim=1)  # (N, 5) answers
            acc = (pred == yt).float().mean(0).tolist()
        history.append((total / per_epoch, acc))
        report(f"epoch {epoch + 1}/{args.epochs} | train loss {total / per_epoch:.3f} | {time.time() - t0:.0f}s"
               " | test: ", acc, yt)
    if where is not None:  # the last epoch's answers read as the quickstart's captions are (synth.judge)
        read_as_captions(pred, yt, where)
    return history


@torch.no_grad()
def image_tokens(visual, x, blocks, batch=256):
    """Each image alone through the stem and the first `blocks` blocks -> its patch tokens (N, n, width)."""
    out = []
    for i in range(0, len(x), batch):
        h = visual.stem(x[i:i + batch])
        for block in visual.transformer.resblocks[:blocks]:
            h = block(h)
        out.append(h[:, 1:])
    return torch.cat(out)


def aligned(clip, train, test, args, where=None):
    """Frozen per-image tokens, compared position by position by a small trained MLP -> (mean train loss per
    epoch, test accuracies); with `where`, its answers are also read as captions are (read_as_captions)."""
    feats = []
    for b, a, _ in (train, test):
        tb, ta = image_tokens(clip.visual, b, args.block), image_tokens(clip.visual, a, args.block)
        feats.append(torch.cat([tb, ta - tb], dim=-1))  # (N, n, 2 width): what is there, what changed there
    (x, xt), y, yt = feats, train[2], test[2]
    mu, sd = x.mean((0, 1)), x.std((0, 1)) + 1e-6
    x, xt = (x - mu) / sd, (xt - mu) / sd
    net = nn.Sequential(nn.Linear(x.shape[-1], 256), nn.GELU(), nn.Linear(256, 256))
    heads = nn.ModuleList(nn.Linear(256, len(c)) for c in ANSWERS.values())
    opt = torch.optim.AdamW([*net.parameters(), *heads.parameters()], lr=args.lr, weight_decay=0.05)
    B, losses = args.batch_size, []
    for epoch in range(args.epochs):
        order, total = torch.randperm(len(y)), 0.0
        for s in range(len(y) // B):
            i = order[s * B:(s + 1) * B]
            h = net(x[i]).amax(dim=1)  # the strongest evidence over positions
            loss = sum(F.cross_entropy(head(h), y[i, j]) for j, head in enumerate(heads))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        losses.append(total / (len(y) // B))
    with torch.no_grad():
        h = net(xt).amax(dim=1)
        pred = torch.stack([head(h).argmax(1) for head in heads], dim=1)
        acc = (pred == yt).float().mean(0).tolist()
    report(f"block {args.block}, {args.epochs} epochs, train loss {losses[0]:.3f} -> {losses[-1]:.3f} | test: ", acc,
           yt)
    if where is not None:
        read_as_captions(pred, yt, where)
    return losses, acc


@torch.no_grad()
def attention(clip, before, after):
    """Per inter block, per head: the mean weight a patch gives the patch at its own position in the other image,
    and itself, times the number of tokens (1: no preference; VisionTransformer.inter_attention)."""
    weights = clip.visual.inter_attention(before, after)
    rows = []
    for w in weights:  # (B, heads, T, T), T = 2(n+1)
        T = w.shape[-1]
        n1, i = T // 2, torch.arange(1, T // 2)
        other = torch.cat([w[..., i, i + n1], w[..., i + n1, i]], dim=-1).mean((0, 2)) * T
        own = torch.cat([w[..., i, i], w[..., i + n1, i + n1]], dim=-1).mean((0, 2)) * T
        rows.append((other.tolist(), own.tolist()))
    for k, (other, own) in enumerate(rows):
        print(f"inter block {k + 1}/{len(rows)} | per head, x uniform: same position in the other image "
              + " ".join(f"{a:.2f}" for a in other) + " | itself " + " ".join(f"{a:.2f}" for a in own))
    return rows


def clevr_images(root):
    """Every image of a set with CLEVR's own scene records (scenes.json of CLEVR-Change's generator, as the
    development set's), as pretrain.scene_images gives a synthetic set's: [(path, [(object, (u, v))])], each object
    at CLEVR's pixel_coords as fractions of the image's width and height."""
    out = []
    for s in json.loads((Path(root) / "scenes.json").read_text())["scenes"]:
        for kind in ("default", "semantic", "nonsemantic"):
            if f"{kind}_scene" in s:
                path = Path(root) / s[f"{kind}_image"]
                w, h = Image.open(path).size
                out.append((str(path), [({a: o[a] for a in synth.ATTRS}, (o["pixel_coords"][0] / w,
                                                                          o["pixel_coords"][1] / h))
                                        for o in s[f"{kind}_scene"]["objects"]]))
    return out


def sees(clip, root, clevr_root, args):
    """pretrain.evaluate on a synthetic set's test images and on CLEVR's renders, probes trained on the set's."""
    size = clip.cfg.image_resolution
    train, own = pretrain.scene_images(Path(root), "train")[:1500], pretrain.scene_images(Path(root), "test")[:400]
    clevr = clevr_images(clevr_root)
    items = [data.Item(str(i), p, p, ["-"]) for i, (p, _) in enumerate(train + own + clevr)]
    cache = data.ImageCache(items, size, workers=2)
    ctx, out = setup(args.seed, "cpu", "off"), {}
    for name, images in (("its own world", own), ("CLEVR's renders", clevr)):
        m = out[name] = pretrain.evaluate(clip, images, train, cache, SimpleNamespace(
            image_size=size, context_length=clip.cfg.context_length), ctx)
        chance = " ".join(f"{a[:3]} {m[f'chance {a}']:.0f}" for a in synth.ATTRS)
        print(f"{name} ({len(images)} images): {pretrain.fmt(m)} | chance: probe % {chance}, retrieval "
              f"{100 / len(images):.1f}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd = p.add_subparsers(dest="cmd", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    lin = cmd.add_parser("linear", formatter_class=fmt, help="linear probes on a trained encoder's tokens")
    lin.add_argument("--ckpt", type=clip_load.weights_arg, default="adapted.pt",
                     help="an adapted.pt (or any pair-encoder checkpoint)")
    sup = cmd.add_parser("supervised", formatter_class=fmt, help="train the small encoder on the answers")
    sup.add_argument("--epochs", type=at_least(1), default=8, help="passes over the training change pairs")
    sup.add_argument("--batch-size", type=at_least(1), default=32, help="pairs per step")
    sup.add_argument("--lr", type=at_least(0.0, float), default=3e-4, help="peak lr (warmup, then cosine, as adapt.py)")
    sup.add_argument("--clip", type=clip_load.weights_arg, default=None,
                     help="start from this pretrained CLIP (mini-synth or a path) instead of from scratch")
    sup.add_argument("--lr-clip", type=at_least(0.0, float), default=1e-4,
                     help="with --clip: the lr of CLIP's own weights")
    sup.add_argument("--n-inter", type=at_least(0), default=None,
                     help="inter blocks (default: 3 of the scratch preset's 12, 2 of mini-synth's 6)")
    sup.add_argument("--shared-p", type=at_least(0.0, float), default=None, help="p shared by both images, of "
                     "this norm, as adapt.py --shared-p (default: the preset's, 0: the authors' random p)")
    sup.add_argument("--align-bias", type=float, default=0.0, help="late fusion: add this to each patch's "
                     "attention logits toward itself and its own position in the other image (0: off)")
    sup.add_argument("--fusion", default="late", choices=["late", "early"],
                     help="late: CLIP4IDC's pair encoder; early: both images stacked as 6 channels (a reference)")
    ali = cmd.add_parser("aligned", formatter_class=fmt, help="frozen per-image tokens, a position-aligned "
                                                              "comparator trained on the answers")
    ali.add_argument("--block", type=at_least(0), default=None, help="tokens after this many blocks (default: the "
                                                                    "intra blocks, all but the preset's inter blocks)")
    ali.add_argument("--random", action="store_true", help="--clip's architecture with random weights")
    ali.add_argument("--epochs", type=at_least(1), default=30, help="passes over the training change pairs")
    ali.add_argument("--batch-size", type=at_least(1), default=32, help="pairs per step")
    ali.add_argument("--lr", type=at_least(0.0, float), default=1e-3, help="AdamW lr of the comparator")
    att = cmd.add_parser("attention", formatter_class=fmt, help="where the pair encoder's patch tokens look")
    att.add_argument("--pairs", type=at_least(1), default=64, help="test change pairs averaged over")
    att.add_argument("--shared-p", type=at_least(0.0, float), default=0.0,
                     help="first set p shared by both images, of this norm, as adapt.py --shared-p (0: p as "
                          "loaded)")
    see = cmd.add_parser("sees", formatter_class=fmt, help="what a CLIP reads of single images: its world, CLEVR's")
    see.add_argument("--clevr-root", default="../shared/data/real_clevr_change_dev",
                     help="a CLEVR-Change-layout set with CLEVR's own scene records (scenes.json)")
    see.add_argument("--clip", type=clip_load.weights_arg, default="mini12-synth",
                     help="a CLIP (mini12-synth, a path); run on the CPU")
    for c in (ali, att):
        c.add_argument("--clip", type=clip_load.weights_arg, default="mini-synth",
                       help="a CLIP (mini-synth, a path) or an adapted.pt")
        c.add_argument("--n-inter", type=at_least(0), default=None, help="inter blocks (default: the file's own; the "
                                                                 "mini preset's 2 for mini-synth)")
    for c in (lin, sup, ali, att, see):
        c.add_argument("--seed", type=int, default=0, help="random seed")
        c.add_argument("--data-root", default=synth.SYNTH_ROOT, help="a set made by synth.py")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.cmd == "sees":
        if not synth.is_synthetic(args.data_root):
            p.error(f"argument --data-root: no set made by synth.py in {args.data_root}: give one (the CLIP's "
                    f"pretraining scenes, e.g. data/clevr_pretrain), or make one: python synth.py make --out DIR")
        if not (Path(args.clevr_root) / "scenes.json").is_file():
            p.error(f"argument --clevr-root: no scenes.json in {args.clevr_root}: give a set with CLEVR's own scene "
                    f"records (../shared/data/real_clevr_change_dev has them)")
        return sees(clip_load.load_clip(args.clip), args.data_root, args.clevr_root, args)
    if args.cmd in ("aligned", "attention"):
        if args.n_inter is None and args.clip in clip_load.SHIPPED:
            args.n_inter = adapt.PRESETS["mini"]["n_inter"]
        clip = clip_load.load_clip(args.clip, n_inter=args.n_inter)
        size = clip.cfg.image_resolution
        if args.cmd == "attention":
            if args.shared_p:
                M.share_joint_positions_(clip.visual, args.shared_p)
            b, a, _ = split(args.data_root, "test", size)
            return attention(clip, b[:args.pairs], a[:args.pairs])
        if args.random:
            clip = M.CLIP(clip.cfg)
        layers = len(clip.visual.transformer.resblocks)
        if args.block is None:
            args.block = layers - clip.visual.n_inter
        if args.block > layers:
            p.error(f"argument --block: {args.clip} has {layers} vision blocks: give 0 to {layers}, got {args.block}")
        return aligned(clip, split(args.data_root, "train", size), split(args.data_root, "test", size), args,
                       changed_objects(args.data_root, "test"))
    if args.cmd == "linear":
        clip = clip_load.load_clip(args.ckpt)
        size = clip.cfg.image_resolution
        (b, a, y), (bt, at, yt) = split(args.data_root, "train", size), split(args.data_root, "test", size)
        train, test = linear_probe(encode(clip, b, a)[0].flatten(1), y, encode(clip, bt, at)[0].flatten(1), yt)
        report("train: ", train, y)
        report("test:  ", test, yt)
        return test
    preset = adapt.PRESETS["mini" if args.clip else "scratch"]
    if args.n_inter is None:
        args.n_inter = preset["n_inter"]
    if not args.clip and args.n_inter > preset["vision_layers"]:
        p.error(f"argument --n-inter: the scratch preset's encoder has {preset['vision_layers']} blocks: give 0 to "
                f"{preset['vision_layers']}, got {args.n_inter}")
    if args.shared_p is None:
        args.shared_p = preset["shared_p"]
    cfg = clip_load.load_clip(args.clip, n_inter=args.n_inter).cfg if args.clip else None  # --n-inter checked
    size, patch = (cfg.image_resolution, cfg.vision_patch_size) if cfg else (preset["image_size"], preset["patch_size"])
    train, test = split(args.data_root, "train", size), split(args.data_root, "test", size)
    with aligned_attention(args.align_bias, (size // patch) ** 2 + 1) if args.align_bias else nullcontext():
        return supervised(train, test, args, changed_objects(args.data_root, "test"))


if __name__ == "__main__":
    main()
