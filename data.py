"""Data for clip4idc: CLEVR-Change, Spot-the-Diff and Image-Editing-Request loaders, and a synthetic CLEVR-Change.

    python data.py make-synth --out data/clevr_synth --pairs 3000   # CLEVR-Change-style renders, CLEVR-Change's layout
    python data.py make-synth --out data/clevr_far --far-change    # harder: changes move the view as far as distractors
    python data.py sheet --root data/clevr_synth --out sheet.png    # contact sheet: before | after | distractor
    python data.py bench --root data/clevr_synth --size 96          # decoded images/s, streaming and cached

One item = (before image, after image, its captions, change type or None, id). The stages choose how to sample:
`CaptionDataset` (one sample per caption: adaptation), `PairDataset` (one per pair, a random caption each time:
captioning), `ImageDataset` (images only: evaluation). Formats: DESIGN.md "Datasets"; where to get the data:
README "Data". With no CLEVR-Change at data/clevr_change, `resolve_root("clevr")` renders a synthetic set once
(PIL + numpy, CLEVR's shapes/colours/materials, captions in CLEVR-Change's style) and uses that.
"""
import argparse
import json
import os
import random
import time
from functools import partial
from multiprocessing import Pool
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from clip_load import load_image, normalize, open_image, resize_uint8, tokenize

ROOTS = {"clevr": "data/clevr_change", "spot": "data/spot_the_diff", "ier": "data/image_editing_request"}
SYNTH_ROOT = "data/clevr_synth"
SEE = "see README 'Data' for where to get it"
CLEVR_FILES = ("images", "sc_images", "nsc_images", "change_captions.json", "no_change_captions.json",
               "splits.json", "type_mapping.json")

# -----------------------------------------------------------------------------
# items: one image pair with its captions


class Item(NamedTuple):
    id: str
    before: str  # path
    after: str  # path
    captions: list
    change_type: str | None = None  # clevr: color/material/move/add/drop/distractor; None for spot/ier
    alt_before: str | None = None  # clevr semantic pairs: the non-semantic image, for the adaptation swap


def resolve_root(name, root=None, synth_pairs=3000, synth_size=(240, 160), seed=0, workers=None):
    """The dataset's directory. For "clevr" with no root given and nothing at data/clevr_change: the synthetic set
    at data/clevr_synth, rendered on first use (23 ms of CPU per triple at 240x160: 3000 take ~35 s on 2 cores)
    and reused while its synth.json matches these arguments."""
    if name not in ROOTS:
        raise SystemExit(f"unknown dataset {name!r}: expected one of {list(ROOTS)}")
    if root is not None or name != "clevr" or Path(ROOTS[name]).exists():
        return Path(root or ROOTS[name])
    synth, want = Path(SYNTH_ROOT), {"pairs": synth_pairs, "size": list(synth_size), "seed": seed}
    print(f"*** no CLEVR-Change at {ROOTS[name]}: using the SYNTHETIC CLEVR-Change-style set at {synth} "
          f"({synth_pairs} pairs; numbers are not comparable to the paper). For the real dataset, put it at "
          f"{ROOTS[name]} or pass --data-root: README 'Data'. ***")
    meta = synth / "synth.json"
    if not meta.is_file() or json.loads(meta.read_text()) != want:
        make_synth(synth, synth_pairs, seed, synth_size, workers)
    return synth


def load_items(name, root, split, setting="total", skip_missing=False):
    """Items of one split. clevr setting "semantic": change pairs only (adaptation); "total": change pairs and
    (default, non-semantic) distractor pairs with the no-change captions (captioning, evaluation)."""
    root = Path(root)
    if not root.is_dir():
        raise SystemExit(f"no {name} dataset at {root}: expected its directory there, {SEE}")
    split = {"valid": "val"}.get(split, split)
    if split not in ("train", "val", "test"):
        raise SystemExit(f"unknown split {split!r}: expected train, val or test")
    items = {"clevr": partial(_clevr, setting=setting), "spot": _spot, "ier": _ier}[name](root, split)
    return _check_files(items, name, root, split, skip_missing)


