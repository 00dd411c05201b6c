"""Data: the CLEVR-Change, Spot-the-Diff, Image-Editing-Request, LEVIR-CC and your own pairs' loaders (each pair an
`Item`), the training samples (`CaptionDataset`) and evaluation images (`ImageDataset`), read from a decoded-image
cache or streamed. Without CLEVR-Change, `resolve_root("clevr")` renders synth.py's set once.
"""
import hashlib
import json
import os
import shutil
import socket
import time
from collections import Counter
from functools import partial
from multiprocessing import Pool
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

import synth
from clip_load import WEIGHTS, normalize, open_image, resize_uint8, tokenize

ROOTS = {"clevr": "data/clevr_change", "spot": "data/spot_the_diff", "ier": "data/image_editing_request",
         "levir": "data/levir_cc", "pairs": "data/pairs"}
SEE = f"see {WEIGHTS} for where to get it"
CLEVR_FILES = ("images", "sc_images", "nsc_images", "change_captions.json", "no_change_captions.json",
               "splits.json", "type_mapping.json")

# -----------------------------------------------------------------------------
# items: one image pair with its captions


class Item(NamedTuple):
    id: str
    before: str  # path
    after: str  # path
    captions: list
    change_type: str | None = None  # clevr: color/material/move/add/drop/distractor
    alt_before: str | None = None  # clevr: the distractor (camera moved), for the swap


def resolve_root(name, root=None, synth_pairs=3000, synth_size=synth.IMAGE_SIZE, seed=0, workers=None):
    """The dataset's directory; "clevr" without one: the synthetic set, rendered once."""
    if name not in ROOTS:
        raise SystemExit(f"unknown dataset {name!r}: expected one of {list(ROOTS)}")
    if root is not None or name != "clevr" or Path(ROOTS[name]).exists():
        return Path(root or ROOTS[name])
    print(f"*** no CLEVR-Change at {ROOTS[name]}: using the SYNTHETIC CLEVR-Change-style set at {synth.SYNTH_ROOT} "
          f"({synth_pairs} scenes; not comparable to the paper). For the real one: {WEIGHTS}. ***")
    return synth.resolve_set(synth.SYNTH_ROOT, synth_pairs, seed, synth_size, workers)


def is_real(name, root=None):
    """A dataset at root (default data/<name>) that is not the synthetic set (its synth.json)."""
    root = Path(root or ROOTS[name])
    return root.exists() and not (root / "synth.json").is_file()


def load_items(name, root, split, setting="total", skip_missing=False, images=True):
    """Items of one split. clevr "semantic": change pairs only; "total": and the distractor pairs."""
    root = Path(root)
    if not root.is_dir():
        see = "see README 'Your own image pairs'" if name == "pairs" else SEE
        raise SystemExit(f"no {name} dataset at {root} (--data-root; default {ROOTS[name]}): {see}")
    items = {"clevr": partial(_clevr, setting=setting), "spot": _spot, "ier": _ier, "levir": _levir,
             "pairs": partial(_pairs, skip_missing=skip_missing, images=images)}[name](root, split)
    items = _nonempty_captions(items, name, split)
    return _check_files(items, name, root, split, skip_missing) if images else items


def _nonempty_captions(items, name, split):
    kept = [it._replace(captions=[c for c in it.captions if c.strip()]) for it in items]
    n_empty = sum(len(a.captions) - len(b.captions) for a, b in zip(items, kept))
    if n_empty:
        dropped = sum(not it.captions for it in kept)
        print(f"{name} {split}: {n_empty} empty caption(s) ignored; {dropped} pair(s) with no caption left out")
    return [it for it in kept if it.captions]


def _read_json(path, what, valid=lambda obj: True, see=SEE):
    if not path.is_file():
        raise SystemExit(f"missing {path}: expected {what} there, {see}")
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SystemExit(f"{path} is not valid JSON ({e}): expected {what}") from None
    _expect(valid(obj), path, what, see)
    return obj


