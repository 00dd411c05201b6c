"""Tests for data.py: the synthetic set round-trips through the CLEVR-Change loader, the Spot-the-Diff and IER
loaders read the real annotation files (with placeholder images), errors name the path, batching is reproducible."""
import io
import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import data
from clip_load import load_image, tokenize

SHARED = Path(__file__).resolve().parent.parent / "shared"
SIZE = (96, 64)  # tiny renders keep the tests fast


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return data.make_synth(tmp_path_factory.mktemp("synth") / "clevr", pairs=20, seed=0, size=SIZE, workers=2)


def png_bytes(size=(8, 8)):
    buf = io.BytesIO()
    Image.new("RGB", size, (120, 30, 200)).save(buf, "PNG")
    return buf.getvalue()


def placeholders(paths):
    """Tiny valid PNGs at every path (copied bytes: thousands per second)."""
    blob = png_bytes()
    for p in paths:
        Path(p).parent.mkdir(parents=True, exist_ok=True)
        Path(p).write_bytes(blob)


# -----------------------------------------------------------------------------
# synthetic CLEVR-Change


def test_synth_roundtrip(synth):
    splits = json.loads((synth / "splits.json").read_text())
    assert sorted(sum(splits.values(), [])) == list(range(20)) and all(splits.values())
    seen = []
    for split in ("train", "val", "test"):
        sem = data.load_items("clevr", synth, split, "semantic")
        total = data.load_items("clevr", synth, split, "total")
        assert [it.id for it in sem] == [f"{i:06d}" for i in splits[split]]
        assert len(total) == 2 * len(sem)
        for it in sem:
            assert it.change_type in data.CHANGES and Path(it.alt_before).name.startswith("CLEVR_nonsemantic")
            assert 4 <= len(it.captions) <= 6 and len(set(it.captions)) == len(it.captions)
            assert Image.open(it.after).size == SIZE
        for it in total[1::2]:
            assert it.change_type == "distractor" and it.alt_before is None
            assert it.captions[0] in data.NO_CHANGE and it.after.endswith(f"CLEVR_nonsemantic_{it.id[:6]}.png")
        seen += sem
    assert {it.change_type for it in seen} == set(data.CHANGES)  # 20 uniform draws of 5 types, seed 0


def test_synth_deterministic(synth, tmp_path):
    again = data.make_synth(tmp_path / "again", pairs=20, seed=0, size=SIZE, workers=1)  # other worker split
    other = data.make_synth(tmp_path / "other", pairs=3, seed=1, size=SIZE, workers=1)
    for f in ("change_captions.json", "splits.json", "type_mapping.json"):
        assert (again / f).read_text() == (synth / f).read_text()
    name = "sc_images/CLEVR_semantic_000002.png"
    assert np.array_equal(np.asarray(Image.open(again / name)), np.asarray(Image.open(synth / name)))
    assert not np.array_equal(np.asarray(Image.open(other / name)), np.asarray(Image.open(synth / name)))


def test_synth_changes_are_what_the_type_says():
    for kind in data.CHANGES:
        for s in range(10):
            rng = random.Random(s)
            before, after, k = data.make_scene(rng, kind)
            assert 3 <= len(before) <= 7 and 3 <= len(after) <= 7
            if kind in ("add", "drop"):
                assert len(after) == len(before) + (1 if kind == "add" else -1)
                kept = after[:-1] if kind == "add" else before[:k] + before[k + 1:]
                assert kept == (before if kind == "add" else after)
                continue
            changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
            assert changed == [k]
            diff = {key for key in before[k] if before[k][key] != after[k][key]}
            assert diff == ({"x", "y"} if kind == "move" else {kind})


def resolve(phrase, scene):
    """Objects a referring expression can mean (our own grammar, parsed back)."""
    for rel, holds in data.RELATIONS.items():
        for that in ("that was ", "that is ", ""):
            head, sep, tail = phrase.partition(f" {that}{rel} the ")
            if sep and " the " not in tail:
                refs = resolve(tail, scene)
                assert len(refs) == 1, tail
                return [o for o in resolve(head, scene) if holds(o, refs[0])]
    words = set(phrase.split())
    syn = {w: k for k, ws in data.SAY.items() for w in ws}
    wanted = {syn.get(w, w) for w in words} - {"thing"}
    return [o for o in scene if wanted <= {o[a] for a in data.ATTRS}]


def test_referring_expressions_pick_out_one_visible_object():
    for s in range(300):
        rng = random.Random(s)
        kind = data.CHANGES[s % 5]
        before, after, k = data.make_scene(rng, kind)
        scene, o = (after, after[k]) if kind == "add" else (before, before[k])
        phrase = data.refer(rng, o, scene, relate=0.5)
        assert resolve(phrase, scene) == [o], (phrase, scene)