def _read_json(path, what):
    if not path.is_file():
        raise SystemExit(f"missing {path}: expected {what} there, {SEE}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"{path} is not valid JSON ({e}): expected {what}") from None


def _clevr(root, split, setting):
    if setting not in ("semantic", "total"):
        raise SystemExit(f"unknown CLEVR-Change setting {setting!r}: expected 'semantic' or 'total'")
    if missing := [f for f in CLEVR_FILES if not (root / f).exists()]:
        raise SystemExit(f"CLEVR-Change at {root} lacks {', '.join(missing)}: expected {', '.join(CLEVR_FILES)} "
                         f"there, {SEE}")
    splits = _read_json(root / "splits.json", 'split ids {"train": [...], "val": [...], "test": [...]}')
    if split not in splits:
        raise SystemExit(f"{root / 'splits.json'} has no {split!r} list (it has {list(splits)})")
    ids = splits[split]
    change = _read_json(root / "change_captions.json", 'captions {"CLEVR_default_%06d.png": [...]}')
    same = _read_json(root / "no_change_captions.json", 'captions {"CLEVR_default_%06d.png": [...]}')
    types = {int(f[:6]): t for t, files in _read_json(root / "type_mapping.json", "change type -> ids").items()
             for f in files}
    items = []
    for i in ids:
        key = f"CLEVR_default_{i:06d}.png"
        if key not in change or key not in same:
            raise SystemExit(f"{key} (split {split}) has no captions in {root}/(no_)change_captions.json")
        default, sc, nsc = (str(root / d / f"CLEVR_{n}_{i:06d}.png") for d, n in
                            (("images", "default"), ("sc_images", "semantic"), ("nsc_images", "nonsemantic")))
        items.append(Item(f"{i:06d}", default, sc, change[key], types.get(i), nsc))
        if setting == "total":  # the distractor pair: only viewpoint/lighting differ
            items.append(Item(f"{i:06d}_n", default, nsc, same[key], "distractor"))
    return items


def _first_dir(root, names):
    """Published archives unpack in different ways: take the first of these directories that exists."""
    return next((root / n for n in names if (root / n).is_dir()), root)


def _spot(root, split):
    ann = _first_dir(root, ["annotations", "data/annotations"]) / f"{split}.json"
    images = _first_dir(root, ["resized_images", "images", "data/resized_images"])
    merged = {}  # an img_id can repeat: its sentences are merged, in file order
    for d in _read_json(ann, 'Spot-the-Diff annotations [{"img_id", "sentences"}]'):
        merged.setdefault(str(d["img_id"]), []).extend(d["sentences"])
    return [Item(i, str(images / f"{i}.png"), str(images / f"{i}_2.png"), s) for i, s in merged.items()]


def _ier(root, split):
    split = {"val": "valid"}.get(split, split)
    ann = _first_dir(root, ["data"]) / f"{split}.json"
    images = _first_dir(root, ["images"])
    data = _read_json(ann, 'Image-Editing-Request annotations [{"img0", "img1", "sents", "uid"}]')
    return [Item(d["uid"], str(images / d["img0"]), str(images / d["img1"]), d["sents"]) for d in data]


def _readable(path):
    try:
        Image.open(path).close()  # reads the header only
        return True
    except (OSError, ValueError):
        return False


def _check_files(items, name, root, split, skip_missing):
    """Missing images are an error; with --skip-missing those pairs (also unreadable ones) are dropped, counted."""
    paths = lambda it: [p for p in (it.before, it.after, it.alt_before) if p]
    if skip_missing:
        kept = [it for it in items if all(os.path.isfile(p) and _readable(p) for p in paths(it))]
        if len(kept) < len(items):
            print(f"--skip-missing: dropped {len(items) - len(kept)} of {len(items)} {name} {split} pairs with "
                  f"missing or unreadable images: numbers are not comparable to published ones")
        return kept
    missing = [p for it in items for p in paths(it) if not os.path.isfile(p)]
    if missing:
        raise SystemExit(f"{len(missing)} image(s) of {name} {split} missing, first {missing[0]}: expected the "
                         f"dataset's images under {root} ({SEE}), or pass --skip-missing to drop those pairs")
    return items


# -----------------------------------------------------------------------------
# torch datasets: the same three classes serve all datasets


def _decode_uint8(path, size):
    return resize_uint8(open_image(path), size).numpy()


class ImageCache:
    """Every image of some items decoded once to uint8 [N, 3, S, S] (27 KiB each at 96 px): a small model on a
    CPU trains faster than PNGs decode. Forked DataLoader workers share the tensor without copying it."""

    def __init__(self, items, size, workers=2):
        paths = sorted({p for it in items for p in (it.before, it.after, it.alt_before) if p})
        self.index = {p: i for i, p in enumerate(paths)}
        t0 = time.time()
        with Pool(max(1, workers)) as pool:
            arrays = pool.map(partial(_decode_uint8, size=size), paths, chunksize=64)
        self.data = torch.from_numpy(np.stack(arrays))  # (N, 3, S, S) uint8
        self.rate = len(paths) / (time.time() - t0)

    def __getitem__(self, path):
        return self.data[self.index[path]]


class _Pairs(torch.utils.data.Dataset):
    """Items -> images (streamed from disk, or from an ImageCache) and pre-tokenized captions. Empty captions
    (Spot-the-Diff has a few) stay in the items, for the published reference counts, but are never trained on."""

    def __init__(self, items, size=224, context_length=32, cache=None, captions=True):
        self.items, self.size, self.cache = items, size, cache
        if captions:  # all captions tokenized once; rows[i] = token rows of item i's non-empty captions
            texts = [c for it in items for c in it.captions]
            self.tokens = tokenize(texts, context_length, truncate=True)  # (all captions, context_length)
            starts = np.cumsum([0] + [len(it.captions) for it in items])
            self.rows = [[r for r in range(starts[i], starts[i + 1]) if texts[r].strip()] for i in range(len(items))]

    def image(self, path):
        if self.cache is not None:
            return normalize(self.cache[path])
        try:
            return load_image(path, self.size)
        except SystemExit as e:  # a worker must raise an Exception for the DataLoader to re-raise it
            raise OSError(f"{e}: expected a readable PNG/JPEG image there ({SEE})") from None


def _key(key):
    """EpochSampler yields (index, seed) so random choices in workers repeat exactly; a plain int uses `random`."""
    return (key[0], random.Random(key[1])) if isinstance(key, tuple) else (key, random)


class CaptionDataset(_Pairs):
    """One sample per caption -> (before, after, token_ids, item_index). swap_prob: CLEVR adaptation replaces the
    before image by the scene's non-semantic image with this probability (authors: 0.5)."""

    def __init__(self, items, size=224, context_length=32, swap_prob=0.0, cache=None):
        super().__init__(items, size, context_length, cache)
        self.samples = [(i, r) for i, rows in enumerate(self.rows) for r in rows]  # (item index, token row)
        self.swap_prob = swap_prob

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, key):
        k, rng = _key(key)
        i, r = self.samples[k]
        it = self.items[i]
        before = it.alt_before if it.alt_before and rng.random() < self.swap_prob else it.before
        return self.image(before), self.image(it.after), self.tokens[r], i