def _expect(ok, path, what, see=SEE):
    if not ok:
        raise SystemExit(f"{path} is not in the expected format: {what} ({see})")


def _captions_ok(caps):
    return isinstance(caps, list) and all(isinstance(c, str) for c in caps)


def _clevr(root, split, setting):
    if missing := [f for f in CLEVR_FILES if not (root / f).exists()]:
        raise SystemExit(f"CLEVR-Change at {root} lacks {', '.join(missing)}: {SEE}")
    want = 'split ids {"train": [0, 3, ...], "val": [...], "test": [...]}'
    splits = _read_json(root / "splits.json", want, lambda obj: isinstance(obj, dict))
    if split not in splits:
        raise SystemExit(f"{root / 'splits.json'} has no {split!r} list (it has {list(splits)})")
    ids = splits[split]
    _expect(isinstance(ids, list) and all(isinstance(i, int) or (isinstance(i, str) and i.isdigit()) for i in ids),
            root / "splits.json", f"{split!r}: a list of integer image ids, got {str(ids)[:60]}")
    ids = [int(i) for i in ids]
    want = 'captions {"CLEVR_default_000000.png": ["a caption", ...], ...}'
    valid = lambda caps: isinstance(caps, dict) and all(_captions_ok(c) for c in caps.values())
    change, same = (_read_json(root / f, want, valid) for f in ("change_captions.json", "no_change_captions.json"))
    want = 'change type -> image files {"color": ["000000.png", ...], ...}'
    mapping = _read_json(root / "type_mapping.json", want, lambda obj: isinstance(obj, dict) and all(
        isinstance(v, list) and all(isinstance(f, str) and f[:6].isdigit() for f in v) for v in obj.values()))
    types = {int(f[:6]): t for t, files in mapping.items() for f in files}
    items = []
    for i in ids:
        key = f"CLEVR_default_{i:06d}.png"
        if key not in change or key not in same:
            raise SystemExit(f"{key} (split {split}) has no captions in {root}/(no_)change_captions.json")
        default, sc, nsc = (str(root / d / f"CLEVR_{n}_{i:06d}.png") for d, n in
                            (("images", "default"), ("sc_images", "semantic"), ("nsc_images", "nonsemantic")))
        items.append(Item(f"{i:06d}", default, sc, change[key], types.get(i), nsc))
        if setting == "total":  # the distractor pair: viewpoint and lighting differ
            items.append(Item(f"{i:06d}_n", default, nsc, same[key], "distractor"))
    return items


def _first_dir(root, names):
    """The first of these directories that exists (archives unpack differently)."""
    return next((root / n for n in names if (root / n).is_dir()), root)


def _spot(root, split):
    ann = _first_dir(root, ["annotations", "data/annotations"]) / f"{split}.json"
    images = _first_dir(root, ["resized_images", "images", "data/resized_images"])
    want = 'Spot-the-Diff annotations [{"img_id": 12, "sentences": ["...", ...]}, ...]'
    entries = _read_json(ann, want, lambda obj: isinstance(obj, list) and all(
        isinstance(d, dict) and isinstance(d.get("img_id"), (int, str)) and _captions_ok(d.get("sentences"))
        for d in obj))
    merged = {}  # a repeated img_id's sentences merged
    for d in entries:
        merged.setdefault(str(d["img_id"]), []).extend(d["sentences"])
    return [Item(i, str(images / f"{i}.png"), str(images / f"{i}_2.png"), s) for i, s in merged.items()]


def _ier(root, split):
    split = {"val": "valid"}.get(split, split)
    ann = _first_dir(root, ["data"]) / f"{split}.json"
    images = _first_dir(root, ["images"])
    want = 'Image-Editing-Request annotations [{"img0": "a.jpg", "img1": "b.jpg", "sents": ["...", ...], "uid": ...}]'
    entries = _read_json(ann, want, lambda obj: isinstance(obj, list) and all(
        isinstance(d, dict) and all(isinstance(d.get(k), str) for k in ("img0", "img1")) and
        isinstance(d.get("uid"), (str, int)) and _captions_ok(d.get("sents")) for d in obj))
    return [Item(str(d["uid"]), str(images / d["img0"]), str(images / d["img1"]), d["sents"]) for d in entries]


