"""What a pair encoder knows about the change, on a synthetic set (RESULTS.md "What holds the small model back").

    python probe.py linear --ckpt adapted.pt      # linear probes on the frozen encoder's output tokens
    python probe.py supervised --epochs 8         # a bound: the small encoder trained on the answers themselves
    python probe.py supervised --fusion early     # reference: both images stacked as 6 channels (not CLIP4IDC)

The renderer records every scene (synth.read_scenes), so each change pair has five answers: the change type and
the changed object's colour, shape, material and size (the object as the reference captions name it: the added
one for "add", else the one before the change). A caption can only name the right object if the encoder's tokens
hold these. `linear` fits one linear classifier per answer on the frozen tokens of the training change pairs and
scores it on the test change pairs. `supervised` asks how much of it the small encoder can learn at all in a
CPU budget: the same from-scratch model as adapt.py's scratch preset, its pair vector v (eq. 5) fed to five linear
heads, trained on the answers directly (cross-entropy, the CLIP4IDC losses replaced by the labels they stand for).
`--fusion early` is the reference of what the data allows: the same ViT with both images stacked as 6 input
channels before the patch embedding, so every patch sees before and after at once (not CLIP4IDC, which encodes
each image alone first). Both print test accuracy next to the most frequent class's. Diagnoses only: no stage
uses them.
"""
import argparse
import time

import torch
import torch.nn.functional as F

import adapt
import clip_load
import data
import synth
from train_utils import make_optimizer, param_groups, warmup_cosine

ANSWERS = {"type": synth.CHANGES, "color": tuple(synth.COLORS), "shape": synth.SHAPES,
           "material": synth.MATERIALS, "size": tuple(synth.SIZES)}


def answers(items, scenes):
    """(N, 5) class indices, in ANSWERS' order, for change pairs."""
    rows = []
    for it in items:
        s = scenes[it.id]
        o = (s["after"] if s["type"] == "add" else s["before"])[s["changed"]]
        rows.append([ANSWERS["type"].index(s["type"])] + [ANSWERS[k].index(o[k]) for k in list(ANSWERS)[1:]])
    return torch.tensor(rows)


def split(root, name, size):
    """One split's change pairs -> normalized before and after images (N, 3, S, S) and their answers."""
    scenes = synth.read_scenes(root)
    if scenes is None:
        raise SystemExit(f"{root} has no scenes.json: probes need a set made by synth.py (python synth.py make)")
    items = data.load_items("clevr", root, name, "semantic")
    before, after = [], []
    for b, a, _ in data.make_loader(data.ImageDataset(items, size), 256):
        before.append(clip_load.normalize(b))
        after.append(clip_load.normalize(a))
    return torch.cat(before), torch.cat(after), answers(items, scenes)


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


def pair_vector(clip, before, after, early):
    """CLIP4IDC's pair vector v (eq. 5), or with early fusion the [CLS] feature of the 6-channel stack."""
    return clip.visual(torch.cat([before, after], dim=1)) if early else clip.encode_pair(before, after)[1]


def supervised(train, test, args):
    """Train adapt.py's small encoder from scratch on the answers -> per epoch (mean train loss, test accuracies)."""
    early = args.fusion == "early"
    small = argparse.Namespace(**{**adapt.PRESETS["scratch"], "n_inter": 0 if early else args.n_inter})
    clip = adapt.new_model(small)
    if early:  # the patch embedding takes both images' channels
        clip.visual.conv1 = torch.nn.Conv2d(6, small.vision_width, small.patch_size, small.patch_size, bias=False)
    heads = torch.nn.ModuleList(torch.nn.Linear(small.embed_dim, len(c)) for c in ANSWERS.values())
    named = [(f"visual.{n}", p) for n, p in clip.visual.named_parameters()] + list(heads.named_parameters())
    params = [p for _, p in named]
    opt = make_optimizer(param_groups(named, lambda name: args.lr, small.weight_decay), "cpu")  # adapt.py's recipe
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
            acc = [(h(v).argmax(1) == yt[:, j]).float().mean().item() for j, h in enumerate(heads)]
        history.append((total / per_epoch, acc))
        report(f"epoch {epoch + 1}/{args.epochs} | train loss {total / per_epoch:.3f} | {time.time() - t0:.0f}s"
               " | test: ", acc, yt)
    return history


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd = p.add_subparsers(dest="cmd", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    lin = cmd.add_parser("linear", formatter_class=fmt, help="linear probes on a trained encoder's tokens")
    lin.add_argument("--ckpt", default="adapted.pt", help="an adapted.pt (or any pair-encoder checkpoint)")
    sup = cmd.add_parser("supervised", formatter_class=fmt, help="train the small encoder on the answers")
    sup.add_argument("--epochs", type=int, default=8, help="passes over the training change pairs")
    sup.add_argument("--batch-size", type=int, default=32, help="pairs per step")
    sup.add_argument("--lr", type=float, default=3e-4, help="peak lr (warmup, then cosine, as adapt.py)")
    sup.add_argument("--n-inter", type=int, default=3, help="inter blocks of the 12")
    sup.add_argument("--fusion", default="late", choices=["late", "early"],
                     help="late: CLIP4IDC's pair encoder; early: both images stacked as 6 channels (a reference)")
    for c in (lin, sup):
        c.add_argument("--seed", type=int, default=0, help="random seed")
        c.add_argument("--data-root", default=synth.SYNTH_ROOT, help="a set made by synth.py")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.cmd == "linear":
        clip = clip_load.load_clip(args.ckpt)
        size = clip.cfg.image_resolution
        (b, a, y), (bt, at, yt) = split(args.data_root, "train", size), split(args.data_root, "test", size)
        train, test = linear_probe(encode(clip, b, a)[0].flatten(1), y, encode(clip, bt, at)[0].flatten(1), yt)
        report("train: ", train, y)
        report("test:  ", test, yt)
        return test
    size = adapt.PRESETS["scratch"]["image_size"]
    return supervised(split(args.data_root, "train", size), split(args.data_root, "test", size), args)


if __name__ == "__main__":
    main()