class PairDataset(_Pairs):
    """One sample per pair with a random one of its captions -> (before, after, token_ids, item_index)."""

    def __init__(self, items, size=224, context_length=32, cache=None):
        super().__init__(items, size, context_length, cache)
        self.index = [i for i, rows in enumerate(self.rows) if rows]  # pairs with something to learn

    def __len__(self):
        return len(self.index)

    def __getitem__(self, key):
        k, rng = _key(key)
        i = self.index[k]
        it = self.items[i]
        return self.image(it.before), self.image(it.after), self.tokens[rng.choice(self.rows[i])], i


class ImageDataset(_Pairs):
    """Images only -> (before, after, item_index); references stay in items[i].captions."""

    def __init__(self, items, size=224, cache=None):
        super().__init__(items, size, cache=cache, captions=False)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, key):
        i, _ = _key(key)
        return self.image(self.items[i].before), self.image(self.items[i].after), i


class EpochSampler(torch.utils.data.Sampler):
    """Order and per-sample seeds are a function of (seed, epoch) only: call set_epoch(e) before each epoch (as
    with DistributedSampler) and a resumed run sees the same batches, even with persistent workers. Under
    torchrun each of `world` processes takes every world-th sample of the same order (rank's share)."""

    def __init__(self, n, shuffle, seed=0, rank=0, world=1):
        self.n, self.shuffle, self.seed, self.epoch = n, shuffle, seed, 0
        self.rank, self.world = rank, world

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.n, generator=g) if self.shuffle else torch.arange(self.n)
        seeds = torch.randint(2**62, (self.n,), generator=g)
        n = len(self) * self.world  # drop the tail that does not split evenly over the processes
        return iter(list(zip(order.tolist(), seeds.tolist()))[self.rank:n:self.world])

    def __len__(self):
        return self.n // self.world


def make_loader(dataset, batch_size, shuffle=False, workers=0, device="cpu", sampler=None, drop_last=False, seed=0):
    """DataLoader with an EpochSampler (unless `sampler` is given, e.g. a DistributedSampler); pinned memory on
    CUDA; workers stay alive across epochs."""
    return torch.utils.data.DataLoader(
        dataset, batch_size, sampler=sampler or EpochSampler(len(dataset), shuffle, seed), num_workers=workers,
        pin_memory=str(device).startswith("cuda"), persistent_workers=workers > 0, drop_last=drop_last)


# -----------------------------------------------------------------------------
# synthetic CLEVR-Change: scenes, a small ray caster, captions

SHAPES = ("cube", "sphere", "cylinder")
COLORS = {"gray": (87, 87, 87), "red": (173, 35, 35), "blue": (42, 75, 215), "green": (29, 105, 20),
          "brown": (129, 74, 25), "purple": (129, 38, 192), "cyan": (41, 208, 208), "yellow": (255, 238, 51)}  # CLEVR's
MATERIALS = ("rubber", "metal")
SIZES = {"small": 0.6, "large": 0.95}  # radii; CLEVR's are 0.35/0.7, ours larger so a ~96 px input still shows them
CHANGES = ("color", "material", "move", "add", "drop")
ATTRS = ("size", "color", "material", "shape")
EXTENT = 2.7  # objects stand in [-EXTENT, EXTENT]^2 on the ground plane z = 0