def _levir(root, split):
    """LEVIR-CC: LevirCCcaptions.json, images/{split}/A (before) and B (after)."""
    ann = root / "LevirCCcaptions.json"
    want = ('LEVIR-CC captions {"images": [{"filename": "train_000016.png", "split": "train", "sentences": '
            '[{"raw": "..."}, ...]}, ...]}')
    entries = _read_json(ann, want, lambda obj: isinstance(obj, dict) and isinstance(obj.get("images"), list) and all(
        isinstance(d, dict) and isinstance(d.get("filename"), str) and d.get("split") in ("train", "val", "test")
        and isinstance(d.get("sentences"), list) and all(isinstance(s, dict) and isinstance(s.get("raw"), str)
                                                         for s in d["sentences"]) for d in obj["images"]))["images"]
    images = _first_dir(root, ["images"])
    return [Item(Path(d["filename"]).stem, str(images / split / "A" / d["filename"]),
                 str(images / split / "B" / d["filename"]), [s["raw"].strip() for s in d["sentences"]])
            for d in entries if d["split"] == split]


PAIRS = "pairs.json"


def _pairs(root, split, skip_missing, images):
    """Your own pairs: pairs.json's entries, paths relative to root; a bad one an error, or dropped (skip_missing)."""
    file, see = root / PAIRS, "README 'Your own image pairs'"
    want = 'a list [{"before": "a.png", "after": "b.png", "captions": ["..."], "split": "train"}, ...]'
    entries = _read_json(file, want, lambda obj: isinstance(obj, list), see)
    items, first, dropped = [], {}, Counter()
    for k, d in enumerate(entries):
        pair = (d.get("before"), d.get("after")) if isinstance(d, dict) else None
        if not (pair and all(isinstance(p, str) for p in pair) and _captions_ok(d.get("captions"))):
            problem = "malformed entry", 'it needs "before" and "after" paths and a "captions" list of strings'
        elif d.get("split") not in ("train", "val", "test"):
            problem = "unknown split", f"its split {d.get('split')!r} is not train, val or test"
        elif not any(c.strip() for c in d["captions"]):
            problem = "no caption", "its caption list is empty"
        elif pair in first:
            problem = "repeated pair", f"it repeats entry {first[pair]}'s pair: join their captions in one entry"
        elif missing := [p for p in pair if images and not (root / p).is_file()]:
            problem = "missing image", f"no image at {root / missing[0]}: fix its path (relative to {root})"
        else:
            problem, first[pair] = None, k  # what a later entry may repeat: a kept one
        if problem and not skip_missing:
            raise SystemExit(f"{file} entry {k} (from 0): {problem[1]} (or --skip-missing drops such entries)")
        dropped.update([problem[0]] if problem else [])
        if not problem and d["split"] == split:
            items.append(Item(str(k), str(root / pair[0]), str(root / pair[1]), d["captions"]))
    if dropped and split == "train":  # said once a run: every run reads the train split
        print(f"--skip-missing: dropped {sum(dropped.values())} of {len(entries)} entries of {file} ("
              + ", ".join(f"{n} {kind}" for kind, n in dropped.items()) + ")")
    if not items:
        raise SystemExit(f'{file} has no {split} pair: give some entries "split": "{split}" ({see})')
    return items


class BadImage(OSError):
    """An undecodable image; its message says which and what to do."""


def run(main):
    """A script's main(); an undecodable image said in one line, not the DataLoader's traceback."""
    try:
        return main()
    except BadImage as e:
        last = str(e).strip().splitlines()[-1]
        raise SystemExit(last.removeprefix(f"{__name__}.BadImage: ").removeprefix("BadImage: ")) from None