def test_captions_name_the_change():
    rng = random.Random(0)
    before, after, k = data.make_scene(rng, "color")
    caps = data.captions(rng, "color", before, after, k)
    assert len(caps) == 6
    new = set(data.SAY.get(after[k]["color"], (after[k]["color"],)))
    assert all("color" in c or set(c.split()) & new for c in caps)


def test_resolve_root_falls_back_to_synthetic_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    root = data.resolve_root("clevr", synth_pairs=5, synth_size=(48, 32), workers=1)
    out = capsys.readouterr().out
    assert root == Path(data.SYNTH_ROOT) and "SYNTHETIC" in out and "README 'Data'" in out
    assert len(data.load_items("clevr", root, "train", "semantic")) == 5 - 1 - 1
    stamp = (root / "splits.json").stat().st_mtime_ns
    assert data.resolve_root("clevr", synth_pairs=5, synth_size=(48, 32)) == root
    assert (root / "splits.json").stat().st_mtime_ns == stamp  # cached, not rendered again
    assert data.resolve_root("spot") == Path("data/spot_the_diff")
    assert data.resolve_root("clevr", root="elsewhere") == Path("elsewhere")


# -----------------------------------------------------------------------------
# real annotation files with placeholder images


@pytest.mark.skipif(not (SHARED / "data" / "spot_the_diff").is_dir(), reason="needs ../shared/data")
def test_spot_the_diff_real_annotations(tmp_path):
    root = tmp_path / "spot"
    shutil.copytree(SHARED / "data" / "spot_the_diff", root / "annotations")
    ids = {str(d["img_id"]) for d in json.loads((root / "annotations" / "test.json").read_text())}
    placeholders([root / "resized_images" / f"{i}{s}.png" for i in ids for s in ("", "_2")])
    items = data.load_items("spot", root, "test")
    assert len(items) == 1270 and sum(len(it.captions) for it in items) == 2107
    assert all(it.change_type is None and it.after.endswith(f"{it.id}_2.png") for it in items)
    with pytest.raises(SystemExit, match=r"image\(s\) of spot val missing, first .*resized_images.*README 'Data'"):
        data.load_items("spot", root, "val")  # placeholders only for test
    (root / "annotations" / "val.json").unlink()
    with pytest.raises(SystemExit, match=r"missing .*val\.json.*README 'Data'"):
        data.load_items("spot", root, "val")


@pytest.mark.skipif(not (SHARED / "data" / "image_editing_request").is_dir(), reason="needs ../shared/data")
def test_image_editing_request_real_annotations(tmp_path):
    root = tmp_path / "ier"
    shutil.copytree(SHARED / "data" / "image_editing_request", root)
    for split in ("test", "valid"):
        d = json.loads((root / f"{split}.json").read_text())
        placeholders([root / "images" / x[k] for x in d for k in ("img0", "img1")])
    test, val = data.load_items("ier", root, "test"), data.load_items("ier", root, "val")
    assert (len(test), sum(len(it.captions) for it in test)) == (495, 1485)
    assert len(val) == 383 and all(len(it.captions) == 3 for it in val)
    assert test[0].id == "Reddit_1052" and test[0].before.endswith("Reddit.com_4wfxf2_4wfxf2.jpg")


@pytest.mark.skipif(not (SHARED / "data" / "clevr_change").is_dir(), reason="needs ../shared/data")
def test_clevr_change_real_splits_and_types(tmp_path):
    root = tmp_path / "clevr"
    root.mkdir()
    for f in ("splits.json", "type_mapping.json"):
        shutil.copy(SHARED / "data" / "clevr_change" / f, root)
    val = json.loads((root / "splits.json").read_text())["val"]
    caps = {f"CLEVR_default_{i:06d}.png": ["a caption"] for i in val}
    for f in ("change_captions.json", "no_change_captions.json"):
        (root / f).write_text(json.dumps(caps))
    placeholders([root / d / f"CLEVR_{n}_{i:06d}.png" for i in val for d, n in
                  (("images", "default"), ("sc_images", "semantic"), ("nsc_images", "nonsemantic"))])
    items = data.load_items("clevr", root, "val", "total")
    assert len(items) == 2 * 1988
    counts = {t: sum(it.change_type == t for it in items) for t in data.CHANGES + ("distractor",)}
    assert sum(counts.values()) == len(items) and counts["distractor"] == 1988 and min(counts.values()) > 300


# -----------------------------------------------------------------------------
# errors a person can act on