def camera(j):
    """Pinhole camera above and in front of the scene, looking along +y. j: 6 jitter values in about [-1, 1]
    (position, look-at point, zoom); j = 0 is the base view. The distractor image moves them by 0.5-1."""
    pos = np.array([0.8 * j[0], -10.5 + 0.8 * j[1], 7.0 + 0.6 * j[2]])
    fwd = np.array([0.4 * j[3], 0.5 + 0.4 * j[4], 0.0]) - pos
    fwd /= np.linalg.norm(fwd)
    right = np.cross(fwd, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    return {"pos": pos, "fwd": fwd, "right": right, "up": np.cross(right, fwd), "zoom": 2.25 * (1 + 0.07 * j[5])}


def light(j):
    """Key light from the front left, as a direction towards it; j: 3 jitters (azimuth, elevation, power)."""
    az, el = np.radians(-125 + 35 * j[0]), np.radians(50 + 12 * j[1])
    return {"dir": np.array([np.cos(az) * np.cos(el), np.sin(az) * np.cos(el), np.sin(el)]), "power": 1 + 0.2 * j[2]}


def project(cam, p, w, h):
    d = np.asarray(p) - cam["pos"]
    z, f = d @ cam["fwd"], cam["zoom"] * w / 2
    return w / 2 + f * (d @ cam["right"]) / z, h / 2 - f * (d @ cam["up"]) / z, f / z  # u, v, pixels per unit


def geometry(o):
    """(centre of the bounding sphere, its radius) for an object dict."""
    r = SIZES[o["size"]]
    hz = {"cube": 0.8 * r, "sphere": r, "cylinder": 0.8 * r}[o["shape"]]
    return np.array([o["x"], o["y"], hz]), r * {"cube": 1.39, "sphere": 1.0, "cylinder": 1.13}[o["shape"]]


def visibility(objs, cam, w=60, h=40):
    """Fraction of each object's disc not hidden by nearer ones, on a coarse grid (CLEVR rejects scenes where an
    object is mostly occluded; we do too, so every object a caption names can be seen)."""
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    owner, area = np.full((h, w), -1), []
    depth = [(np.asarray(geometry(o)[0]) - cam["pos"]) @ cam["fwd"] for o in objs]
    for k in np.argsort(depth)[::-1]:  # far to near: nearer discs overwrite
        c, r = geometry(objs[k])
        u, v, s = project(cam, c, w, h)
        disc = (xs - u) ** 2 + (ys - v) ** 2 < (0.9 * r * s) ** 2
        owner[disc] = k
        area.append((k, disc.sum()))
    return {k: (owner == k).sum() / max(a, 1) for k, a in area}


def intersect(o, org, d):
    """Ray-object hits: (t [n], normal [n, 3], edge [n]); t = inf where the ray misses; edge = 1 on a cube's
    edges and the rim of a cylinder's top: drawn darker on rubber, as glinting bevels on metal, so shapes and
    materials read at low resolution."""
    r, c = SIZES[o["size"]], np.array([o["x"], o["y"], 0.0])
    t, edge = np.full(len(d), np.inf), np.zeros(len(d))
    n = np.zeros_like(d)
    if o["shape"] == "sphere":
        oc = org - c - [0, 0, r]
        b = d @ oc
        disc = b * b - oc @ oc + r * r
        hit = disc > 0
        t[hit] = -b[hit] - np.sqrt(disc[hit])
        n = (org + t[:, None] * d - c - [0, 0, r]) / r
    elif o["shape"] == "cube":  # slabs in the cube's own frame (rotated about z)
        s, a = 0.8 * r, np.radians(o["rot"])
        rot = np.array([[np.cos(a), np.sin(a), 0], [-np.sin(a), np.cos(a), 0], [0, 0, 1]])
        lo, ld = rot @ (org - c - [0, 0, s]), d @ rot.T
        ld = np.where(np.abs(ld) < 1e-9, 1e-9, ld)
        t1, t2 = (-s - lo) / ld, (s - lo) / ld
        near, far = np.minimum(t1, t2), np.maximum(t1, t2)
        tn, axis = near.max(1), near.argmax(1)
        hit = (tn < far.min(1)) & (tn > 0)
        t[hit] = tn[hit]
        nl = np.zeros_like(d)
        nl[np.arange(len(d)), axis] = -np.sign(ld[np.arange(len(d)), axis])
        n = nl @ rot
        q = np.sort(np.abs(lo + tn[:, None] * ld), axis=1)[:, 1]  # 2nd largest local coordinate: 1 on an edge
        edge = np.clip((q / s - 0.9) / 0.1, 0, 1)
    else:  # vertical cylinder: side, then the top cap
        a, hgt = 0.8 * r, 1.6 * r
        oc = org[:2] - c[:2]
        qa, qb, qc = (d[:, :2] ** 2).sum(1), 2 * d[:, :2] @ oc, oc @ oc - a * a
        disc = qb * qb - 4 * qa * qc
        ts = (-qb - np.sqrt(np.maximum(disc, 0))) / (2 * qa + 1e-12)
        zs = org[2] + ts * d[:, 2]
        side = (disc > 0) & (zs > 0) & (zs < hgt)
        t[side] = ts[side]
        p = org + ts[:, None] * d
        n[:, :2] = (p[:, :2] - c[:2]) / a
        tt = (hgt - org[2]) / np.minimum(d[:, 2], -1e-9)
        pt = org[:2] + tt[:, None] * d[:, :2]
        top = ~side & (((pt - c[:2]) ** 2).sum(1) < a * a)
        t[top], n[top] = tt[top], [0, 0, 1]
        rim = np.sqrt(((pt - c[:2]) ** 2).sum(1)) / a
        edge[top] = np.clip((rim[top] - 0.92) / 0.08, 0, 1)
    return t, n, edge


def shade(o, p, n, d, lt):
    """Rubber: diffuse with a faint sheen. Metal: a mirror tinted by its colour -- bright sky above the horizon,
    the floor below it (dark at the object's foot, lighter further out) -- and a sharp white highlight."""
    albedo = np.array(COLORS[o["color"]]) / 255
    ndl = np.clip(n @ lt["dir"], 0, 1)[:, None]
    half = lt["dir"] - d
    half /= np.linalg.norm(half, axis=1, keepdims=True)
    ndh = np.clip((n * half).sum(1), 0, 1)[:, None]
    if o["material"] == "rubber":
        return albedo * (0.3 + 0.75 * ndl * lt["power"]) + 0.04 * ndh ** 4
    refl = d - 2 * (d * n).sum(1, keepdims=True) * n
    rz = refl[:, 2:]
    reach = p[:, 2:] / np.maximum(-rz, 1e-3)  # how far the mirrored ray runs before it meets the floor
    env = np.where(rz > 0, 0.5 + np.clip(1.5 * rz, 0, 0.6), 0.6 * (1 - np.exp(-reach / 0.6)))
    hxy = half[:, :2] / (np.linalg.norm(half[:, :2], axis=1, keepdims=True) + 1e-9)
    streak = np.clip((n[:, :2] * hxy).sum(1), 0, 1)[:, None] ** 30 * (o["shape"] == "cylinder") * (n[:, 2:] < 0.1)
    return albedo * (0.03 + 0.15 * ndl + 0.95 * env) + 0.06 * env + lt["power"] * (1.2 * ndh ** 60 + 0.5 * streak)


def _box(cam, points, w, h, pad=2):
    """Screen rectangle (as slices) around projected world points."""
    u, v, _ = zip(*(project(cam, q, w, h) for q in points))
    y0, y1, x0, x1 = int(min(v)) - pad, int(max(v)) + pad + 1, int(min(u)) - pad, int(max(u)) + pad + 1
    return np.s_[max(y0, 0):min(y1, h), max(x0, 0):min(x1, w)]


def rays(cam, w, h, box=np.s_[:, :]):
    """Unit ray directions (H, W, 3) through the pixel centres inside `box`."""
    f = cam["zoom"] * w / 2
    xs, ys = (np.arange(w, dtype=np.float32) + 0.5 - w / 2) / f, (np.arange(h, dtype=np.float32) + 0.5 - h / 2) / f
    fwd, right, up = (cam[k].astype(np.float32) for k in ("fwd", "right", "up"))
    d = fwd + xs[box[1]][None, :, None] * right - ys[box[0]][:, None, None] * up
    return d / np.sqrt(np.einsum("hwc,hwc->hw", d, d))[..., None]


def floor(objs, cam, lt, w, h):
    """Floor brightness (h, w): a broad light pool, soft shadows, fading into the backdrop far away, like CLEVR's.
    It is smooth, so it is computed at half resolution and upsampled."""
    w2, h2 = (w + 1) // 2, (h + 1) // 2
    d, org = rays(cam, w2, h2), cam["pos"].astype(np.float32)
    t = np.where(d[..., 2] < 0, -org[2] / np.minimum(d[..., 2], -1e-9), np.float32(1e9))  # ray meets z = 0
    p = org[:2] + np.minimum(t, 60)[..., None] * d[..., :2]  # (h2, w2, 2) floor point
    g = 0.62 + 0.25 * np.exp(-((p[..., 0] + 2) ** 2 + (p[..., 1] + 1) ** 2) / np.float32(40))
    for o in objs:  # soft shadow: a disc on the floor between the object's foot and its cast point
        c, r = geometry(o)
        tip = c[:2] - c[2] * lt["dir"][:2] / lt["dir"][2]
        mid, reach = (c[:2] + tip) / 2, r + 0.5 * np.linalg.norm(tip - c[:2])
        box = _box(cam, [(mid[0] + a * (reach + r), mid[1] + b * (reach + r), 0) for a in (-1, 1) for b in (-1, 1)],
                   w2, h2)
        dist = np.sqrt(((p[box] - mid) ** 2).sum(-1))
        g[box] *= 1 - 0.45 * np.clip((reach - dist) / (0.5 * r), 0, 1)
    fog = np.exp(-np.maximum(t - 12, 0) / np.float32(10))
    g = g * lt["power"] * 0.95 * fog + 0.5 * (1 - fog)
    return np.asarray(Image.fromarray(g.astype(np.float32), "F").resize((w, h), Image.BILINEAR))


def render(objs, cam, lt, w, h):
    """Ray-cast objects over the floor -> uint8 [h, w, 3]. Only rays near an object are tested against it."""
    img = np.repeat(floor(objs, cam, lt, w, h)[..., None], 3, axis=-1)
    depth, org = np.full((h, w), np.inf, dtype=np.float32), cam["pos"].astype(np.float32)
    for o in objs:  # nothing is below the floor, so only objects compete for depth
        c, rb = geometry(o)
        box = _box(cam, [c + [a * rb, 0, b * rb] for a in (-1.2, 1.2) for b in (-1.2, 1.2)], w, h)
        d = rays(cam, w, h, box).reshape(-1, 3)
        to, no, edge = intersect(o, org, d)
        front = to < depth[box].ravel()
        to, no, edge, d = to[front], no[front], edge[front], d[front]
        m = front.reshape(depth[box].shape)
        depth[box][m] = to  # depth[box] is a view: this writes through
        rgb = shade(o, org + to[:, None] * d, no, d, lt)
        img[box][m] = rgb + 0.4 * edge[:, None] if o["material"] == "metal" else rgb * (1 - 0.35 * edge[:, None])
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


def new_object(rng, objs):
    """A random object on free floor whose (size, color, material, shape) no other object has, so the full
    description always names exactly one object. None when the floor is too crowded."""
    taken = {tuple(o[k] for k in ATTRS) for o in objs}
    for _ in range(50):
        o = {"size": rng.choice(list(SIZES)), "color": rng.choice(list(COLORS)), "material": rng.choice(MATERIALS),
             "shape": rng.choice(SHAPES), "x": rng.uniform(-EXTENT, EXTENT), "y": rng.uniform(-EXTENT, EXTENT),
             "rot": rng.uniform(0, 90)}
        if tuple(o[k] for k in ATTRS) not in taken and all(_apart(o, p) for p in objs):
            return o
    return None


def _apart(o, p, gap=0.25):
    return np.hypot(o["x"] - p["x"], o["y"] - p["y"]) > 1.15 * (SIZES[o["size"]] + SIZES[p["size"]]) + gap


def _in_frame(o, cam, margin=0.05):
    """The object's bounding circle lies inside the 3:2 frame, away from its border."""
    c, rad = geometry(o)
    u, v, s = project(cam, c, 1.5, 1.0)  # in image heights: the frame is [0, 1.5] x [0, 1]
    r = rad * s
    return 1.5 * margin < u - r and u + r < 1.5 * (1 - margin) and margin < v - r and v + r < 1 - margin


def make_scene(rng, kind):
    """(before objects, after objects, index of the changed object in before -- in after for "add")."""
    lo, hi = {"add": (3, 6), "drop": (4, 7)}.get(kind, (3, 7))  # 3-7 objects in both images
    cam = camera(np.zeros(6))
    while True:
        before, n = [], rng.randint(lo, hi)
        while len(before) < n and (o := new_object(rng, before)):
            before.append(o)
        if len(before) < n:
            continue
        after, k = [dict(o) for o in before], rng.randrange(len(before))
        if kind == "add":
            after.append(new_object(rng, before))
            k = len(after) - 1
        elif kind == "drop":
            del after[k]
        elif kind == "color":
            after[k]["color"] = rng.choice([c for c in COLORS if c != before[k]["color"]])
        elif kind == "material":
            after[k]["material"] = "metal" if before[k]["material"] == "rubber" else "rubber"
        elif kind == "move":  # to free floor at least 2 units away
            after[k] = {**before[k], "x": rng.uniform(-EXTENT, EXTENT), "y": rng.uniform(-EXTENT, EXTENT)}
            if np.hypot(after[k]["x"] - before[k]["x"], after[k]["y"] - before[k]["y"]) < 2 or \
                    not all(_apart(after[k], p) for p in before if p is not before[k]):
                continue
        if None in after or len({tuple(o[a] for a in ATTRS) for o in after}) < len(after):
            continue
        if not all(_in_frame(o, cam) for o in before + after):
            continue
        vb, va = visibility(before, cam), visibility(after, cam)
        if min(vb.values()) < 0.4 or min(va.values()) < 0.4:  # every object can be seen, at least in part
            continue
        if (kind != "add" and vb[k] < 0.8) or (kind != "drop" and va[k] < 0.8):  # the changed one clearly so
            continue
        return before, after, k


# captions in CLEVR-Change's style: synonyms, varied templates, referring expressions from visible attributes

SAY = {"small": ("small", "tiny"), "large": ("large", "big"), "rubber": ("rubber", "matte"),
       "metal": ("metal", "metallic", "shiny"), "cube": ("cube", "block"), "sphere": ("sphere", "ball"),
       "thing": ("thing", "object")}
RELATIONS = {  # in the base camera's frame (it looks along +y), with a margin so a viewer can tell
    "behind": lambda a, b: a["y"] - b["y"] > 0.8, "in front of": lambda a, b: b["y"] - a["y"] > 0.8,
    "to the left of": lambda a, b: b["x"] - a["x"] > 0.8, "to the right of": lambda a, b: a["x"] - b["x"] > 0.8}
TEMPLATES = {
    "color": ["the {o} changed its color", "the {o} changed to {new}", "the {o} became {new}", "the {o} turned {new}",
              "someone changed the color of the {o}", "the {o} was painted {new}", "the color of the {o} changed"],
    "material": ["the {o} changed its material", "the {o} became {new}", "the {o} turned {new}",
                 "the {o} is now {new}", "someone changed the material of the {o}", "the material of the {o} changed"],
    "move": ["the {o} has moved", "the {o} moved", "the {o} changed its location", "the {o} is in a different location",
             "someone moved the {o}", "the {o} has been moved", "the position of the {o} changed"],
    "add": ["someone added {a}", "{a} has been added", "{a} appeared", "there is a new {o}", "{a} was added",
            "a new {o} is in the scene"],
    "drop": ["the {o} has disappeared", "the {o} is missing", "someone removed the {o}", "the {o} is gone",
             "the {o} was removed", "the {o} is no longer there"],
}
NO_CHANGE = ["the scene is the same as before", "there is no difference", "the two scenes seem identical",
             "nothing has changed", "no change was made", "there is no change", "the scene remains the same",
             "nothing was modified", "no object has changed", "the two images show the same scene"]


def say(rng, word):
    return rng.choice(SAY.get(word, (word,)))


def refer(rng, o, scene, relate=0.15, was=False, nested=False):
    """A description that picks out o and only o in `scene` ("small red metal cube", "red thing", "cylinder that
    was behind the cube"): attributes a viewer can see, sometimes a spatial relation to another object."""
    keys = ATTRS if rng.random() < 0.55 else [k for k in ATTRS if rng.random() < 0.5]  # mostly all four, as CLEVR
    alike = [p for p in scene if p is not o and all(p[k] == o[k] for k in keys)]
    if not nested and (alike or rng.random() < relate):
        for ref in rng.sample(scene, len(scene)):
            rels = [r for r, holds in RELATIONS.items() if holds(o, ref) and not any(holds(p, ref) for p in alike)]
            if ref is not o and ref not in alike and rels:
                that = "that was " if was else rng.choice(["that is ", ""])  # "moved the cube to the left of" misleads
                return f"{describe(rng, o, keys)} {that}{rng.choice(rels)} the {refer(rng, ref, scene, nested=True)}"
    return describe(rng, o, ATTRS if alike else keys)


def describe(rng, o, keys):
    words = [say(rng, o[k]) for k in ("size", "color", "material") if k in keys]
    return " ".join(words + [say(rng, o["shape"] if "shape" in keys else "thing")])


def captions(rng, kind, before, after, k, n=6):
    """About n distinct captions of the change (the object named as it was, the added one as it is)."""
    out = []
    for _ in range(10 * n):
        if kind == "add":
            o = refer(rng, after[k], after)
        else:
            o = refer(rng, before[k], before, was=kind in ("move", "drop"))
        new = say(rng, after[k][kind]) if kind in ("color", "material") else ""
        text = rng.choice(TEMPLATES[kind]).format(o=o, new=new, a=("an " if o[0] in "aeiou" else "a ") + o)
        if text not in out:
            out.append(text)
        if len(out) == n:
            break
    return out


def _make_triple(i, out, seed, size, far_change=False):
    """Scene i -> default, semantic-change and non-semantic images on disk; returns its captions and type.
    The distractor moves the camera and the light by 0.5-1 (in jitter units); the change image moves the camera by
    0-0.3 only, or, with far_change, as much as the distractor, so only the objects tell the two apart."""
    rng = random.Random(f"clevr-synth-{seed}-{i}")  # one stream per scene: any worker split gives the same set
    kind = rng.choice(CHANGES)
    before, after, k = make_scene(rng, kind)
    jc, jl = [rng.uniform(-0.5, 0.5) for _ in range(6)], [rng.uniform(-0.3, 0.3) for _ in range(3)]
    shift = lambda js, lo, hi: [a + rng.choice((-1, 1)) * rng.uniform(lo, hi) for a in js]
    changed = (after, shift(jc, 0.5, 1), shift(jl, 0.5, 1)) if far_change else (after, shift(jc, 0, 0.3), jl)
    views = {"images/CLEVR_default": (before, jc, jl), "sc_images/CLEVR_semantic": changed,
             "nsc_images/CLEVR_nonsemantic": (before, shift(jc, 0.5, 1), shift(jl, 0.5, 1))}
    for name, (objs, j1, j2) in views.items():
        Image.fromarray(render(objs, camera(j1), light(j2), *size)).save(f"{out}/{name}_{i:06d}.png", compress_level=1)
    return kind, captions(rng, kind, before, after, k), rng.sample(NO_CHANGE, 6)


def make_synth(out=SYNTH_ROOT, pairs=3000, seed=0, size=(240, 160), workers=None, far_change=False):
    """Write a synthetic CLEVR-Change (images/, sc_images/, nsc_images/, the caption, split and type files)."""
    out = Path(out)
    for d in ("images", "sc_images", "nsc_images"):
        (out / d).mkdir(parents=True, exist_ok=True)
    (out / "synth.json").unlink(missing_ok=True)  # written last: marks a complete set
    t0 = time.time()
    with Pool(workers or os.cpu_count()) as pool:
        scene = partial(_make_triple, out=str(out), seed=seed, size=tuple(size), far_change=far_change)
        made = pool.map(scene, range(pairs), chunksize=8)
    name = lambda i: f"CLEVR_default_{i:06d}.png"
    types = {t: [f"{i:06d}.png" for i, m in enumerate(made) if m[0] == t] for t in CHANGES}
    order = random.Random(seed).sample(range(pairs), pairs)
    n_val, n_test = max(1, pairs // 20), max(1, pairs // 10)  # the real split is 85 / 5 / 10 %
    meta = {"pairs": pairs, "size": list(size), "seed": seed, **({"far_change": 1} if far_change else {})}
    files = {"change_captions.json": {name(i): m[1] for i, m in enumerate(made)},
             "no_change_captions.json": {name(i): m[2] for i, m in enumerate(made)}, "type_mapping.json": types,
             "splits.json": {"train": order[n_val + n_test:], "val": order[:n_val],
                             "test": order[n_val:n_val + n_test]},
             "synth.json": meta}  # far_change only when set: a far-change set is never taken for the default one
    for f, obj in files.items():
        (out / f).write_text(json.dumps(obj))
    dt = time.time() - t0
    print(f"synthetic CLEVR-Change: {pairs} triples ({size[0]}x{size[1]}) in {out} in {dt:.1f}s, "
          f"{pairs / dt:.0f} triples/s")
    return out


# -----------------------------------------------------------------------------
# looking at the data, measuring decode speed


def contact_sheet(root, out, n=8, size=0, split="test", seed=0):
    """One row per pair: before | after | distractor | change type and captions. size > 0 first squashes each
    image to size x size, as the model sees it (shown 2x, nearest)."""
    from PIL import ImageDraw
    items = load_items("clevr", root, split, "semantic")
    items = sorted(random.Random(seed).sample(items, min(n, len(items))), key=lambda it: it.change_type or "")
    shown = lambda p: (Image.open(p).convert("RGB").resize((size, size), Image.BICUBIC).resize((2 * size, 2 * size),
                       Image.NEAREST) if size else Image.open(p).convert("RGB"))
    w, h = shown(items[0].before).size
    sheet = Image.new("RGB", (3 * w + 560, len(items) * h), "white")
    draw = ImageDraw.Draw(sheet)
    for r, it in enumerate(items):
        for c, p in enumerate((it.before, it.after, it.alt_before)):
            sheet.paste(shown(p), (c * w, r * h))
        draw.text((3 * w + 6, r * h + 4), f"{it.id} {it.change_type}\n" + "\n".join(it.captions[:4]), fill="black")
    sheet.save(out)
    print(f"{out}: {len(items)} pairs from {root} ({split}): before | after | non-semantic distractor")


def bench(root, size, workers, n=1024):
    """Decoded images/s: streamed by DataLoader workers, decoding the cache, and served from the cache."""
    items = load_items("clevr", root, "train", "total")[: n // 2]
    ds = ImageDataset(items, size)
    t0 = time.time()
    for _ in make_loader(ds, 32, workers=workers):
        pass
    stream = 2 * len(items) / (time.time() - t0)
    cache = ImageCache(items, size, workers)
    t0 = time.time()
    for _ in make_loader(ImageDataset(items, size, cache=cache), 32):
        pass
    cached = 2 * len(items) / (time.time() - t0)
    print(f"{size} px, {workers} workers: streaming {stream:.0f} images/s, building the cache {cache.rate:.0f} "
          f"images/s, from the cache {cached:.0f} images/s ({cache.data.numel() / 2**20:.0f} MiB for "
          f"{len(cache.data)} images)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cmd = p.add_subparsers(dest="cmd", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    m = cmd.add_parser("make-synth", formatter_class=fmt, help="render a synthetic CLEVR-Change-style set")
    m.add_argument("--out", default=SYNTH_ROOT, help="directory to write (CLEVR-Change's layout)")
    m.add_argument("--pairs", type=int, default=3000, help="number of scenes (default, semantic, non-semantic)")
    m.add_argument("--seed", type=int, default=0, help="same seed, same set")
    m.add_argument("--size", type=int, nargs=2, default=[240, 160], metavar=("W", "H"),
                   help="image size on disk (CLEVR-Change's is 480 320)")
    m.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    m.add_argument("--far-change", action="store_true",
                   help="move the change image's camera and light as far as the distractor's (a harder set)")
    s = cmd.add_parser("sheet", formatter_class=fmt, help="contact sheet of CLEVR-Change(-style) pairs")
    s.add_argument("--root", default=SYNTH_ROOT, help="a CLEVR-Change directory")
    s.add_argument("--out", default="sheet.png", help="PNG to write")
    s.add_argument("--n", type=int, default=8, help="pairs (rows)")
    s.add_argument("--size", type=int, default=0, help="show images squashed to this input size (0: as on disk)")
    s.add_argument("--split", default="test", help="train, val or test")
    s.add_argument("--seed", type=int, default=0, help="which pairs")
    b = cmd.add_parser("bench", formatter_class=fmt, help="decode throughput, streaming and cached")
    b.add_argument("--root", default=SYNTH_ROOT, help="a CLEVR-Change directory")
    b.add_argument("--size", type=int, default=96, help="model input size")
    b.add_argument("--workers", type=int, default=2, help="DataLoader / cache worker processes")
    b.add_argument("--images", type=int, default=1024, help="images to decode")
    args = p.parse_args()
    if args.cmd == "make-synth":
        make_synth(args.out, args.pairs, args.seed, args.size, args.workers, args.far_change)
    elif args.cmd == "sheet":
        contact_sheet(args.root, args.out, args.n, args.size, args.split, args.seed)
    else:
        bench(args.root, args.size, args.workers, args.images)