def _readable(path):
    try:
        with Image.open(path) as im:
            im.load()  # a truncated file fails here
        return True
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return False


def _check_files(items, name, root, split, skip_missing):
    """Missing images are an error; skip_missing drops those pairs (and unreadable ones), counted."""
    paths = lambda it: [p for p in (it.before, it.after, it.alt_before) if p]
    if skip_missing:
        with Pool(min(os.cpu_count() or 1, 8)) as pool:
            ok = dict(zip(image_paths(items), pool.map(_readable, image_paths(items), chunksize=64)))
        kept = [it for it in items if all(ok[p] for p in paths(it))]
        if len(kept) < len(items):
            print(f"--skip-missing: dropped {len(items) - len(kept)} of {len(items)} {name} {split} pairs (missing or "
                  f"unreadable images): not comparable to published figures")
        return kept
    missing = [p for it in items for p in paths(it) if not os.path.isfile(p)]
    if missing:
        raise SystemExit(f"{len(missing)} image(s) of {name} {split} missing, first {missing[0]} ({SEE}); "
                         f"--skip-missing drops those pairs")
    return items


# -----------------------------------------------------------------------------
# torch datasets


def _decode_uint8(path, size):
    """Squashed to uint8 [3, size, size]; BadImage, not SystemExit (that would hang a Pool)."""
    try:
        return resize_uint8(open_image(path), size).numpy()
    except SystemExit as e:
        raise BadImage(f"{e}: replace it with a readable image, or --skip-missing drops its pair ({SEE})") from None


def pair_images(batch, device):
    """A batch's before and after images on `device`, normalized for CLIP."""
    return [normalize(batch[k].to(device, non_blocking=True)) for k in ("before", "after")]


def image_paths(items):
    return sorted({p for it in items for p in (it.before, it.after, it.alt_before) if p})


PREPROCESS = "squash-bicubic-uint8-v1"  # renamed when the decoding rule changes


def cache_dir(directory=None):
    """`directory`, else $CLIP4IDC_IMAGE_CACHE, else $XDG_CACHE_HOME's (~/.cache's) clip4idc/images."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(directory or os.environ.get("CLIP4IDC_IMAGE_CACHE") or home / "clip4idc" / "images")


def use_image_cache(items, size, flag=None, directory=None):
    """flag, else whether the cache's disk has room."""
    if flag is not None:
        return flag
    where = cache_dir(directory)
    while not where.exists():
        where = where.parent
    return len(image_paths(items)) * 3 * size * size < shutil.disk_usage(where).free * 0.9


class ImageCache:
    """The items' images decoded once to uint8 [N, 3, S, S] in a memmapped file named by a hash of what made it."""

    def __init__(self, items, size, workers=2, log_every=0, directory=None):
        paths = image_paths(items)
        stamp = [PREPROCESS, size] + [(p, s.st_size, s.st_mtime_ns) for p in paths for s in [os.stat(p)]]
        key = hashlib.sha1(json.dumps(stamp).encode()).hexdigest()[:16]
        self.folder = cache_dir(directory) / f"{len(paths)}x{size}px-{key}"
        self.index = {p: i for i, p in enumerate(paths)}
        self.built = not (self.folder / "images.npy").is_file()
        self.rate = _build_cache(self.folder, paths, size, workers, log_every) if self.built else None  # images/s
        # copy-on-write: writable for torch, shared between processes
        self.array = np.load(self.folder / "images.npy", mmap_mode="c")
        if self.array.shape != (len(paths), 3, size, size):
            raise SystemExit(f"image cache {self.folder} holds {self.array.shape}: delete it and run again")
        self.data = torch.from_numpy(self.array)

    def __getitem__(self, path):
        return self.data[self.index[path]]

    def batch(self, paths):
        """uint8 [B, 3, S, S], read in file order."""
        idx = np.array([self.index[p] for p in paths])
        order = np.argsort(idx, kind="stable")
        out = torch.empty((len(idx), *self.data.shape[1:]), dtype=torch.uint8)
        out[torch.from_numpy(order)] = torch.from_numpy(np.ascontiguousarray(self.array[idx[order]]))
        return out