def test_errors_name_the_path(synth, tmp_path):
    with pytest.raises(SystemExit, match=r"no clevr dataset at .*nowhere.*README 'Data'"):
        data.load_items("clevr", tmp_path / "nowhere", "train")
    broken = tmp_path / "broken"
    shutil.copytree(synth, broken)
    (broken / "type_mapping.json").unlink()
    with pytest.raises(SystemExit, match=r"lacks type_mapping\.json.*README 'Data'"):
        data.load_items("clevr", broken, "train")
    shutil.copy(synth / "type_mapping.json", broken)
    victim = data.load_items("clevr", broken, "train", "semantic")[0]
    Path(victim.after).unlink()
    with pytest.raises(SystemExit, match=rf"missing, first {re.escape(victim.after)}.*--skip-missing"):
        data.load_items("clevr", broken, "train", "semantic")
    n = len(data.load_items("clevr", synth, "train", "semantic"))
    assert len(data.load_items("clevr", broken, "train", "semantic", skip_missing=True)) == n - 1
    shutil.copy(synth / "sc_images" / Path(victim.after).name, victim.after)
    Path(victim.before).write_bytes(b"not a png")  # present but unreadable: fails when decoded, naming it
    items = data.load_items("clevr", broken, "train", "total")
    with pytest.raises(OSError, match=rf"{re.escape(victim.before)}.*README 'Data'"):
        data.ImageDataset(items, 32)[0]
    assert len(data.load_items("clevr", broken, "train", "total", skip_missing=True)) == len(items) - 2
    with pytest.raises(SystemExit, match="unknown dataset"):
        data.resolve_root("coco")


# -----------------------------------------------------------------------------
# datasets and batching


def test_datasets(synth):
    items = data.load_items("clevr", synth, "train", "semantic")
    ds = data.CaptionDataset(items, size=32, context_length=32)
    assert len(ds) == sum(len(it.captions) for it in items)
    before, after, tokens, i = ds[7]
    assert before.shape == after.shape == (3, 32, 32) and before.dtype == torch.float32
    assert tokens.shape == (32,) and tokens[0] == 49406 and (i, 7) == (ds.samples[7][0], 7)
    assert torch.equal(tokens, tokenize(items[i].captions[ds.samples[7][1] - ds.rows[i][0]], 32)[0])
    assert torch.equal(before, load_image(items[i].before, 32))
    swapped = data.CaptionDataset(items, size=32, swap_prob=1.0)[7][0]
    assert torch.equal(swapped, load_image(items[i].alt_before, 32))
    pairs = data.PairDataset(items, size=32)
    rows = {tuple(pairs.tokens[r].tolist()) for r in pairs.rows[3]}
    assert all(tuple(pairs[(3, s)][2].tolist()) in rows for s in range(10))
    assert len({tuple(pairs[(3, s)][2].tolist()) for s in range(20)}) > 1  # a random caption each time
    b, a, i = data.ImageDataset(items, size=32)[2]
    assert i == 2 and torch.equal(a, load_image(items[2].after, 32))


def test_empty_captions_are_not_trained_on(synth):
    it = data.load_items("clevr", synth, "val", "semantic")[0]
    items = [it._replace(captions=["", "the red cube moved", " "]), it._replace(captions=[""])]
    assert len(data.CaptionDataset(items, 16)) == 1 and len(data.PairDataset(items, 16)) == 1
    assert data.PairDataset(items, 16)[0][3] == 0 and len(data.ImageDataset(items, 16)) == 2


def test_cache_equals_streaming(synth):
    items = data.load_items("clevr", synth, "val", "total")
    cache = data.ImageCache(items, size=48, workers=2)
    assert cache.data.dtype == torch.uint8 and cache.data.shape[1:] == (3, 48, 48)
    streamed, cached = data.ImageDataset(items, 48), data.ImageDataset(items, 48, cache=cache)
    for k in range(len(items)):
        assert all(torch.equal(x, y) for x, y in zip(streamed[k][:2], cached[k][:2]))


def test_loader_reproducible(synth):
    items = data.load_items("clevr", synth, "train", "semantic")
    ds = data.CaptionDataset(items, size=16, swap_prob=0.5)
    batches = lambda loader: [torch.cat([b[0].flatten(1), b[2]], 1) for b in loader]
    a = data.make_loader(ds, 8, shuffle=True, workers=0, seed=3)
    b = data.make_loader(ds, 8, shuffle=True, workers=2, seed=3)  # workers see the same per-sample seeds
    for epoch in (0, 1):
        a.sampler.set_epoch(epoch)
        b.sampler.set_epoch(epoch)
        assert all(torch.equal(x, y) for x, y in zip(batches(a), batches(b)))
    first = [x[3] for x in a]
    a.sampler.set_epoch(0)
    assert not all(torch.equal(x, y) for x, y in zip(first, [x[3] for x in a]))  # a new order each epoch
    assert not b.pin_memory and data.make_loader(ds, 8, device="cuda").pin_memory
    last = data.make_loader(ds, 8, drop_last=True)
    assert len(last) == len(ds) // 8