def _build_cache(folder, paths, size, workers, log_every):
    tmp = _start_build(folder)
    t0 = time.time()
    try:
        array = np.lib.format.open_memmap(tmp / "images.npy", mode="w+", dtype=np.uint8,
                                          shape=(len(paths), 3, size, size))
        with Pool(max(1, workers)) as pool:
            try:
                for i, a in enumerate(pool.imap(partial(_decode_uint8, size=size), paths, chunksize=64)):
                    array[i] = a
                    if log_every and (i + 1) % log_every == 0:
                        rate = (i + 1) / (time.time() - t0)
                        print(f"   decoding images into {folder}: {i + 1}/{len(paths)}, {rate:.0f} images/s, ETA "
                              f"{(len(paths) - i - 1) / rate:.0f}s", flush=True)
            except OSError as e:  # BadImage
                raise SystemExit(str(e)) from None
        array.flush()
        del array
        (tmp / "paths.json").write_text(json.dumps(paths))
        try:
            os.rename(tmp, folder)
        except OSError:  # another run finished the same cache first
            if not (folder / "images.npy").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # same name, same images
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return len(paths) / max(time.time() - t0, 1e-9)


def _start_build(folder):
    """This process's build folder beside `folder`; dead builds' leftovers on this host removed."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    for old in folder.parent.glob(f"{folder.name}.tmp-{host}-*"):
        if not _alive(int(old.name.rsplit("-", 1)[1])):
            shutil.rmtree(old, ignore_errors=True)
    tmp = folder.parent / f"{folder.name}.tmp-{host}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _alive(pid):
    try:
        os.kill(pid, 0)  # no signal sent
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's
    return True


def open_image_cache(items, size, flag=None, directory=None):
    if not use_image_cache(items, size, flag, directory):
        return None
    cache = ImageCache(items, size, os.cpu_count(), log_every=20_000, directory=directory)
    what = f"{len(cache.index)} images at {size} px ({cache.data.numel() / 2**30:.2f} GiB)"
    print(f"   image cache: decoded {what} at {cache.rate:.0f} images/s into {cache.folder}" if cache.built else
          f"   image cache: {what} from {cache.folder}", flush=True)
    return cache


class _Pairs(torch.utils.data.Dataset):
    """Items -> dicts of uint8 "before", "after" (or a frozen encoder's "features") and `parts(key)`'s fields;
    `__getitems__` builds whole batches."""

    def __init__(self, items, size=224, cache=None, features=None):
        self.items, self.size, self.cache, self.features = items, size, cache, features

    def image(self, path):
        return self.cache[path] if self.cache is not None else torch.from_numpy(_decode_uint8(path, self.size))

    def pair(self, i, before, **rest):
        """Item i's ({field: image path}, rest), or its features in rest."""
        if self.features is not None:
            return {}, {"features": self.features[i], **rest}
        return {"before": before, "after": self.items[i].after}, rest

    def __getitem__(self, key):
        paths, rest = self.parts(key)
        return {**{k: self.image(p) for k, p in paths.items()}, **rest}

    def __getitems__(self, keys):
        paths, rest = zip(*(self.parts(k) for k in keys))
        images = {k: self.cache.batch([p[k] for p in paths]) if self.cache is not None else
                  torch.stack([self.image(p[k]) for p in paths]) for k in paths[0]}
        return {**images, **{k: torch.utils.data.default_collate([r[k] for r in rest]) for k in rest[0]}}


def sample_rng(seed, epoch, index):
    """A sample's random choices, from (seed, epoch, index) alone: alike in any worker and on resume."""
    return np.random.default_rng([seed, epoch, index])


def set_epoch(loader, epoch):
    """Before each training epoch: its order and its per-sample randomness."""
    (loader.batch_sampler if isinstance(loader.batch_sampler, DistractorBatches) else loader.sampler).set_epoch(epoch)
    if hasattr(loader.dataset, "epoch"):
        loader.dataset.epoch = epoch


class CaptionDataset(_Pairs):
    """Training samples: one per caption, or (draw) one per pair, its caption drawn per epoch; swap_prob: the chance
    of the before image's distractor."""

    def __init__(self, items, size=224, context_length=32, swap_prob=0.0, cache=None, seed=0, ids=None,
                 draw=False, features=None):
        super().__init__(items, size, cache, features)
        if ids is None:
            ids = tokenize([c for it in items for c in it.captions], context_length, truncate=True)
        self.tokens = ids
        owners = [i for i, it in enumerate(items) for _ in it.captions]
        counts = [len(it.captions) for it in items]
        self.first = np.cumsum([0] + counts[:-1]).tolist()  # each item's first caption row
        # a sample: (item index, its token row or None: drawn)
        self.samples = [(i, None) for i in range(len(items))] if draw else list(zip(owners, range(len(owners))))
        self.counts, self.swap_prob, self.seed, self.epoch = counts, swap_prob, seed, 0

    def __len__(self):
        return len(self.samples)

    def parts(self, k):
        i, r = self.samples[k]
        it = self.items[i]
        rng = sample_rng(self.seed, self.epoch, k) if r is None or (it.alt_before and self.swap_prob) else None
        if r is None:
            r = self.first[i] + int(rng.integers(self.counts[i]))
        swap = it.alt_before and self.swap_prob and rng.random() < self.swap_prob
        return self.pair(i, it.alt_before if swap else it.before, ids=self.tokens[r], index=i)


class ImageDataset(_Pairs):
    def __len__(self):
        return len(self.items)

    def parts(self, i):
        return self.pair(i, self.items[i].before, index=i)


class EpochSampler(torch.utils.data.Sampler):
    """Indices in an order of (seed, epoch) alone, as on resume."""

    def __init__(self, n, shuffle, seed=0):
        self.n, self.shuffle, self.seed, self.epoch = n, shuffle, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter((torch.randperm(self.n, generator=g) if self.shuffle else torch.arange(self.n)).tolist())

    def __len__(self):
        return self.n


class DistractorBatches(torch.utils.data.Sampler):
    """Stage 2's batches as the authors' (dataloader_clevr_caption.py 197-213): `batch` change pairs, then
    their distractors."""

    def __init__(self, pairs, batch, seed=0):
        self.pairs, self.batch, self.order = pairs, batch, EpochSampler(len(pairs), True, seed)

    def set_epoch(self, epoch):
        self.order.set_epoch(epoch)

    def __iter__(self):
        order = list(self.order)
        for b in range(len(self)):
            chunk = [self.pairs[i] for i in order[b * self.batch:(b + 1) * self.batch]]
            yield [c for c, _ in chunk] + [d for _, d in chunk]

    def __len__(self):
        return len(self.pairs) // self.batch


def distractor_partners(items):
    """(change, distractor) indices of each change pair whose distractor (000042_n) is in `items`."""
    index = {it.id: i for i, it in enumerate(items)}
    return [(i, index[it.id + "_n"]) for i, it in enumerate(items)
            if it.change_type != "distractor" and it.id + "_n" in index]


def make_loader(dataset, batch_size, shuffle=False, workers=0, device="cpu", drop_last=False, seed=0, pairs=None):
    """A DataLoader with an EpochSampler (or DistractorBatches of `pairs`); no workers for features."""
    workers = 0 if dataset.features is not None else workers
    order = dict(batch_sampler=DistractorBatches(pairs, batch_size, seed)) if pairs is not None else dict(
        batch_size=batch_size, sampler=EpochSampler(len(dataset), shuffle, seed), drop_last=drop_last)
    return torch.utils.data.DataLoader(
        dataset, **order, num_workers=workers, pin_memory=str(device).startswith("cuda"),
        collate_fn=_whole)


def _whole(batch):
    return batch  # __getitems__ built it
