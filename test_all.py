"""clip4idc test suite: `pytest test_all.py -rs` (all) or `pytest test_all.py -rs -m "not slow"` (the fast subset;
README "Tests" gives the measured times). Tiny models and data the
tests make themselves (or the real files in ../shared/, skipped cleanly when absent).

Devices: every test but the cuda group runs on the CPU on any machine. Each stage run names `--device cpu` (CPU,
below), and the entry points' bad-flag cases run with CUDA hidden (CUDA_VISIBLE_DEVICES=), where `--device cuda`
is a bad value. The cuda group (`pytest test_all.py -rs -m cuda`, the last section) runs on a GPU machine and skips
in one line per test elsewhere.

Sections follow the modules: shared configs, helpers and fixtures first, then model, clip_load, data, synth,
metrics, adapt, caption, pretrain, plots, train_utils, the paths that span stages, and CUDA. Markers
(pytest.ini): slow (training runs: seconds to a minute each), subprocess (real processes, under a timeout),
cuda (needs a GPU). What the tests build goes to temporary folders or
.pytest_cache, never the user's ~/.cache (caches_out_of_home).

What they prove of the paper path on a CPU, with a small CLIP in OpenAI's archive format and several attention
heads in both towers:
- one method: every preset of each stage builds the same classes, optimizer, schedule and sampler at run time;
- the paper preset is chosen when `ViT-B-32.pt` is in the cache, and both stages run through their `main`;
- the authors' frozen embeddings are bit-identical after adaptation, and every other weight moved no more than
  its learning rate allows;
- the 12 + 0 and no-adaptation ablations run;
- one epoch of each stage under bf16 autocast (`--amp bf16`, the code path CUDA takes) lands within 2 % of fp32's
  loss;
- both stages, as real processes killed (SIGKILL) mid-epoch or halfway through writing a checkpoint, resume to the
  weights and the chosen model of a run never stopped;
- greedy decoding (with and without the cache) and beam search equal plain references written per pair (a
  textbook beam search, exhaustive search), and every bad value of every entry point's flags is one argparse line;
- the paper presets train and score as the authors' code (../shared/reference/authors_clip4idc): BertAdam's updates
  (fp32 to 1e-6, their fp16 bit for bit), their schedules at every step, what trains and decays (their own source,
  read with ast), N + 0 (their module), their retrieval ranks, the stage-2 step and its batches;
- the paper preset's captioner is the authors': built from their code (../shared/reference/authors_clip4idc) and
  saved as their trainer saves it, it gives our load_captioner the same tokens, logits and greedy captions; their
  released layout, written out key by key, evaluates through README's command;
- Hugging Face's CLIP layout gives transformers' own features (1e-5, QuickGELU and GELU), the activation follows the
  weights' origin, and both stages run on a ViT-B/16-named file (16-pixel patches) over a pairs.json of one's own.
On a GPU the cuda group adds: both stages under bf16 autocast (the mini CLIP, and a random ViT-B/32 through the
paper preset), checkpoints written there holding CPU tensors and captioning alike on the CPU, --before/--after,
greedy decoding in fp32, --compile, the step captured as a CUDA graph (--cuda-graphs).
Speed and memory: bench.py, BENCHMARKS.md."""

import argparse
import ast
import contextlib
import copy
import gzip
import importlib.util
import io
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import warnings
import zipfile
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import adapt
import bench
import caption
import clip_load
import data
import evaluate as evaluate_py
import metrics
import model
import model as M
import plots
import pretrain
import synth
import train_utils
from clip_load import load_clip, load_image, preprocess, tokenize
from metrics import bleu, cider_d, cider_d_constant, cider_d_prepare, evaluate, meteor, rouge_l
from model import CLIP, Captioner, CaptionerConfig, CLIPConfig


# -------------------------------------------------------------------------------------------------------------
# shared: paths, tiny configs (one per purpose), helpers and fixtures used across sections

SHARED = Path(__file__).resolve().parent.parent / "shared"  # real annotations, coco-caption's figures, DEV (below)
ASSETS = Path(__file__).resolve().parent / "assets"  # shipped: one real CLEVR pair, 8 triples of CLEVR's renders
REAL = ASSETS / "real_pair"
SIZE = (96, 64)  # synthetic sets render this small: the tests' sets take seconds

# one tiny config per purpose, each with 2 attention heads per tower (heads = width / 64, as OpenAI's) where a
# transformer runs: shape bugs hide behind one head
TINY = M.CLIPConfig(embed_dim=32, image_resolution=32, vision_layers=4, vision_width=128, vision_patch_size=8,
                    context_length=77, vocab_size=49408, transformer_width=128, transformer_heads=2,
                    transformer_layers=2, n_inter=2)  # model.py and clip_load.py: 2 intra + 2 inter blocks
# the paper path's OpenAI-format archive: 1 intra + 3 inter, its output as wide as its text tower (as ViT-B/32's), so
# that the authors' captioner reads it
MH = M.CLIPConfig(**{**TINY.__dict__, "n_inter": 3, "embed_dim": 128})
CPU = ["--device", "cpu"]  # every stage run by a test names its device: on a CUDA machine the CPU tests stay on the CPU


def preset_settings(stage, preset, *argv, **resolved):
    """A stage's (adapt, caption) settings under `preset` and the flags `argv`, as its settings() merges them, with
    what a CLIP file, the data and the device would decide given in `resolved`: no file read."""
    p = stage.parser()
    flags, given = p.parse_args([*argv]), train_utils.given_flags(p, [*argv])
    return train_utils.Settings(**{**train_utils.over_preset(flags, given, stage.PRESETS, preset, p.error), **resolved})

TINY_ADAPT = [*CPU, "--preset", "scratch", "--image-size", "32", "--patch-size", "16", "--vision-width", "128",
              "--vision-layers", "2", "--n-inter", "1", "--text-width", "128", "--text-layers", "1",
              "--embed-dim", "128", "--batch-size", "8", "--eval-batch-size", "16", "--log-every", "1"]  # from scratch
# adapt.py on a CLIP archive: one quick epoch
FAST = [*CPU, "--epochs", "1", "--batch-size", "8", "--eval-batch-size", "16", "--workers", "0", "--log-every", "1"]
TINY_PRETRAIN = [*CPU, "--scenes", "30", "--image-size", "32", "--patch-size", "16", "--vision-width", "128",
                 "--vision-layers", "2", "--text-width", "64", "--text-layers", "1", "--embed-dim", "32",
                 "--batch-size", "16", "--samples", "960", "--eval-every", "20", "--eval-images", "20", "--lr", "1e-3",
                 "--object-loss", "0", "--workers", "1", "--log-every", "5"]  # pretrain.py: 2 heads in the image tower
CHANGES = {  # scene -> (change type, change caption); scene 0 is the real render pair when ../shared is there
    0: ("drop", "the large gray sphere made of rubber is missing"),
    1: ("color", "the small red cube changed to blue"),
    2: ("move", "the green cylinder has moved"),
    3: ("add", "a purple metal sphere has been added"),
}
SAME = "nothing has changed"  # tiny_clevr's distractor caption


# the test-side tools of clip_load: OpenAI's archive format written, token ids read back

def to_fp16(module):
    """Round a CLIP's weights as the released archive holds them, approximately: matrices, embeddings, the
    attention and MLP biases and the [CLS] embedding in fp16; LayerNorms and the other vectors in fp32."""
    for name, p in module.named_parameters():
        if p.ndim >= 2 or name.endswith(("in_proj_bias", "class_embedding")) or ".mlp." in name or "out_proj" in name:
            p.data = p.data.half()
    return module


def save_archive(model, path):
    """Write a CLIP (model.py) as OpenAI's ViT-B-32.pt is written: a TorchScript archive of the fp16 model, traced
    on encode_image and encode_text, without CLIP4IDC's pair parameters (the release has none). For tests and
    benchmarks: a random-weight ViT-B/32 saved so goes through the same loading code as the released file.
    Returns the model, pair parameters included, with its fp16-rounded weights back in fp32."""
    model, vis = to_fp16(model.eval()), model.visual
    pair = {name: getattr(vis, name) for name in dict.fromkeys(k.split(".")[1] for k in M.PAIR_KEYS)}  # e1, e2, p, ...
    for name in pair:
        delattr(vis, name)
    try:
        res, ctx = model.cfg.image_resolution, model.cfg.context_length
        text = torch.zeros(1, ctx, dtype=torch.long)
        text[0, :3] = torch.tensor([clip_load.SOT, 320, clip_load.EOT])
        traced = torch.jit.trace_module(model, {"encode_image": torch.zeros(1, 3, res, res, dtype=torch.half),
                                                "encode_text": text}, check_trace=False)
        torch.jit.save(traced, str(path))
    finally:
        for name, value in pair.items():
            setattr(vis, name, value)
    return model.float()


def decode(ids):
    """Token ids (list or 1-D tensor) -> text; stops at EOT (padding follows it), skips SOT. Id 0 is "!"."""
    decoder = {i: t for t, i in clip_load.vocab()[0].items()}
    byte_decoder = {c: b for b, c in clip_load.bytes_to_unicode().items()}
    pieces = []
    for i in (ids.tolist() if torch.is_tensor(ids) else ids):
        if i == clip_load.EOT:
            break
        if i == clip_load.SOT:
            continue
        pieces.append(decoder[i])
    text = bytearray(byte_decoder[c] for c in "".join(pieces)).decode("utf-8", errors="replace")
    return text.replace("</w>", " ").strip()



def assert_close(a, b, atol=1e-5):
    diff = (a - b).abs()
    assert diff.max() <= atol, f"max |diff| {diff.max():.3g}, mean {diff.mean():.3g}"


def tiny_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(3, 3, 32, 32, generator=g)
    text = tokenize(["a red cube", "the small red metal cube changed to blue", ""])
    return images, text


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


@pytest.fixture(scope="session", autouse=True)
def caches_out_of_home(tmp_path_factory, pytestconfig):
    """What the tests build never goes to the user's ~/.cache: decoded-image caches of their throwaway sets go to
    a temporary folder, and METEOR's paraphrase index of the installed table (20 s to build) to pytest's own cache
    folder (.pytest_cache), kept between runs. Environment variables, so they reach the stages run as subprocesses
    too."""
    old = {k: os.environ.get(k) for k in ("CLIP4IDC_IMAGE_CACHE", "XDG_CACHE_HOME")}
    os.environ["CLIP4IDC_IMAGE_CACHE"] = str(tmp_path_factory.mktemp("image_cache"))
    os.environ["XDG_CACHE_HOME"] = str(pytestconfig.cache.mkdir("clip4idc_xdg"))
    yield
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.update({k: v})


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine two threads run them ~10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def synth_set(tmp_path_factory):
    return synth.make_synth(tmp_path_factory.mktemp("synth") / "clevr", pairs=20, seed=0, size=SIZE, workers=2)


@pytest.fixture(scope="module")
def adapt_synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapt_synth")
    synth.make_synth(root, 24, seed=0, size=(120, 80), workers=1)
    return root


def openai_module(name="model"):
    """OpenAI's own clip/model.py or clip/simple_tokenizer.py (the openai-clip package, installed with --no-deps),
    the reference of the parity tests, loaded by path so that clip/__init__.py (which imports torchvision) never
    runs; None when it is absent."""
    spec = importlib.util.find_spec("clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], f"{name}.py")
    if not os.path.isfile(path):
        return None
    mod_spec = importlib.util.spec_from_file_location(f"openai_clip_{name}", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def write_archive(module, path, images, text):
    """A TorchScript archive with fp16 weights, as OpenAI's ViT-B-32.pt is written."""
    traced = torch.jit.trace_module(module.eval(), {"encode_image": images.half(), "encode_text": text},
                                    check_trace=False)
    torch.jit.save(traced, str(path))
    return module.float()  # the same fp16-rounded weights, run in fp32: the "original module"


@pytest.fixture(scope="module")
def openai_archive(tmp_path_factory):
    path = tmp_path_factory.mktemp("clip_cache") / "ViT-B-32.pt"
    torch.manual_seed(0)
    save_archive(M.CLIP(MH), path)
    return path


def as_cached_release(monkeypatch, archive):
    """`archive` becomes ~/.cache/clip/ViT-B-32.pt, its SHA256 standing in for the release's."""
    monkeypatch.setattr(clip_load, "CACHE", archive.parent)
    url = f"https://example.invalid/{clip_load.sha256(archive)}/ViT-B-32.pt"
    monkeypatch.setitem(clip_load.MODELS, "ViT-B/32", url)


def max_change(a, b, keys):
    return {k: (a[k].float() - b[k].float()).abs().max().item() for k in keys}


def tiny_clevr(root):
    """A CLEVR-Change-format dataset of 4 scenes, the same in train, val and test: memorization is the point."""
    rng = np.random.default_rng(0)
    for d in ("images", "sc_images", "nsc_images"):
        (root / d).mkdir(parents=True)
    for i in CHANGES:
        if i == 0:
            before, after = Image.open(REAL / "CLEVR_new_000000.png"), Image.open(REAL / "CLEVR_new_000000_del.png")
        else:
            before, after = (Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)) for _ in range(2))
        before.save(root / "images" / f"CLEVR_default_{i:06d}.png")
        after.save(root / "sc_images" / f"CLEVR_semantic_{i:06d}.png")
        # the distractor: the same scene seen from elsewhere (mirrored) and lit differently
        moved = np.asarray(before.convert("RGB"))[:, ::-1].astype(int) + rng.integers(-25, 25, (1, 1, 3))
        Image.fromarray(np.clip(moved, 0, 255).astype(np.uint8)).save(
            root / "nsc_images" / f"CLEVR_nonsemantic_{i:06d}.png")
    key = "CLEVR_default_{:06d}.png".format
    (root / "change_captions.json").write_text(json.dumps({key(i): [c] for i, (_, c) in CHANGES.items()}))
    (root / "no_change_captions.json").write_text(json.dumps({key(i): [SAME] for i in CHANGES}))
    splits = {"train": list(CHANGES) * 4, "val": list(CHANGES), "test": list(CHANGES)}  # 4 passes per epoch
    (root / "splits.json").write_text(json.dumps(splits))
    types = {}
    for i, (t, _) in CHANGES.items():
        types.setdefault(t, []).append(f"{i:06d}.png")
    (root / "type_mapping.json").write_text(json.dumps(types))


def tiny_encoder(path, root):
    """An adapt.py-style checkpoint of a tiny random CLIP (2 vision blocks, the last one inter; 2 heads), its tokens
    as wide as its words, as the captioner needs."""
    torch.manual_seed(0)
    cfg = CLIPConfig(embed_dim=128, image_resolution=32, vision_layers=2, vision_width=128, vision_patch_size=8,
                     context_length=77, vocab_size=49408, transformer_width=128, transformer_heads=2,
                     transformer_layers=1, n_inter=1)  # 2 heads in each tower
    torch.save({"model": CLIP(cfg).state_dict(), "config": asdict(cfg), "stage": "adapt",
                "data": {"name": "clevr", "root": str(root), "image_size": 32}}, path)


def run(tmp, *extra, epochs):
    return caption.main([*CPU, "--ckpt", str(tmp / "adapted.pt"), "--out", str(tmp / "captioner.pt"), "--results",
                         str(tmp / "captions.json"), "--preset", "mini", "--heads", "2",
                         "--enc-layers", "1", "--dec-layers", "1", "--epochs", str(epochs), "--batch-size", "2",
                         "--lr", "2e-3", "--patience", "100", "--workers", "0", "--log-every", "1000", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    tmp = tmp_path_factory.mktemp("caption")
    tiny_clevr(tmp / "clevr")
    tiny_encoder(tmp / "adapted.pt", tmp / "clevr")
    results = run(tmp, "--dropout", "0", epochs=40)
    return tmp, results


def ctrl_c_in_second_epoch(monkeypatch, stage):
    """Make `stage` (adapt or caption) see a Ctrl-C when its second epoch starts; returns the real train_epoch."""
    real_epoch = train_utils.train_epoch

    def interrupt(*a, **k):
        if a[5].epoch == 1:  # the Progress argument's epoch
            raise KeyboardInterrupt
        return real_epoch(*a, **k)
    monkeypatch.setattr(stage, "train_epoch", interrupt)
    return real_epoch


KILLABLE = """
import io, os, signal, sys
import torch
at, real, calls = int(os.environ["KILL_AT_SAVE"]), torch.save, [0]

def save(obj, f, *args, **kwargs):  # SIGKILL halfway through writing the at-th checkpoint
    calls[0] += 1
    if calls[0] == at:
        buf = io.BytesIO()
        real(obj, buf)
        with open(f, "wb") as out:
            out.write(buf.getvalue()[:buf.tell() // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return real(obj, f, *args, **kwargs)

torch.save = save
torch.set_num_threads(1)
__import__(sys.argv[1]).main(sys.argv[2:])
"""


def run_killable(stage, argv, kill_at_line=None, kill_at_save=0, timeout=300):
    """`stage`.main(argv) as a real process, SIGKILLed at the third line of its output that holds `kill_at_line`
    or halfway through writing its `kill_at_save`-th checkpoint -> (return code, -9 when killed; its output)."""
    p = subprocess.Popen([sys.executable, "-c", KILLABLE, stage, *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).resolve().parent,
                         env={**os.environ, "KILL_AT_SAVE": str(kill_at_save)})
    watchdog = threading.Timer(timeout, p.kill)  # a hang fails the test below instead of stalling the suite
    watchdog.start()
    try:
        out, seen = [], 0
        for line in p.stdout:
            out.append(line)
            seen += bool(kill_at_line) and kill_at_line in line
            if seen == 3:
                p.kill()
        rc = p.wait()
    finally:
        watchdog.cancel()
        p.kill()
    assert watchdog.is_alive() or rc == -9 and (kill_at_line or kill_at_save), "".join(out)[-3000:]
    return rc, "".join(out)


# -------------------------------------------------------------------------------------------------------------
# model.py: CLIP parity with OpenAI's code, the pair encoder (eq. 2-5), attention paths

@pytest.mark.parametrize("vision_width,text_width,text_heads", [(64, 64, 1), (192, 128, 2)])
def test_openai_archive_matches_openai_code(tmp_path, vision_width, text_width, text_heads):
    """OpenAI's code and ours on the same archive, with one head per tower and with several (3 vision heads,
    2 text heads): a bug in splitting heads shows only in the second."""
    ref = openai_module("model")
    if ref is None:
        pytest.skip("openai-clip not installed (pip install --no-deps openai-clip==1.0.1)")
    torch.manual_seed(0)
    original = ref.CLIP(embed_dim=32, image_resolution=32, vision_layers=4, vision_width=vision_width,
                        vision_patch_size=8, context_length=77, vocab_size=49408, transformer_width=text_width,
                        transformer_heads=text_heads, transformer_layers=2)
    images, text = tiny_inputs()
    ref.convert_weights(original)  # OpenAI's own fp16 conversion
    original = write_archive(original, tmp_path / "ViT-tiny.pt", images, text).eval()
    ours = load_clip(tmp_path / "ViT-tiny.pt")
    assert ours.cfg.vision_layers == 4 and ours.cfg.image_resolution == 32 and ours.cfg.embed_dim == 32
    assert ours.visual.transformer.resblocks[0].attn.heads == vision_width // 64
    assert ours.transformer.resblocks[0].attn.heads == text_heads
    with torch.no_grad():
        assert_close(ours.encode_image(images), original.encode_image(images))
        assert_close(ours.encode_text(text), original.encode_text(text))
        a, b = ours(images, text), original(images, text)
        assert_close(a[0], b[0], atol=1e-4)


def test_patches_equal_the_convolution():
    """The patch embedding is conv1 computed as a matmul: equal to the convolution, also on a non-square input
    whose sides are not multiples of the patch size (the convolution drops the remainder)."""
    torch.manual_seed(0)
    vis = M.CLIP(TINY).visual
    x = torch.randn(2, 3, 37, 53)
    want = vis.conv1(x).flatten(2).transpose(1, 2)  # (B, 4 * 6, width)
    assert vis.patches(x).shape == want.shape == (2, 24, 128)
    assert_close(vis.patches(x), want)


def test_pair_encoder_without_inter_blocks_is_clip_then_the_pair_parameters():
    """N + 0 (Table 7's 12 + 0), as the authors' module: every block sees each image alone (plain CLIP), then e1, e2,
    p and ln_mid are added before ln_post, as at N + k (test_12_plus_0_is_the_authors_module checks it against theirs)."""
    torch.manual_seed(0)
    model = M.CLIP(M.CLIPConfig(**{**TINY.__dict__, "n_inter": 0})).eval()
    images, _ = tiny_inputs()
    before, after = images, images.roll(1, 0)
    vis = model.visual
    with torch.no_grad():
        tokens, v = model.encode_pair(before, after)
        n1 = tokens.shape[1] // 2
        assert tokens.shape == (3, 2 * 17, 32)  # (32/8)^2 patches + [CLS], two images
        x = torch.cat([vis.transformer(vis.stem(before)) + vis.bef_embedding,
                       vis.transformer(vis.stem(after)) + vis.aft_embedding], 1)
        want = vis.ln_post(vis.ln_mid(x + vis.joint_positional_embedding)) @ vis.proj
        assert_close(tokens, want)
        assert_close(v, (want[:, 0] + want[:, n1]) / 2)
        assert (tokens[:, 0] - model.encode_image(before)).abs().max() > 1e-2  # not CLIP's own features


def pair_reference(visual, before, after):
    """Eq. (2)-(5) written out again, apart from model.py: OpenAI's stem (a convolution, [CLS], positional
    embedding, ln_pre), the intra blocks on each image alone, e1/e2 added to each image's tokens and p to the
    joint sequence, ln_mid, the inter blocks, ln_post and proj on every token, v = the mean of the two [CLS]."""
    def stem(x):
        x = visual.conv1(x).flatten(2).transpose(1, 2)
        x = torch.cat([visual.class_embedding.expand(len(x), 1, -1), x], dim=1) + visual.positional_embedding
        return visual.ln_pre(x)
    blocks = list(visual.transformer.resblocks)
    n_intra = len(blocks) - visual.n_inter
    b, a = stem(before), stem(after)
    for block in blocks[:n_intra]:  # eq. (2)
        b, a = block(b), block(a)
    x = torch.cat([b + visual.bef_embedding, a + visual.aft_embedding], dim=1)  # eq. (3)
    x = visual.ln_mid(x + visual.joint_positional_embedding)  # eq. (4)
    for block in blocks[n_intra:]:
        x = block(x)
    tokens = visual.ln_post(x) @ visual.proj
    return tokens, (tokens[:, 0] + tokens[:, b.shape[1]]) / 2  # eq. (5)


def test_pair_encoder_is_eq_2_to_5_and_order_matters():
    torch.manual_seed(0)
    model = M.CLIP(TINY).eval()  # 2 intra + 2 inter blocks, 2 heads
    with torch.no_grad():  # trained-looking pair parameters: e1, e2, p, ln_mid away from their initial values
        for name in ("bef_embedding", "aft_embedding", "joint_positional_embedding", "ln_mid.weight", "ln_mid.bias"):
            model.visual.get_parameter(name).add_(torch.randn_like(model.visual.get_parameter(name)))
    images, _ = tiny_inputs()
    with torch.no_grad():
        t1, v1 = model.encode_pair(images, images.roll(1, 0))
        t2, v2 = model.encode_pair(images.roll(1, 0), images)
        ref_t, ref_v = pair_reference(model.visual, images, images.roll(1, 0))
    assert t1.shape == (3, 34, 32) and v1.shape == (3, 32)
    assert_close(t1, ref_t)
    assert_close(v1, ref_v)
    assert (v1 - v2).abs().max() > 1e-3  # e1 != e2 and p: the encoder knows which image came first
    assert (t1[:, :17] - t2[:, 17:]).abs().max() > 1e-3


def test_sdpa_and_plain_attention_agree():
    torch.manual_seed(0)
    model = M.CLIP(TINY).eval()
    images, text = tiny_inputs()
    with torch.no_grad():
        a = model.encode_pair(images, images.flip(0)).tokens, model.encode_text(text)
        M.USE_SDPA = False
        try:
            b = model.encode_pair(images, images.flip(0)).tokens, model.encode_text(text)
        finally:
            M.USE_SDPA = True
    assert_close(a[0], b[0])
    assert_close(a[1], b[1])


def test_attention_weights_are_the_sdpa_paths():
    """The weights drawn as heat maps are softmax(Q K^T / sqrt(d)) of the very inputs the SDPA path attends with:
    applied to V they give its output (several heads, a non-square pair of token counts)."""
    torch.manual_seed(0)
    attn = model.MultiheadAttention(96, 3)
    x = torch.randn(2, 20, 96)
    w = plots.attention_weights(attn, x)
    assert w.shape == (2, 3, 20, 20) and torch.allclose(w.sum(-1), torch.ones(2, 3, 20))
    q, k, v = (t.view(2, 20, 3, 32).transpose(1, 2) for t in F.linear(x, attn.in_proj_weight,
                                                                        attn.in_proj_bias).split(96, dim=2))
    torch.testing.assert_close(w @ v, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    cfg = M.CLIPConfig(embed_dim=32, image_resolution=48, vision_layers=3, vision_width=128, vision_patch_size=16,
                       context_length=8, transformer_width=64, transformer_heads=1, transformer_layers=1, n_inter=2)
    clip = M.CLIP(cfg).eval()
    b, a = torch.randn(2, 3, 48, 48), torch.randn(2, 3, 48, 48)
    blocks, vis = clip.visual.transformer.resblocks, clip.visual
    with torch.no_grad():
        weights = plots.inter_attention(vis, b, a)
        x = blocks[0](vis.stem(torch.cat([b, a])))  # eq. (2)-(4) written out: 1 intra block, then the joint sequence
        x = torch.cat([x[:2], x[2:]], dim=1)
        x = vis.ln_mid(x + torch.cat([vis.bef_embedding.expand(10, -1), vis.aft_embedding.expand(10, -1)])
                       + vis.joint_positional_embedding)
        first = plots.attention_weights(blocks[1].attn, blocks[1].ln_1(x))
        last = plots.attention_weights(blocks[2].attn, blocks[2].ln_1(blocks[1](x)))
    assert weights.shape == (2, 2, 20, 20)
    torch.testing.assert_close(weights, last)  # the last inter block's, not the first's
    assert (weights - first).abs().max() > 1e-3


def test_bf16_autocast_runs():
    model = M.CLIP(TINY).eval()
    images, text = tiny_inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        tokens, v = model.encode_pair(images, images)
        t = model.encode_text(text)
    assert torch.isfinite(tokens.float()).all() and torch.isfinite(t.float()).all()
    assert_close(v.float(), model.encode_pair(images, images).vector.detach(), atol=0.1)


def new_captioner(**sizes):
    """The authors' captioner on random word and position embeddings of its width, standing for the CLIP's it ties
    in."""
    words = SimpleNamespace(token_embedding=torch.nn.Embedding(sizes["vocab_size"], sizes["width"]),
                            positional_embedding=torch.nn.Parameter(0.01 * torch.randn(77, sizes["width"])))
    return M.Captioner(M.CaptionerConfig(**sizes), words)


def test_the_authors_captioner_refuses_fewer_encoder_than_decoder_layers():
    """Their decoder layer i reads their encoder layer i (module_decoder.py 365-367): 2 + 3 cannot be built."""
    with pytest.raises(ValueError, match="decoder layer i reads encoder layer i"):
        new_captioner(vocab_size=20, memory_len=4, width=32, heads=4, enc_layers=2, dec_layers=3)


def test_kv_cache_equals_no_kv_cache():
    torch.manual_seed(0)
    cap = new_captioner(vocab_size=50, memory_len=10, width=64, heads=4, enc_layers=2, dec_layers=2,
                        max_len=12).eval()
    memory = torch.randn(16, 10, 64)
    cached, full = M.generate(cap, memory, 1, 2, use_kv_cache=True), M.generate(cap, memory, 1, 2, use_kv_cache=False)
    assert torch.equal(cached, full)
    # the cached step's logits are the full prefix's last-position logits
    kv_caches, mem = [{} for _ in cap.decoder], cap.encode(memory)
    steps = [cap.decode(full[:, t - 1:t] if t else torch.ones(16, 1, dtype=torch.long), mem, kv_caches, start=t)[:, -1]
             for t in range(5)]
    prefix = torch.cat([torch.ones(16, 1, dtype=torch.long), full[:, :4]], dim=1)
    torch.testing.assert_close(torch.stack(steps, 1), cap.decode(prefix, mem), atol=1e-5, rtol=1e-5)
    try:  # the plain softmax attention path decodes the same
        model.USE_SDPA = False
        assert torch.equal(M.generate(cap, memory, 1, 2), cached)
    finally:
        model.USE_SDPA = True
    assert torch.equal(M.beam_search(cap, memory, 1, 2, beam=1), cached)  # a beam of one is greedy
    assert M.beam_search(cap, memory, 1, 2, beam=3).shape[0] == 16
    # several new positions after a cached prefix (queries aligned at the end of the keys), in both attention paths
    for sdpa in (True, False):
        model.USE_SDPA = sdpa
        try:
            kv_caches = [{} for _ in cap.decoder]
            head = cap.decode(prefix[:, :2], mem, kv_caches)
            tail = cap.decode(prefix[:, 2:], mem, kv_caches, start=2)  # 3 positions at once, after 2 cached ones
            torch.testing.assert_close(torch.cat([head, tail], 1), cap.decode(prefix, mem), atol=1e-5, rtol=1e-5)
        finally:
            model.USE_SDPA = True


# Decoding, checked against plain references on a captioner whose every input matters: a 6-word vocabulary (pad 0,
# <bos> 1, <eos> 2: <eos> is often the argmax, so captions end at different steps), positional embeddings at std 1
# (a position read wrong changes the argmax), several heads, a memory of its own per pair. Any word may come at any
# step, pad and <bos> too: the references allow the same.
BOS, EOS = 1, 2


def sharp_captioner(seed=0, vocab=6, max_len=5):
    torch.manual_seed(seed)
    cap = new_captioner(vocab_size=vocab, memory_len=6, width=32, heads=4, enc_layers=2, dec_layers=2,
                        max_len=max_len, dropout=0.0).eval()
    with torch.no_grad():  # unit-gain matrices; word embeddings small beside the positions (tied to the output,
        for name, p in cap.named_parameters():  # large ones would make every caption repeat its first word)
            if name == "positional_embedding":
                p.normal_(0, 1)
            elif name == "token_embedding.weight":
                p.normal_(0, 0.3)
            elif p.ndim == 2:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
    return cap, torch.randn(12, 6, 32)


@torch.no_grad()
def step_logp(cap, memory, prefix):
    """log p(next token | prefix) for one pair, the decoder run on the whole prefix: no cache, no batch."""
    logits = cap.decode(torch.tensor([[BOS] + prefix], device=memory.device), cap.encode(memory[None]))[0, -1]
    return logits.float().log_softmax(-1)


def greedy_reference(cap, memory):
    prefix = []
    while len(prefix) < cap.cfg.max_len and (not prefix or prefix[-1] != EOS):
        prefix.append(int(step_logp(cap, memory, prefix).argmax()))
    return prefix


def beam_reference(cap, memory, k):
    """Beam search as written in a textbook, one pair at a time: keep the k best prefixes by summed log-probability
    (a finished one stays, at no cost), stop when all k are finished or at max_len, pick the best by
    log-probability per token (<eos> counted). Ties broken by the order of the candidates, as topk does."""
    beams = [([], 0.0)]
    for _ in range(cap.cfg.max_len):
        candidates = []
        for prefix, score in beams:
            if prefix and prefix[-1] == EOS:
                candidates.append((prefix, score))  # finished: carried over unchanged
                continue
            logp = step_logp(cap, memory, prefix)
            candidates += [(prefix + [w], score + float(logp[w])) for w in range(len(logp))]
        beams = sorted(candidates, key=lambda c: -c[1])[:k]
        if all(p[-1] == EOS for p, _ in beams):
            break
    return max(beams, key=lambda c: c[1] / len(c[0]))


def exhaustive_best(cap, memory):
    """Every caption the captioner can write (each word at each step, up to <eos> or max_len), the best by
    log-probability per token: what beam search returns when its beam holds them all."""
    best, stack = None, [([], 0.0)]
    while stack:
        prefix, score = stack.pop()
        if prefix and (prefix[-1] == EOS or len(prefix) == cap.cfg.max_len):
            if best is None or score / len(prefix) > best[1] / len(best[0]):
                best = (prefix, score)
            continue
        logp = step_logp(cap, memory, prefix)
        stack += [(prefix + [w], score + float(logp[w])) for w in range(len(logp))]
    return best


def padded(captions, width):
    return torch.tensor([c + [0] * (width - len(c)) for c in captions])


def test_greedy_decoding_equals_the_plain_loop():
    """generate(), with the key/value cache and without, through its public call, equals greedy decoding written
    out per pair on the whole prefix: the same words, <eos> where it comes, padding after. The captions end at
    different steps and differ with the positions (a cache that read the wrong positional embedding, or dropped
    a step, would write other words)."""
    lengths = set()
    for seed in (0, 5, 6):  # models whose greedy captions differ from pair to pair (some seeds give 1-3 captions)
        cap, memory = sharp_captioner(seed)
        want = [greedy_reference(cap, m) for m in memory]
        assert len({tuple(c) for c in want}) > 3  # the check has teeth (and some captions end early: below)
        lengths |= {len(c) for c in want}
        width = max(len(c) for c in want)
        for use_kv_cache in (True, False):
            assert torch.equal(M.generate(cap, memory, BOS, EOS, use_kv_cache=use_kv_cache), padded(want, width))
        assert torch.equal(M.generate(cap, memory, BOS, EOS, max_len=2), padded([c[:2] for c in want], 2))
        ended = [i for i, c in enumerate(want) if c[-1] == EOS]  # all end early: so does decoding, no padding
        if ended:
            width = max(len(want[i]) for i in ended)
            assert torch.equal(M.generate(cap, memory[ended], BOS, EOS), padded([want[i] for i in ended], width))
    assert {1, 5} <= lengths


def test_beam_search_equals_the_textbook_one_and_exhaustive_search():
    """beam_search() (batched, cached, beams reordered by topk at every step) against a plain beam search per pair
    at beams 2-4: the same caption. With a beam that holds every caption the 6-word vocabulary can write in 3
    steps (6^3), it must find the best of them all by log-probability per token (exhaustive search)."""
    differs = 0  # pairs where the beam finds another caption than greedy decoding: the check has teeth
    for seed in (0, 5, 6):  # models whose greedy captions differ from pair to pair (some seeds give 1-3 captions)
        cap, memory = sharp_captioner(seed)
        for k in (2, 3, 4):
            want = [beam_reference(cap, m, k)[0] for m in memory]
            got = M.beam_search(cap, memory, BOS, EOS, beam=k)
            assert torch.equal(got, padded(want, got.shape[1])), (seed, k)
            with pytest.MonkeyPatch.context() as mp:  # what caption.py calls, its start and end ids this vocabulary's
                mp.setattr(clip_load, "SOT", BOS)
                mp.setattr(clip_load, "EOT", EOS)
                assert torch.equal(caption.PairCaptioner(None, cap).caption(k, tokens=memory), got)
            differs += sum(w != greedy_reference(cap, m) for w, m in zip(want, memory))
    assert differs > 5
    cap, memory = sharp_captioner(0, max_len=3)
    best = [exhaustive_best(cap, m) for m in memory]
    assert {1, 3} <= {len(c) for c, _ in best}  # a caption finished at once beats the longer ones, or not
    got = M.beam_search(cap, memory, BOS, EOS, beam=6 ** 3)
    assert torch.equal(got, padded([c for c, _ in best], got.shape[1]))
    per_token = lambda m, c: sum(float(step_logp(cap, m, c[:i])[w]) for i, w in enumerate(c)) / len(c)
    for m, (c, score) in zip(memory, best):
        assert per_token(m, greedy_reference(cap, m)) <= score / len(c) + 1e-6  # greedy is never better


def test_frozen_features_are_the_memory_the_images_give():
    """caption.encode_all (a fixed encoder's tokens, computed once, in fp16) holds what PairCaptioner.memory gives
    from the two images within fp16 rounding, and the captioner reads the same from either (2 heads, a 4x4 grid)."""
    torch.manual_seed(0)
    clip = M.CLIP(M.CLIPConfig(**{**TINY.__dict__, "embed_dim": 128})).eval()
    cap = M.Captioner(M.CaptionerConfig(memory_len=2 * 17, width=128, heads=2, enc_layers=1, dec_layers=1), clip)
    model = caption.PairCaptioner(clip, cap).eval()
    images = torch.randint(0, 256, (2, 3, 3, 32, 32), dtype=torch.uint8)
    batch = {"before": images[0], "after": images[1], "index": torch.arange(3)}
    ctx = SimpleNamespace(amp=contextlib.nullcontext(), device=torch.device("cpu"))
    feats = caption.encode_all(model, [batch], ctx)
    assert feats.dtype == torch.float16 and feats.shape == (3, 34, 128)
    before, after = clip_load.normalize(images[0]), clip_load.normalize(images[1])
    ids = torch.randint(4, 20, (3, 6))
    with torch.no_grad():
        tokens = clip.encode_pair(before, after).tokens
        torch.testing.assert_close(feats.float(), tokens, rtol=1e-3, atol=1e-3)  # fp16's rounding
        assert_close(model(ids, tokens=feats.float()), model(ids, before=before, after=after), atol=5e-2)


# -------------------------------------------------------------------------------------------------------------
# the authors' captioner (model.Captioner's defaults, CLIP's words tied in) and their released checkpoints

AUTHORS = SHARED / "reference" / "authors_clip4idc"  # their code at ca49461 (MIT), for comparison only
# the paper preset's captioner on a small CLIP: 128 wide (2 heads per tower and in the captioner, width / 64 as the
# authors' 8 at 512), a 7 x 7 patch grid (their encode_image reads token 50 as the after image's [CLS]), 1 + 3 blocks
PAPER_CLIP = M.CLIPConfig(embed_dim=128, image_resolution=56, vision_layers=4, vision_width=128, vision_patch_size=8,
                          context_length=77, vocab_size=49408, transformer_width=128, transformer_heads=2,
                          transformer_layers=1, n_inter=3)


def paper_captioner(seed=0, clip_cfg=PAPER_CLIP):
    """A PairCaptioner built as the paper preset builds it (caption.new_model: 3 + 3 post-LN layers, CLIP's words),
    every weight random at a scale where each one matters."""
    torch.manual_seed(seed)
    clip = M.CLIP(clip_cfg)
    grid = clip_cfg.image_resolution // clip_cfg.vision_patch_size
    cfg = CaptionerConfig(vocab_size=clip_cfg.vocab_size, memory_len=2 * (grid ** 2 + 1),
                          width=clip_cfg.transformer_width, heads=clip_cfg.transformer_width // 64)
    pair = caption.PairCaptioner(clip, Captioner(cfg, clip)).eval()
    with torch.no_grad():
        for name, p in pair.named_parameters():
            norm = name.endswith("weight") and (".ln" in name or "ln_" in name or name.startswith("ln_"))
            p.copy_(torch.randn_like(p) * (0.1 if p.ndim < 2 else p.shape[-1] ** -0.5) + norm)
        pair.captioner.head_bias[clip_load.EOT] += 3.0  # captions end, at different steps
    return pair


def authors_layout(pair):
    """A PairCaptioner's weights under the authors' key names, as their trainer saves CLIP4IDC
    (torch.save(model.state_dict()): `clip.*`, and `decoder.*` from module_decoder.py's BERT modules, the tied
    embeddings thrice), written out here literally."""
    sd = {f"clip.{k}": v for k, v in pair.clip.state_dict().items()}
    cap = pair.captioner.state_dict()
    top = {"embeddings.word_embeddings.weight": "token_embedding.weight",
           "embeddings.position_embeddings.weight": "positional_embedding",
           "classifier.cls.predictions.decoder.weight": "token_embedding.weight",
           "embeddings.LayerNorm.weight": "ln_emb.weight", "embeddings.LayerNorm.bias": "ln_emb.bias",
           "classifier.cls.predictions.bias": "head_bias",
           "classifier.cls.predictions.transform.dense.weight": "head.dense.weight",
           "classifier.cls.predictions.transform.dense.bias": "head.dense.bias",
           "classifier.cls.predictions.transform.LayerNorm.weight": "head.ln.weight",
           "classifier.cls.predictions.transform.LayerNorm.bias": "head.ln.bias"}
    sd.update({f"decoder.{k}": cap[v] for k, v in top.items()})
    layer = {"slf_attn.output.dense": "attn.out_proj", "slf_attn.output.LayerNorm": "ln_1",
             "enc_attn.output.dense": "cross_attn.out_proj", "enc_attn.output.LayerNorm": "ln_x",
             "intermediate.dense": "mlp.c_fc", "output.dense": "mlp.c_proj", "output.LayerNorm": "ln_2"}
    for stack in ("encoder", "decoder"):
        for i in range(len(getattr(pair.captioner, stack))):
            for theirs, ours in layer.items():
                if stack == "decoder" or not theirs.startswith("enc_attn"):
                    for w in ("weight", "bias"):
                        sd[f"decoder.{stack}.layer.{i}.{theirs}.{w}"] = cap[f"{stack}.{i}.{ours}.{w}"]
            for theirs, ours in (("slf_attn", "attn"), ("enc_attn", "cross_attn"))[:2 if stack == "decoder" else 1]:
                for w in ("weight", "bias"):
                    key, value = cap[f"{stack}.{i}.{ours}.kv_proj.{w}"].chunk(2)
                    att = f"decoder.{stack}.layer.{i}.{theirs}.att"
                    sd.update({f"{att}.query.{w}": cap[f"{stack}.{i}.{ours}.q_proj.{w}"], f"{att}.key.{w}": key,
                               f"{att}.value.{w}": value})
    return sd


def import_authors(monkeypatch):
    """The authors' code importable (their download helpers' imports stubbed): `from modules.modeling import ...`."""
    for name, attrs in {"tqdm": {"tqdm": None}, "boto3": {}, "botocore": {},
                        "botocore.exceptions": {"ClientError": Exception}, "requests": {}}.items():
        if name not in sys.modules:
            stub = type(sys)(name)
            stub.__dict__.update(attrs)
            monkeypatch.setitem(sys.modules, name, stub)
    monkeypatch.syspath_prepend(str(AUTHORS))


def their_clip4idc(monkeypatch, task_type="caption", clip_cfg=PAPER_CLIP, dropout=0.1):
    """Their CLIP4IDC from their code on a random CLIP of clip_cfg (built directly, since from_pretrained downloads
    ViT-B/32; cast to fp32), our intra/inter split, 3 + 3 captioner layers in stage 2 ("caption")."""
    import_authors(monkeypatch)
    from modules.modeling import CLIP4IDC
    from modules.module_cross import CrossConfig
    from modules.module_decoder import DecoderConfig
    W = clip_cfg.transformer_width
    task = SimpleNamespace(task_type=task_type, intra_num_hidden_layers=clip_cfg.vision_layers - clip_cfg.n_inter,
                           decoder_num_hidden_layers=3, linear_patch="2d", local_rank=0)
    decoder = DecoderConfig(49408, hidden_size=W, num_attention_heads=W // 64, intermediate_size=4 * W,
                            max_target_embeddings=77, num_decoder_layers=3, hidden_dropout_prob=dropout,
                            attention_probs_dropout_prob=dropout)
    return CLIP4IDC(CrossConfig(49408, hidden_size=W, num_attention_heads=2, intermediate_size=4 * W), decoder,
                    M.CLIP(clip_cfg).state_dict(), task).float()


def pair_images(n=5, size=56, seed=1):
    images = torch.randn(n, 2, 3, size, size, generator=torch.Generator().manual_seed(seed))  # normalized already
    return images[:, 0], images[:, 1]


def test_the_authors_layout_loads_key_for_key(tmp_path, capsys, monkeypatch):
    """load_captioner on a file in the authors' layout (their key names and shapes, literally; one leading
    `module.` as a DistributedDataParallel wrapper saves it): every key read, the same logits and greedy captions
    as the model it was written from, CLIP's vocabulary in id order, the tied copies checked."""
    src = paper_captioner()
    sd = authors_layout(src)
    assert sd["decoder.decoder.layer.0.enc_attn.att.query.weight"].shape == (128, 128)
    assert sd["decoder.classifier.cls.predictions.transform.LayerNorm.weight"].shape == (128,)
    assert len([k for k in sd if k.startswith("decoder.")]) == 3 + 7 + 3 * 16 + 3 * 26  # tied, top, 3 + 3 layers
    torch.save({"module." + k: v for k, v in sd.items()}, tmp_path / "pytorch_model.bin.clevr")
    ours = caption.load_captioner(tmp_path / "pytorch_model.bin.clevr")
    assert ours.captioner.cfg.vocab_size == 49408 and clip_load.bpe_tokens()[518] == "the</w>"
    torch.save({k: v for k, v in sd.items() if k.startswith("clip.")}, tmp_path / "pytorch_model.bin.stage1")
    # a file with decoder.* keys is evaluated (evaluate.py), never trained on; clip.* alone is an encoder to train on
    assert caption.read_ckpt_info(tmp_path / "pytorch_model.bin.clevr") == {"stage": "caption", "authors": True}
    assert caption.read_ckpt_info(tmp_path / "pytorch_model.bin.stage1") == {"stage": "adapt", "authors": True}
    with pytest.raises(SystemExit):
        caption.main([*CPU, "--ckpt", str(tmp_path / "pytorch_model.bin.clevr")])
    assert "is a captioner: evaluate it with `python evaluate.py --ckpt" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # no data/clevr_change here: no synthetic set stands in for real data
    with pytest.raises(SystemExit):
        evaluate_py.main([*CPU, "--ckpt", str(tmp_path / "pytorch_model.bin.clevr")])
    assert "--data-root: no clevr dataset at data/clevr_change for the authors' weights" in capsys.readouterr().err
    assert ours.captioner.token_embedding.weight is ours.clip.token_embedding.weight  # tied, not a copy
    before, after = pair_images()
    ids = torch.cat([torch.full((5, 1), clip_load.SOT), torch.randint(1, 49406, (5, 9))], 1)
    with torch.no_grad():
        want = src(ids, before=before, after=after)
        assert_close(ours(ids, before=before, after=after), want)
    assert want.shape == (5, 10, 49408)
    greedy = ours.caption(before=before, after=after)
    assert torch.equal(greedy, src.caption(before=before, after=after))
    b2, a2 = before[:2], after[:2]  # --beam works on it
    assert torch.equal(ours.caption(2, before=b2, after=a2), src.caption(2, before=b2, after=a2))
    sd["decoder.embeddings.position_embeddings.weight"] = sd["decoder.embeddings.position_embeddings.weight"] + 1
    torch.save(sd, tmp_path / "untied.bin")
    with pytest.raises(SystemExit, match="differs from clip.positional_embedding"):
        caption.load_captioner(tmp_path / "untied.bin")
    sd = authors_layout(src)
    sd["decoder.decoder.layer.0.enc_attn.att.querry.weight"] = sd.pop(
        "decoder.decoder.layer.0.enc_attn.att.query.weight")
    torch.save(sd, tmp_path / "odd.bin")
    with pytest.raises(SystemExit, match="does not fit model.Captioner: .*querry"):
        caption.load_captioner(tmp_path / "odd.bin")


@pytest.mark.skipif(not AUTHORS.is_dir(), reason="needs the authors' code in ../shared/reference/authors_clip4idc")
def test_the_authors_captioner_equals_theirs_on_the_same_weights(tmp_path, monkeypatch):
    """Their CLIP4IDC built from their code (their download helpers' imports stubbed; built directly, since
    from_pretrained downloads ViT-B/32; cast to fp32), every weight random, saved as their trainer saves it, loaded
    with load_captioner: the pair encoder's tokens, the per-token logits (within 1e-4 x their largest) and the greedy
    captions of their decoding loop over decoder_caption (32 steps, no stop, cut at the end token) equal ours."""
    torch.manual_seed(0)
    theirs = their_clip4idc(monkeypatch).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            norm = name.endswith("weight") and ("LayerNorm" in name or ".ln_" in name or name.startswith("clip.ln_"))
            p.copy_(torch.randn_like(p) * (0.1 if p.ndim < 2 else p.shape[-1] ** -0.5) + norm)
        theirs.decoder.classifier.cls.predictions.bias[clip_load.EOT] += 3.0
    torch.save(theirs.state_dict(), tmp_path / "pytorch_model.bin.clevr")
    ours = caption.load_captioner(tmp_path / "pytorch_model.bin.clevr")
    before, after = pair_images()
    ids = torch.cat([torch.full((5, 1), clip_load.SOT), torch.randint(1, 49406, (5, 9))], 1)
    with torch.no_grad():
        # their main_task_caption.py 542: the 4th value of get_sequence_visual_output, i.e. these tokens
        tokens = theirs.get_visual_output(torch.stack([before, after], 1).flatten(0, 1), torch.ones(5, 2),
                                          shaped=True, video_frame=2)[1]
        assert_close(ours.clip.encode_pair(before, after).tokens, tokens)
        mask = torch.ones(5, tokens.shape[1])
        want = theirs.decoder_caption(tokens, mask, ids, torch.ones_like(ids), shaped=True, get_logits=True)
        got = ours(ids, before=before, after=after)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # the target: 1e-4; measured: 8e-7
        # BERT's LayerNorm eps (1e-12) moves these logits by less than the tolerance: checked apart
        assert {m.eps for m in ours.captioner.modules() if isinstance(m, torch.nn.LayerNorm)} == {1e-12}
        x = torch.full((5, 1), clip_load.SOT)
        for _ in range(32):  # their greedy_decode (main_task_caption.py 541-556)
            scores = theirs.decoder_caption(tokens, mask, x, torch.ones_like(x), shaped=True, get_logits=True)
            x = torch.cat([x, scores[:, -1].max(1)[1][:, None]], 1)
    their_text = [caption.to_text(row) for row in x[:, 1:].tolist()]
    ours_ids = ours.caption(before=before, after=after)
    assert [caption.to_text(row) for row in ours_ids.tolist()] == their_text
    ended = [row.index(clip_load.EOT) for row in x[:, 1:].tolist()]
    assert len(set(ended)) > 1  # the captions end at different steps: the check has teeth
    assert all(ours_ids[i, :e + 1].tolist() == x[i, 1:e + 2].tolist() for i, e in enumerate(ended))


# -------------------------------------------------------------------------------------------------------------
# the paper presets' training and scoring against the authors' code: BertAdam, schedules, what trains and decays,
# 12 + 0, retrieval ranks, the stage-2 step

@pytest.mark.skipif(not AUTHORS.is_dir(), reason="needs the authors' code in ../shared/reference/authors_clip4idc")
def test_evaluate_n_inter_reads_their_captioner_at_another_split(tmp_path, monkeypatch, capsys):
    """evaluate.py --n-inter on a file of the authors' layout trained at 3 + 1 (their --intra_num_hidden_layers 3;
    their default would be 1 + 3 here): its first line says the split read, and with the flag the caption of two
    images equals their own greedy decoding; without it (their default) it does not. A captioner of ours records its
    split: the flag is an error naming it."""
    torch.manual_seed(0)
    theirs = their_clip4idc(monkeypatch, clip_cfg=M.CLIPConfig(**{**PAPER_CLIP.__dict__, "n_inter": 1})).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            norm = name.endswith("weight") and ("LayerNorm" in name or ".ln_" in name or name.startswith("clip.ln_"))
            p.copy_(torch.randn_like(p) * (0.1 if p.ndim < 2 else p.shape[-1] ** -0.5) + norm)
        theirs.decoder.classifier.cls.predictions.bias[clip_load.EOT] += 3.0
    ckpt = tmp_path / "pytorch_model.bin.clevr"
    torch.save(theirs.state_dict(), ckpt)
    pair = [str(REAL / "CLEVR_new_000000.png"), str(REAL / "CLEVR_new_000000_del.png")]
    images = torch.stack([load_image(p, PAPER_CLIP.image_resolution) for p in pair])[None]  # (1, 2, 3, H, W)
    with torch.no_grad():  # their main_task_caption.py 541-556 on their tokens
        tokens = theirs.get_visual_output(images.flatten(0, 1), torch.ones(1, 2), shaped=True, video_frame=2)[1]
        x = torch.full((1, 1), clip_load.SOT)
        for _ in range(32):
            scores = theirs.decoder_caption(tokens, torch.ones(1, tokens.shape[1]), x, torch.ones_like(x),
                                            shaped=True, get_logits=True)
            x = torch.cat([x, scores[:, -1].max(1)[1][:, None]], 1)
    want = caption.to_text(x[0, 1:].tolist())
    said = {}
    for flags in ([], ["--n-inter", "1"]):
        evaluate_py.main([*CPU, "--ckpt", str(ckpt), "--before", pair[0], "--after", pair[1], *flags])
        out = capsys.readouterr()
        said[len(flags)] = out.out.strip()
        assert f"its last {flags[1] if flags else 3} vision blocks read as inter blocks" in out.err.splitlines()[0]
    assert said[2] == want != said[0], (want, said)
    tiny_clevr(tmp_path / "clevr")
    tiny_encoder(tmp_path / "adapted.pt", tmp_path / "clevr")
    run(tmp_path, epochs=1)
    with pytest.raises(SystemExit):
        evaluate_py.main([*CPU, "--ckpt", str(tmp_path / "captioner.pt"), "--n-inter", "0"])
    assert "argument --n-inter: " in capsys.readouterr().err


NEEDS_AUTHORS = pytest.mark.skipif(not AUTHORS.is_dir(),
                                   reason="needs the authors' code in ../shared/reference/authors_clip4idc")


@NEEDS_AUTHORS
@pytest.mark.parametrize("stage", [1, 2])
def test_bertadam_is_the_authors_update(stage, monkeypatch):
    """train_utils.BertAdam with each stage's settings (b2, decay) and authors_schedule against their BertAdam with
    its own schedule, 8 steps at lr 1e-3 of the same weights and gradients, one group decayed and one not: in fp32
    the updates (weights minus start) equal to 1e-6 relative, where AdamW's differ by far more; in fp16 (their fp16
    weights and moments, --authors-numerics) bit for bit."""
    import_authors(monkeypatch)
    from modules.optimization import BertAdam
    b2, wd, kind = (0.98, 0.2, "cosine") if stage == 1 else (0.999, 0.01, "linear")
    K, warm = 8, 0.25
    g = torch.Generator().manual_seed(stage)
    start = [torch.randn(48, 32, generator=g) * 0.02, torch.randn(32, generator=g) * 0.02]
    grads = [[torch.randn(w.shape, generator=g) * 1e-3 for w in start] for _ in range(K)]  # norms < 1: after the clip

    def run(dtype, make):
        ps = [torch.nn.Parameter(w.to(dtype, copy=True)) for w in start]
        opt, sched = make(ps)
        for gs in grads:
            for p, gr in zip(ps, gs):
                p.grad = gr.to(dtype)
            opt.step()
            if sched is not None:
                sched.step()
        return [p.detach().float() - w.to(dtype).float() for p, w in zip(ps, start)]

    def theirs(ps):
        return BertAdam([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}], lr=1e-3, warmup=warm,
                        t_total=K, schedule=f"warmup_{kind}", b1=0.9, b2=b2, e=1e-6, weight_decay=wd), None

    def ours(ps, optimizer=train_utils.BertAdam):
        groups = [{"params": ps[:1], "lr": 1e-3, "weight_decay": wd}, {"params": ps[1:], "lr": 1e-3, "weight_decay": 0.0}]
        opt = optimizer(groups, lr=1e-3, betas=(0.9, b2), eps=1e-6)
        return opt, train_utils.authors_schedule(opt, K, warm, kind)
    want = run(torch.float32, theirs)
    for a, b in zip(want, run(torch.float32, ours)):
        assert (a - b).abs().max() <= 1e-6 * a.abs().max() and a.abs().max() > 1e-3
    adamw = run(torch.float32, lambda ps: ours(ps, torch.optim.AdamW))
    assert all((a - b).abs().max() > 0.1 * a.abs().max() for a, b in zip(want, adamw))  # the check has teeth
    want16, got16 = run(torch.float16, theirs), run(torch.float16, ours)
    assert all(torch.equal(a, b) for a, b in zip(want16, got16))
    assert all(not torch.equal(a, b) for a, b in zip(want16, want))  # fp16 rounds otherwise: bit for bit means it


@NEEDS_AUTHORS
def test_authors_schedule_at_every_step(monkeypatch):
    """authors_schedule's rate at every step of a run from step 0 equal to their BertAdam's (get_lr, as it steps),
    stage 1's warmup_cosine and stage 2's warmup_linear, 37 steps with a warmup of 0.1 (3.7 steps): rate 0 at the
    first step, the cosine of the fraction of all steps (not restarted after the warmup), the linear one down to 0."""
    import_authors(monkeypatch)
    from modules.optimization import BertAdam
    total = 37
    for kind in ("cosine", "linear"):
        a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
        theirs = BertAdam([a], lr=1e-4, warmup=0.1, t_total=total, schedule=f"warmup_{kind}", weight_decay=0.0)
        ours = train_utils.BertAdam([{"params": [b], "lr": 1e-4}], lr=1e-4)
        sched = train_utils.authors_schedule(ours, total, 0.1, kind)
        rates = []
        for step in range(total):
            a.grad, b.grad = torch.ones(3), torch.ones(3)
            rates.append(ours.param_groups[0]["lr"])
            assert rates[-1] == pytest.approx(theirs.get_lr()[0], rel=1e-12, abs=1e-20), (kind, step)
            theirs.step(), ours.step(), sched.step()
        assert rates[0] == 0 and max(rates) < 1e-4 and rates[-1] > 0
        peak = rates.index(max(rates))
        assert peak == 4 and rates[3] == pytest.approx(1e-4 * 3 / 3.7)  # the fraction, not the step count
        if kind == "cosine":  # after the warmup the cosine of x, not of the steps since the warmup
            assert rates[4] == pytest.approx(1e-4 * 0.5 * (1 + math.cos(math.pi * 4 / total)))


def _authors_trainer(path, keep):
    """Statements of their trainer as code (`ast`): importing main_task_*.py opens a process group. keep(node) picks
    top-level functions or statements of main()."""
    tree = ast.parse(path.read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    picked = [n for n in tree.body + main.body if keep(n)]
    return compile(ast.Module(body=picked, type_ignores=[]), str(path), "exec")


def _their_rules(monkeypatch, stage, model):
    """Their freeze (main(): --freeze_layer_num 0) and prep_optimizer run on their `model`, BertAdam and DDP stubbed
    -> {name: (lr, weight decay)} of the tensors their optimizer holds that require a gradient."""
    path = AUTHORS / ("main_task_retrieval.py" if stage == 1 else "main_task_caption.py")
    code = _authors_trainer(path, lambda n: (isinstance(n, ast.FunctionDef) and n.name == "prep_optimizer") or (
        isinstance(n, ast.If) and "freeze_layer_num > -1" in ast.unparse(n.test)))
    seen = {}
    stub_torch = SimpleNamespace(nn=SimpleNamespace(parallel=SimpleNamespace(
        DistributedDataParallel=lambda m, **kw: m)))
    args = SimpleNamespace(freeze_layer_num=0, linear_patch="2d", datatype="clevr", lr=1e-4, coef_lr=1e-3,
                           warmup_proportion=0.1)
    scope = {"torch": stub_torch, "BertAdam": lambda groups, **kw: seen.update(groups=groups, kw=kw),
             "args": args, "model": model, "print": lambda *a: None}
    exec(code, scope)
    scope["prep_optimizer"](args, model, 100, "cpu", 1, 0, coef_lr=args.coef_lr)
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (float(f'{g.get("lr", seen["kw"]["lr"]):.12g}'), g["weight_decay"])  # 1e-4 x 1e-3
            for g in seen["groups"] for p in g["params"] if p.requires_grad}


def _with_grad(named, loss):
    loss.backward()
    return {n for n, p in named if p.grad is not None}


@NEEDS_AUTHORS
@pytest.mark.parametrize("n_inter", [3, 0])
def test_what_trains_and_decays_is_the_authors(n_inter, monkeypatch):
    """What each paper stage trains, at which rate and with which decay, equal to their code's: their main()'s freeze
    and prep_optimizer (their source, run on their CLIP4IDC), the tensors that get a gradient in their forward (their
    BertAdam steps no other), against adapt.lr_rule / caption.lr_rule with authors_decays on ours, at 1 + 3
    (ViT-B/32's 9 + 3 on a 4-block CLIP) and 4 + 0 (12 + 0): CLIP's LayerNorm weights, e1, e2, ln_mid.weight and
    logit_scale decayed, BERT's LayerNorms not; at N + 0 stage 2 trains e1, e2, p, ln_mid."""
    import_authors(monkeypatch)
    import modules.modeling as their_modeling
    monkeypatch.setattr(their_modeling, "allgather", lambda x, cfg: x)  # one process: the gather is the identity
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    cfg = dataclasses_replace(PAPER_CLIP, n_inter=n_inter)
    before, after = pair_images(3)
    text = tokenize(["the cube turned red", "no change", "a ball moved"])
    caps = torch.cat([torch.full((3, 1), clip_load.SOT), torch.randint(1, 49406, (3, 6)),
                      torch.full((3, 1), clip_load.EOT)], 1)
    for stage in (1, 2):
        torch.manual_seed(0)
        their = their_clip4idc(monkeypatch, "retrieval" if stage == 1 else "caption", cfg).train()
        rules = _their_rules(monkeypatch, stage, their)
        ones = lambda x: torch.ones_like(x)
        inputs = (text[:, None], ones(text[:, None]), ones(text[:, None]), before[:, None], after[:, None],
                  torch.ones(3, 2, dtype=torch.long))
        cut = lambda x: x[:, None].contiguous()
        extra = {} if stage == 1 else dict(input_caption_ids=cut(caps[:, :-1]), decoder_mask=ones(cut(caps[:, :-1])),
                                           output_caption_ids=cut(caps[:, 1:]))
        theirs = {n: rules[n] for n in _with_grad(their.named_parameters(), their(*inputs, **extra)) if n in rules}
        if stage == 1:
            model = M.CLIP(cfg)
            args = preset_settings(adapt, "paper", "--n-inter", str(n_inter))
            rule = adapt.lr_rule(args)
            train_utils.freeze(model.named_parameters(), rule)
            groups = train_utils.param_groups(model.named_parameters(), rule, args.weight_decay,
                                             train_utils.authors_decays(model))
            loss = adapt.contrastive_loss(*adapt.PairText(model)(before, after, text))
            theirs = {n.removeprefix("clip."): v for n, v in theirs.items()}
        else:
            model = paper_captioner(clip_cfg=cfg).train()
            args = preset_settings(caption, "paper", data="clevr")
            rule = caption.lr_rule(args)
            train_utils.freeze(model.named_parameters(), rule)
            groups = train_utils.param_groups(model.named_parameters(), rule, args.weight_decay,
                                             train_utils.authors_decays(model, "captioner"))
            loss = caption.caption_loss(model(caps[:, :-1], before=before, after=after), caps[:, 1:])
            # their decoder.* names -> ours (authors_layout: the same tensors, ours split there as q/k/v)
            ptr = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
            to_ours = {k: ptr[t.untyped_storage().data_ptr()] for k, t in authors_layout(model).items()}
            theirs_by_ours = defaultdict(set)
            for n, v in theirs.items():
                theirs_by_ours[to_ours[n]].add(v)
            assert all(len(v) == 1 for v in theirs_by_ours.values())  # q, k, v of one of ours alike in theirs
            theirs = {n: v.pop() for n, v in theirs_by_ours.items()}
        names = {id(p): n for n, p in model.named_parameters()}
        ours = {names[id(p)]: (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
        ours = {n: ours[n] for n in _with_grad(model.named_parameters(), loss) if n in ours}
        assert ours == theirs, (stage, sorted(set(ours.items()) ^ set(theirs.items()))[:6])
        pair = [k for k in ours if k.removeprefix("clip.").startswith(M.PAIR_KEYS)]
        assert len(pair) == 5  # e1, e2, p, ln_mid train at N + 0 too (their module uses them)
        decayed = {n for n, (lr, wd) in ours.items() if wd > 0}
        assert any("ln_1.weight" in n for n in decayed) and not any(n.endswith(".bias") for n in decayed)
        if stage == 1:
            assert {"logit_scale", "visual.ln_mid.weight", "visual.bef_embedding"} <= decayed
        else:
            assert "captioner.decoder.0.ln_1.weight" not in decayed and "clip.visual.ln_post.weight" in decayed


@pytest.mark.slow
def test_authors_numerics_holds_their_fp16_and_their_two_gpu_gradient(openai_archive, adapt_synth, tmp_path):
    """--authors-numerics: conv1, every attention and MLP Linear, visual.proj and text_projection stored in fp16 (their
    convert_weights), with BertAdam's moments in fp16 beside them, the rest in fp32, through an epoch of adapt.main;
    two_gpu_gradient_ halves every gradient but logit_scale's."""
    torch.manual_seed(0)
    model = M.CLIP(TINY)
    plain = copy.deepcopy(model)
    adapt.two_gpu_gradient_(model)
    before, after = pair_images(3, size=32)
    ids = tokenize(["a red cube", "a ball moved", "no change"])
    for m in (model, plain):
        adapt.contrastive_loss(*adapt.PairText(m)(before, after, ids)).backward()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad * (1.0 if n == "logit_scale" else 0.5), rtol=0, atol=0, msg=n)
    out = tmp_path / "adapted.pt"
    adapt.main(["--clip", str(openai_archive), "--data-root", str(adapt_synth), "--out", str(out),
                "--authors-numerics"] + FAST)
    state = torch.load(train_utils.last_path(out), weights_only=False)
    half = {k for k, v in state["model"].items() if v.dtype == torch.float16}
    assert "visual.conv1.weight" in half and "visual.transformer.resblocks.0.attn.in_proj_bias" in half
    assert {"visual.proj", "text_projection", "transformer.resblocks.0.mlp.c_fc.bias"} <= half
    assert not half & {"visual.ln_mid.weight", "visual.positional_embedding", "token_embedding.weight",
                       "visual.transformer.resblocks.0.ln_1.weight", "visual.bef_embedding", "logit_scale"}
    moments = [s["next_m"].dtype for s in state["optimizer"]["state"].values()]
    assert torch.float16 in moments and torch.float32 in moments
    assert state["args"]["authors_numerics"] and type(state["optimizer"]["state"]) is dict
    # stage 2 on it: the pair encoder in fp16 (their convert_weights), the captioner in fp32
    cap = tmp_path / "captioner.pt"
    caption.main([*CPU, "--ckpt", str(out), "--preset", "paper", "--authors-numerics", "--out", str(cap), "--results",
                  str(tmp_path / "c.json"), "--epochs", "1", "--batch-size", "4", "--workers", "0", "--log-every", "1000"])
    state = torch.load(train_utils.last_path(cap), weights_only=False)
    dtypes = {k: v.dtype for k, v in state["model"].items()}
    assert dtypes["clip.visual.proj"] == torch.float16 == dtypes["clip.visual.transformer.resblocks.0.mlp.c_fc.weight"]
    assert dtypes["captioner.decoder.0.attn.q_proj.weight"] == torch.float32 == dtypes["clip.visual.ln_mid.weight"]
    assert math.isfinite(state["history"][0]["loss"])


def dataclasses_replace(cfg, **kw):
    return M.CLIPConfig(**{**asdict(cfg), **kw})


@NEEDS_AUTHORS
def test_12_plus_0_is_the_authors_module(monkeypatch):
    """The pair encoder with no inter block (Table 7's 12 + 0; 4 + 0 here) equal to their module with
    intra_layers = every block on the same weights: tokens and pair vector. As theirs, it adds e1, e2, p and ln_mid
    after the last block, so it is not symmetric in the two images."""
    import_authors(monkeypatch)
    from modules.module_clip import CLIP as TheirCLIP
    cfg = dataclasses_replace(PAPER_CLIP, n_inter=0)
    torch.manual_seed(0)
    ours = M.CLIP(cfg).eval()
    with torch.no_grad():
        for p in ours.visual.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    their = TheirCLIP(cfg.embed_dim, cfg.image_resolution, cfg.vision_layers, cfg.vision_width,
                      cfg.vision_patch_size, cfg.context_length, cfg.vocab_size, cfg.transformer_width,
                      cfg.transformer_heads, cfg.transformer_layers, intra_layers=cfg.vision_layers).float().eval()
    their.load_state_dict(ours.state_dict())
    before, after = pair_images()
    with torch.no_grad():
        vector, tokens = their.encode_image(torch.stack([before, after], 1).flatten(0, 1), video_frame=2,
                                            return_hidden=True)
        got = ours.encode_pair(before, after)
        swapped = ours.encode_pair(after, before)
    assert_close(got.tokens, tokens, atol=2e-5)
    assert_close(got.vector, vector, atol=2e-5)
    assert (swapped.vector - got.vector).abs().max() > 1e-2  # e1 and e2 tell the images apart


def _their_retrieval(sim, owner, monkeypatch):
    """Their metrics.py on sim (P, T), as main_task_retrieval.py 410-438 calls it: text x pair rows cut per pair and
    padded with -inf, tensor_text_to_video_metrics and compute_metrics(tensor_video_to_text_sim(...))."""
    monkeypatch.syspath_prepend(str(AUTHORS))
    spec = importlib.util.spec_from_file_location("their_metrics", AUTHORS / "metrics.py")
    their = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(their)
    sizes = torch.bincount(owner).tolist()
    sm, cut, longest = sim.t().double().numpy(), np.cumsum([0] + sizes), max(sizes)
    rows = [np.concatenate([sm[a:b], np.full((longest - b + a, sm.shape[1]), -np.inf)]) for a, b in
            zip(cut[:-1], cut[1:])]
    padded = np.stack(rows)
    return their.tensor_text_to_video_metrics(padded), their.compute_metrics(their.tensor_video_to_text_sim(
        torch.tensor(padded)).numpy())


@NEEDS_AUTHORS
def test_retrieval_ranks_as_the_authors(monkeypatch):
    """adapt.retrieval_metrics equal to their metrics.py on tie-free similarities of 40 pairs (even: the median is
    the mean of the two middle ranks in pair -> text) with 1 to 5 paraphrase-like captions each (a pair's captions
    near one another): R@1/5/10, MdR, MnR both ways. pair -> text ranks caption sets, not captions."""
    g = torch.Generator().manual_seed(2)
    P = 40
    owner = torch.tensor([i for i in range(P) for _ in range(1 + (i * 7) % 5)])
    centre = torch.randn(P, 16, generator=g)
    captions = F.normalize(centre[owner] + 1.6 * torch.randn(len(owner), 16, generator=g), dim=-1)
    pairs = F.normalize(centre + 1.6 * torch.randn(P, 16, generator=g), dim=-1)
    sim = pairs @ captions.t()
    ours = adapt.retrieval_metrics(sim, owner)
    t2p, p2t = _their_retrieval(sim, owner, monkeypatch)
    for d, theirs in (("text->pair", t2p), ("pair->text", p2t)):
        for k in (1, 5, 10):
            assert ours[f"{d} R@{k}"] == pytest.approx(theirs[f"R{k}"], abs=1e-4), (d, k)
        assert ours[f"{d} MdR"] == pytest.approx(theirs["MR"]) and ours[f"{d} MnR"] == pytest.approx(theirs["MeanR"])
    assert ours["pair->text MdR"] % 1 == 0.5  # the two middle ranks averaged: np.median's, not torch's lower one
    assert 10 < ours["pair->text R@5"] < 90 and ours["pair->text MdR"] > 3  # neither trivial nor hopeless


def test_chance_is_the_mean_of_random_rankings():
    """adapt.chance_metrics against the mean of 400 rankings of random similarities (60 pairs, 1 to 5 captions each,
    so a pair's own caption set ranks higher the larger it is): every R@K within 3 standard errors and the mean ranks
    within 1 % (the medians 2 %), both directions."""
    g = torch.Generator().manual_seed(0)
    sizes = [1] * 30 + [3] * 20 + [5] * 10
    owner = torch.tensor([i for i, c in enumerate(sizes) for _ in range(c)])
    runs = [adapt.retrieval_metrics(torch.rand(60, len(owner), generator=g), owner) for _ in range(400)]
    chance = adapt.chance_metrics(60)
    for key, want in chance.items():
        got = np.array([r[key] for r in runs])
        tol = 3 * got.std() / np.sqrt(len(got)) if "R@" in key else (0.02 if "MdR" in key else 0.01) * want
        assert abs(got.mean() - want) <= tol, (key, got.mean(), want)


@NEEDS_AUTHORS
def test_stage2_step_is_the_authors(monkeypatch, tmp_path):
    """The paper preset's stage-2 step on CLEVR-Change as theirs (main_task_caption.py 307-341,
    dataloader_clevr_caption.py 197-213): caption.batch_loss of change pairs then their distractors equal to their
    loss1 + loss2 (their CLIP4IDC in train mode, dropout 0, the same weights, pairs and captions; one mean over both
    halves is not); data.DistractorBatches gives each change pair with its own distractor, in an order of the epoch;
    the steps per epoch are their loader's on a CLEVR-Change layout."""
    torch.manual_seed(0)
    theirs = their_clip4idc(monkeypatch, dropout=0.0).train()
    torch.save(theirs.state_dict(), tmp_path / "their.bin")
    ours = caption.load_captioner(tmp_path / "their.bin")
    g = torch.Generator().manual_seed(0)
    before, after, distractor = (torch.randint(0, 256, (3, 3, 56, 56), dtype=torch.uint8, generator=g)
                                 for _ in range(3))
    rows = lambda lengths: torch.tensor([[clip_load.SOT] + torch.randint(1, 49406, (n,), generator=g).tolist()
                                         + [clip_load.EOT] + [0] * (9 - n) for n in lengths])
    change, same = rows([8, 5, 3]), rows([2, 2, 1])  # different numbers of words: a mean over both is not a sum
    text = tokenize(["the cube turned red"] * 3)[:, None]
    their_loss = sum(theirs(text, torch.ones_like(text), torch.ones_like(text), clip_load.normalize(before)[:, None],
                            clip_load.normalize(b)[:, None], torch.ones(3, 2, dtype=torch.long),
                            input_caption_ids=c[:, None, :-1].contiguous(),
                            decoder_mask=(c[:, None, :-1] != 0).long(), output_caption_ids=c[:, None, 1:].contiguous())
                     for b, c in ((after, change), (distractor, same)))
    batch = {"before": torch.cat([before, before]), "after": torch.cat([after, distractor]),
             "ids": torch.cat([change, same])}
    with torch.no_grad():
        got = caption.batch_loss(ours, batch, "cpu", paired=True)
        one_mean = caption.batch_loss(ours, batch, "cpu")
    assert got.item() == pytest.approx(their_loss.item(), rel=1e-5)
    assert abs(one_mean.item() - their_loss.item()) > 0.1 * their_loss.item()
    # the loader: each change pair, then its own distractor, in CLEVR-Change's total order
    items = [it for i in range(5) for it in (data.Item(f"{i:06d}", "b", "a", [f"change {i}"], "color"),
                                              data.Item(f"{i:06d}_n", "b", "n", [SAME], "distractor"))]
    pairs = data.distractor_partners(items)
    assert pairs == [(2 * i, 2 * i + 1) for i in range(5)]
    ds = data.CaptionDataset(items, ids=torch.arange(10)[:, None], draw=True, features=torch.zeros(10, 1))
    loader = data.make_loader(ds, 2, True, pairs=pairs, seed=3)
    orders = []
    for epoch in (0, 1, 0):
        data.set_epoch(loader, epoch)
        batches = [b["index"].tolist() for b in loader]
        assert len(batches) == len(loader) == 2 and all(len(b) == 4 for b in batches)  # 5 // 2, the last dropped
        assert all(items[d].id == items[c].id + "_n" for b in batches for c, d in zip(b[:2], b[2:]))
        orders.append(batches)
    assert orders[0] == orders[2] != orders[1]
    # the steps per epoch: their loader of the train split at their batch
    for name in ("torchvision", "torchvision.transforms", "cv2"):
        stub = type(sys)(name)
        stub.__dict__.update({k: (lambda *a, **kw: None) for k in ("Compose", "Resize", "CenterCrop", "ToTensor",
                                                                     "Normalize")})
        monkeypatch.setitem(sys.modules, name, stub)
    from dataloaders.dataloader_clevr_caption import CLEVR_DataLoader
    tiny_clevr(tmp_path / "clevr")
    their_set = CLEVR_DataLoader("train", str(tmp_path / "clevr"), str(tmp_path / "clevr"), tokenizer=None)
    train = data.load_items("clevr", tmp_path / "clevr", "train", "total")
    ours_loader = data.make_loader(data.CaptionDataset(train, draw=True), 4, True,
                                   pairs=data.distractor_partners(train))
    assert len(ours_loader) == len(torch.utils.data.DataLoader(their_set, 4, drop_last=True)) == 4


def test_paper_captioner_reads_clips_own_words_frozen_on_clevr():
    """The paper preset's captioner (caption.new_model): its word and position embeddings and output projection
    are the CLIP's Parameters, not copies; under the CLEVR rule they stay frozen through a training step while the
    captioner and the pair encoder's blocks move."""
    clip = M.CLIP(PAPER_CLIP)
    args = preset_settings(caption, "paper", "--heads", "2", data="clevr", width=128)
    pair = caption.new_model(args, clip)
    assert pair.captioner.token_embedding is clip.token_embedding
    assert pair.captioner.positional_embedding is clip.positional_embedding
    assert isinstance(pair.captioner, M.Captioner) and pair.captioner.cfg.enc_layers == 3 == pair.captioner.cfg.dec_layers
    rule = caption.lr_rule(args)
    train_utils.freeze(pair.named_parameters(), rule)
    opt = torch.optim.AdamW(train_utils.param_groups(pair.named_parameters(), rule, 0.01), lr=1e-3)
    before_step = copy.deepcopy(pair.state_dict())
    items = [SimpleNamespace(captions=["the small red cube has been moved", "there is no change"])]
    ids = caption.encode_captions(items, caption.MAX_LEN)[:, :10]
    assert ids[0, 0] == clip_load.SOT and clip_load.EOT in ids[0].tolist()
    b, a = pair_images(2)
    loss = caption.caption_loss(pair(ids[:, :-1], before=b, after=a), ids[:, 1:])
    loss.backward()
    opt.step()
    after_step = pair.state_dict()
    moved = lambda k: not torch.equal(before_step[k], after_step[k])
    assert not any(moved(k) for k in ("clip.token_embedding.weight", "clip.positional_embedding",
                                      "captioner.token_embedding.weight", "clip.visual.conv1.weight"))
    assert all(map(moved, ("captioner.head_bias", "captioner.decoder.2.ln_x.weight", "clip.visual.ln_post.weight",
                           "captioner.encoder.0.mlp.c_fc.weight",
                           "clip.visual.transformer.resblocks.3.attn.in_proj_weight")))


def test_decoder_layer_i_reads_encoder_layer_i():
    """The authors' layer-wise reading (module_decoder.py Decoder.forward): decoder layer 0 cross-attends to
    encoder layer 0's output, so changing encoder layer 0 changes decoder layer 0's output and changing the last
    encoder layer does not (it changes the last decoder layer's)."""
    pair = paper_captioner()
    cap = pair.captioner
    outs = {}
    for i, block in enumerate(cap.decoder):
        block.register_forward_hook(lambda m, inp, out, i=i: outs.__setitem__(i, out))
    memory = torch.randn(2, 100, 128)
    ids = torch.full((2, 4), clip_load.SOT)

    def run():
        with torch.no_grad():
            cap(memory, ids)
        return {i: o.clone() for i, o in outs.items()}
    base = run()
    with torch.no_grad():
        cap.encoder[2].mlp.c_proj.weight.mul_(3)
    last = run()
    assert torch.equal(last[0], base[0]) and torch.equal(last[1], base[1]) and not torch.equal(last[2], base[2])
    with torch.no_grad():
        cap.encoder[0].mlp.c_proj.weight.mul_(3)
    assert not torch.equal(run()[0], base[0])


def test_greedy_stops_at_the_end_token_and_text_is_cut_as_theirs():
    """BPE captions: greedy decoding stops at <|endoftext|> (the authors run 32 steps and cut there: the same
    words); the text is decoded, then cut at the end token and at the first "!" (the pad, id 0), as they cut it; ids
    decode to the text CLIP's tokenizer encodes."""
    pair = paper_captioner()
    with torch.no_grad():
        pair.captioner.head_bias[clip_load.EOT] += 100.0  # the end token at once, for every pair
    b, a = pair_images(3)
    out = pair.caption(before=b, after=a)
    assert out.tolist() == [[clip_load.EOT]] * 3
    the, cube = clip_load.encode("the cube")
    assert caption.to_text([the, cube, clip_load.EOT, the, 0]) == "the cube"
    assert caption.to_text([the, 0, cube, clip_load.EOT]) == "the"  # their cut at the first "!"
    assert caption.to_text([the, cube] * 16) == "the cube" * 1 + " the cube" * 15  # no end: all 32
    for text in ("The small red metal cube turned blue.", "there is no change", "a big cyan sphere has been added",
                 "the man's car is gone", "two people walk to the left"):
        ids = clip_load.encode(text)
        back = caption.to_text(ids)
        assert clip_load.encode(back) == ids and metrics.tokenize(back) == metrics.tokenize(text)


@pytest.mark.parametrize("make, what", [
    (lambda d: (d / "f").write_bytes(os.urandom(3000)), "could not read"),
    (lambda d: (d / "f").write_bytes(b""), "could not read"),  # an empty download
    (lambda d: tiny_encoder(d / "f", d), "is not a captioner but an adapted encoder"),
    (lambda d: save_archive(M.CLIP(TINY), d / "f"), "is not a captioner but a CLIP"),
    (lambda d: torch.save({f"clip.{k}": v for k, v in M.CLIP(TINY).state_dict().items()}, d / "f"),
     "is not a captioner but an adapted encoder"),  # the authors' stage-1 file
    (lambda d: torch.save({"model": M.CLIP(TINY).state_dict(), "stage": "caption", "captioner": {}}, d / "f"),
     "a captioner.pt of an earlier layout: evaluate it after `git checkout 7dea046`"),  # ours, before
    (lambda d: torch.save({"model": M.CLIP(TINY).state_dict(), "stage": "caption", "format": 3}, d / "f"),
     "a captioner.pt of an earlier layout: evaluate it after `git checkout 7670427`"),  # the two-captioner one's
], ids=["random bytes", "empty", "adapted.pt", "OpenAI archive", "their stage 1", "older captioner.pt",
        "format 3"])
def test_what_is_not_a_captioner_is_one_line_naming_the_file(tmp_path, make, what):
    make(tmp_path)
    with pytest.raises(SystemExit, match=what) as e:
        caption.load_captioner(tmp_path / "f")
    assert str(tmp_path / "f") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.subprocess
def test_readme_command_evaluates_the_authors_checkpoint(tmp_path):
    """README's command on their released layout: `python evaluate.py --ckpt pytorch_model.bin.clevr --data clevr
    --data-root DIR` says first that it found the authors' captioner, never trains, captions the test split with
    their greedy decoding, scores it and writes captions.json; the train split's images need not be there (its
    captions make the constant-caption baseline)."""
    tiny_clevr(tmp_path / "clevr")
    root = tmp_path / "clevr"
    for name, caps in (("splits.json", None), ("change_captions.json", ["a train-only change"]),
                       ("no_change_captions.json", [SAME])):
        obj = json.loads((root / name).read_text())
        if caps is None:
            obj["train"].append(99)  # a scene whose images are not on disk
        else:
            obj["CLEVR_default_000099.png"] = caps
        (root / name).write_text(json.dumps(obj))
    small = M.CLIPConfig(**{**PAPER_CLIP.__dict__, "image_resolution": 32})  # a 4x4 grid: quicker
    torch.save(authors_layout(paper_captioner(clip_cfg=small)), tmp_path / "pytorch_model.bin.clevr")
    args = ["--ckpt", str(tmp_path / "pytorch_model.bin.clevr"), "--data", "clevr", "--amp", "off", *CPU, "--workers",
            "0", "--data-root", str(tmp_path / "clevr"), "--results", str(tmp_path / "captions.json")]
    out = subprocess.run([sys.executable, "evaluate.py", *args], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "the authors' CLIP4IDC captioner, its last 3 vision blocks read as inter blocks (their default" in \
        out.stdout.splitlines()[0]
    assert "epoch" not in out.stdout and not (tmp_path / "captioner.pt").exists()
    results = json.loads((tmp_path / "captions.json").read_text())
    assert len(results["predictions"]) == 8 and "CIDEr-D" in results["scores"]
    assert all("!" not in p["caption"] and "<|" not in p["caption"] for p in results["predictions"])



# -------------------------------------------------------------------------------------------------------------
# clip_load.py: checkpoints (OpenAI's archive, the authors', the shipped mini CLIP), tokenizer, preprocessing


def test_archive_roundtrip_and_state_dict(tmp_path):
    torch.manual_seed(0)
    images, text = tiny_inputs()
    original = save_archive(M.CLIP(TINY), tmp_path / "a.pt")  # as OpenAI's release: fp16 TorchScript
    assert not set(M.PAIR_KEYS) & set(clip_load.read_state_dict(tmp_path / "a.pt")[0])  # no pair parameters in it
    torch.save(original.state_dict(), tmp_path / "sd.pt")
    for path in (tmp_path / "a.pt", tmp_path / "sd.pt"):
        ours = load_clip(path, n_inter=2)
        assert next(ours.parameters()).dtype == torch.float32 and not ours.training
        with torch.no_grad():
            assert_close(ours.encode_image(images), original.encode_image(images))
            assert_close(ours.encode_text(text), original.encode_text(text))
            if path.name == "sd.pt":  # the archive's pair parameters are freshly initialized on loading
                assert_close(ours.encode_pair(images, images.flip(0)).tokens,
                             original.encode_pair(images, images.flip(0)).tokens)


def test_strict_load_of_openai_keys():
    """OpenAI's key set (no pair parameters, plus the three scalars) loads with strict=True."""
    sd = {k: v for k, v in M.CLIP(TINY).state_dict().items() if k not in M.PAIR_KEYS}
    sd.update(input_resolution=torch.tensor(32), context_length=torch.tensor(77), vocab_size=torch.tensor(49408))
    sd = {k: v for k, v in sd.items() if k not in clip_load.NON_PARAMETERS}
    model = M.build_model(sd, n_inter=2)
    model.load_state_dict(sd, strict=True)


def test_authors_checkpoint_keys_load(tmp_path):
    torch.manual_seed(1)
    src = M.CLIP(TINY)
    sd = {f"clip.{k}": v for k, v in src.state_dict().items()}  # the authors' released layout
    sd["decoder.embeddings.weight"] = torch.randn(5, 4)  # their captioner's keys are ignored
    torch.save(sd, tmp_path / "clip4idc.bin")
    ours = load_clip(tmp_path / "clip4idc.bin", n_inter=2)
    for k in ("visual.bef_embedding", "visual.aft_embedding", "visual.joint_positional_embedding",
              "visual.ln_mid.weight"):
        assert torch.equal(ours.state_dict()[k], src.state_dict()[k]), k


# Hugging Face's layout, and the activation by origin: transformers' CLIPModel (test-only) is the reference

def hf_clip(act, seed=0):
    """transformers' CLIPModel, small and random: 2 heads a tower, 16-pixel patches on a 3 x 3 grid, CLIP's words."""
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install transformers)")
    tower = dict(hidden_size=128, intermediate_size=512, num_attention_heads=2, hidden_act=act)
    cfg = transformers.CLIPConfig(text_config=dict(tower, num_hidden_layers=1, vocab_size=49408),
                                  vision_config=dict(tower, num_hidden_layers=2, image_size=48, patch_size=16),
                                  projection_dim=128)  # as wide as its words: the captioner reads it
    torch.manual_seed(seed)
    return transformers.CLIPModel(cfg).eval()


def hf_folder(model, folder, fmt):
    """save_pretrained's folder; "bin": pytorch_model.bin as older transformers wrote it (5 writes safetensors only)."""
    if fmt == "safetensors":
        model.save_pretrained(folder)
    else:
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


def hf_features(out):
    return out if torch.is_tensor(out) else out.pooler_output  # transformers 5: an output object


@pytest.mark.parametrize("act", ["quick_gelu", "gelu"])
def test_hugging_face_layout_gives_hfs_features(tmp_path, capsys, act):
    """A CLIPModel folder (safetensors, or pytorch_model.bin) or its weights file alone loads through
    clip_load.HF_NAMES: image and text features equal to HF's own; the activation its config's hidden_act."""
    hf = hf_clip(act)
    images, text = torch.randn(3, 3, 48, 48), tokenize(["the red cube moved", "no change", "a ball is gone"])
    with torch.no_grad():
        want_img, want_txt = hf_features(hf.get_image_features(pixel_values=images)), hf_features(
            hf.get_text_features(input_ids=text, attention_mask=(text != 0).long()))
    for fmt in ("safetensors", "bin"):
        folder = hf_folder(hf, tmp_path / fmt, fmt)
        for path in (folder, folder / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors")):
            ours = load_clip(path, n_inter=1)
            assert ours.cfg.activation == act and ours.cfg.vision_patch_size == 16 and ours.cfg.image_resolution == 48
            said = capsys.readouterr().out
            assert f"Hugging Face's layout (clip_load.HF_NAMES), {act} as its config.json says" in said
            with torch.no_grad():
                assert_close(ours.encode_image(images), want_img)
                assert_close(ours.encode_text(text), want_txt)
    # the same weights in OpenAI's names, a bare state dict: the same features once told the activation
    sd = {k: v for k, v in ours.state_dict().items() if k not in M.PAIR_KEYS}
    torch.save(sd, tmp_path / "openai_names.pt")
    again = load_clip(tmp_path / "openai_names.pt", n_inter=1, activation=act)
    with torch.no_grad():
        assert_close(again.encode_image(images), want_img)
        assert_close(again.encode_text(text), want_txt)


def test_our_tokenizer_is_hugging_faces(tmp_path):
    """CLIPTokenizer built from the BPE file we ship gives our ids (the HF layout keeps our tokenizer)."""
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install transformers)")
    encoder, ranks = clip_load.vocab()
    (tmp_path / "vocab.json").write_text(json.dumps(encoder))
    merges = "\n".join(" ".join(m) for m in sorted(ranks, key=ranks.get))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + merges)
    tok = transformers.CLIPTokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    extra = [c for _, c in CHANGES.values()] + [SAME, "The man's T-shirt (left) isn't red.", "café  naïve 123!!"]
    for text in shared_captions()[:200] + extra:  # ../shared's real captions where it is there
        assert tok(text)["input_ids"] == [clip_load.SOT] + clip_load.encode(text) + [clip_load.EOT], text


def test_safetensors_without_the_package_is_one_line(tmp_path, monkeypatch):
    folder = hf_folder(hf_clip("quick_gelu"), tmp_path / "hf", "safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors fails
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(SystemExit, match=r"model.safetensors is a safetensors file: .*pip install safetensors"):
        load_clip(folder)
    torch.save(hf_clip("quick_gelu").state_dict(), folder / "pytorch_model.bin")  # beside it: read, no package needed
    assert load_clip(folder, n_inter=1).cfg.vision_patch_size == 16
    (folder / "pytorch_model.bin").unlink()
    (folder / "model.safetensors").unlink()
    with pytest.raises(SystemExit, match="holds none of pytorch_model.bin, model.safetensors"):
        load_clip(folder)


def test_hugging_face_configs_we_cannot_run_are_refused(tmp_path):
    folder = hf_folder(hf_clip("quick_gelu"), tmp_path / "hf", "bin")
    cfg = json.loads((folder / "config.json").read_text())
    for tower, change, what in (("text_config", {"hidden_act": "gelu"}, "in both"),
                                ("vision_config", {"hidden_act": "relu"}, "hidden_act"),
                                ("vision_config", {"num_attention_heads": 4}, "heads are not its width / 64")):
        (folder / "config.json").write_text(json.dumps({**cfg, tower: {**cfg[tower], **change}}))
        with pytest.raises(SystemExit, match=what):
            load_clip(folder, n_inter=1)
    # an older file's *_config_dict is what transformers reads, over its *_config
    dicts = {f"{t}_config_dict": {**cfg[f"{t}_config"], "hidden_act": "gelu"} for t in ("text", "vision")}
    (folder / "config.json").write_text(json.dumps({**cfg, **dicts}))
    assert load_clip(folder, n_inter=1).cfg.activation == "gelu"
    (folder / "config.json").write_text("{not json")
    with pytest.raises(SystemExit, match="config.json is not valid JSON"):
        load_clip(folder, n_inter=1)
    # one tower alone (CLIPVisionModelWithProjection, as IP-Adapter's image_encoder): one line, no traceback
    transformers = pytest.importorskip("transformers")
    vision = transformers.CLIPVisionModelWithProjection(hf_clip("quick_gelu").config.vision_config)
    vision.save_pretrained(tmp_path / "vision", safe_serialization=False)
    with pytest.raises(SystemExit, match="not a CLIP ViT checkpoint with both towers"):
        load_clip(tmp_path / "vision")


def test_the_activation_follows_the_weights_origin(tmp_path, capsys, monkeypatch):
    """OpenAI's archive, ours and the shipped files are QuickGELU; a bare state dict's origin cannot be told: QuickGELU
    with the first line saying so and naming --activation gelu; a flag against a known origin is an error."""
    torch.manual_seed(0)
    save_archive(M.CLIP(TINY), tmp_path / "archive.pt")
    torch.save(M.CLIP(TINY).state_dict(), tmp_path / "bare.pt")
    for known in (tmp_path / "archive.pt", "mini64-synth"):
        assert clip_load.clip_config(known).activation == "quick_gelu"
        with pytest.raises(SystemExit, match="by its origin"):
            clip_load.clip_config(known, "gelu")
    assert capsys.readouterr().out == ""
    args = adapt.settings([*CPU, "--clip", str(tmp_path / "bare.pt"), "--n-inter", "2", "--data-root",
                           str(tmp_path / "nothing")])
    assert args.activation == "quick_gelu"
    first = capsys.readouterr().out.splitlines()[0]
    assert "unknown origin, read with QuickGELU and width / 64 heads" in first and "--activation gelu" in first
    gelu = adapt.settings([*CPU, "--clip", str(tmp_path / "bare.pt"), "--n-inter", "2", "--activation", "gelu",
                           "--data-root", str(tmp_path / "nothing")])
    assert gelu.activation == "gelu" and "unknown origin" not in capsys.readouterr().out
    images = torch.randn(2, 3, 32, 32)
    quick, exact = (load_clip(tmp_path / "bare.pt", n_inter=2, activation=a) for a in ("quick_gelu", "gelu"))
    assert isinstance(exact.visual.transformer.resblocks[0].mlp.gelu, torch.nn.GELU)
    with torch.no_grad():
        assert (quick.encode_image(images) - exact.encode_image(images)).abs().max() > 1e-3
    # what this project writes records it: read back without a word
    torch.save({"model": exact.state_dict(), "config": asdict(exact.cfg), "stage": "adapt"}, tmp_path / "ours.pt")
    assert load_clip(tmp_path / "ours.pt").cfg.activation == "gelu" and capsys.readouterr().out == ""


def test_a_24_block_clip_runs_21_plus_3_by_default(tmp_path, capsys):
    """ViT-L/14's depth: the inter blocks stay the paper's last 3 (the authors' code would fix 9 intra: 9 + 15)."""
    cfg = M.CLIPConfig(**{**TINY.__dict__, "vision_layers": 24, "vision_width": 64, "vision_patch_size": 14,
                          "image_resolution": 28})
    torch.save(M.CLIP(cfg).state_dict(), tmp_path / "deep.pt")
    args = adapt.settings([*CPU, "--clip", str(tmp_path / "deep.pt"), "--data-root", str(tmp_path)])
    assert (args.vision_layers, args.n_inter, args.patch_size, args.image_size) == (24, 3, 14, 28)
    assert adapt.new_model(args).visual.n_inter == 3


@pytest.mark.parametrize("make, what", [
    (lambda p: p.write_bytes(b"not a checkpoint at all"), "could not read"),
    (lambda p: p.write_bytes(Path(p.parent / "good.pt").read_bytes()[:5000]), "could not read"),
    (lambda p: torch.save({"conv.weight": torch.zeros(2)}, p), "not a CLIP ViT checkpoint"),
    (lambda p: torch.save([1, 2, 3], p), "not a state dict"),
])
def test_bad_files_give_clear_errors(tmp_path, make, what):
    torch.save(M.CLIP(TINY).state_dict(), tmp_path / "good.pt")
    make(tmp_path / "bad.pt")
    with pytest.raises(SystemExit, match=what):
        load_clip(tmp_path / "bad.pt")


def test_wrong_shapes_and_missing_files(tmp_path):
    sd = M.CLIP(TINY).state_dict()
    sd["visual.proj"] = torch.zeros(64, 7)  # does not fit the text projection's embed dim
    torch.save(sd, tmp_path / "odd.pt")
    with pytest.raises(SystemExit, match="does not fit the CLIP ViT architecture"):
        load_clip(tmp_path / "odd.pt")
    with pytest.raises(SystemExit, match="nothing at"):
        load_clip(tmp_path / "missing.pt")


def test_offline_download_is_a_clear_error(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(clip_load, "CACHE", tmp_path)
    monkeypatch.setattr(clip_load.urllib.request, "urlopen", offline)
    with pytest.raises(SystemExit, match="could not download .*Offline"):
        load_clip("ViT-B/32")
    assert not list(tmp_path.iterdir())  # no half file left behind
    (tmp_path / "clevr").mkdir()  # a real dataset: the paper preset, so ViT-B/32, or the way out
    with pytest.raises(SystemExit, match="could not download .*or pass --preset mini"):
        adapt.settings(["--data-root", str(tmp_path / "clevr")])


def test_a_corrupt_or_missing_shipped_file_is_a_clear_error(tmp_path, monkeypatch):
    name = adapt.PRESETS["mini"]["clip"]  # the one the quickstart adapts
    file, _ = clip_load.SHIPPED[name]
    damaged = bytearray((clip_load.ASSETS / file).read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (tmp_path / file).write_bytes(damaged)
    monkeypatch.setattr(clip_load, "ASSETS", tmp_path)
    with pytest.raises(SystemExit, match=f"{re.escape(str(tmp_path / file))} has SHA256 .*git checkout"):
        clip_load.load_clip(name)
    (tmp_path / file).unlink()
    with pytest.raises(SystemExit, match=f"{re.escape(str(tmp_path / file))} is missing"):
        adapt.main([*CPU, "--data-root", str(tmp_path), "--epochs", "1", "--preset", "mini"])


def test_the_mini_banner_says_which_clip_it_adapts(tmp_path, capsys):
    """--preset mini with a shipped name says the shipped file is adapted; with a file of one's own (a pretrain.py
    export) it does not claim the shipped one, and its settings line names that file."""
    snap = tmp_path / "pretrained.pt"
    torch.save({"model": load_clip("mini64-synth").state_dict()}, snap)
    ctx = train_utils.setup(0, "cpu", "off")
    for clip in ("mini64-synth", str(snap)):
        adapt.banner(ctx, adapt.settings(["--preset", "mini", "--clip", clip, "--data-root", str(tmp_path)]))
        out = capsys.readouterr().out
        shipped = clip in clip_load.SHIPPED
        assert ("PRETRAINED ON SYNTHETIC SCENES" in out) == shipped, out
        assert (clip_load.SHIPPED[clip][0] if shipped else f"clip={snap}") in out, out


def shared_captions():
    texts = []
    for f in sorted((SHARED / "data").glob("**/*.json")):
        for entry in json.loads(f.read_text()) if isinstance(json.loads(f.read_text()), list) else []:
            texts += entry.get("sentences", entry.get("sents", []))
    return texts


def test_tokenizer_known_ids_and_edge_cases():
    assert tokenize("a diagram")[0, :4].tolist() == [49406, 320, 22697, 49407]  # openai/CLIP README example
    assert tokenize("")[0, :3].tolist() == [49406, 49407, 0]
    assert torch.equal(tokenize("  The   CUBE\t\n"), tokenize("the cube"))
    assert torch.equal(tokenize("a &amp;amp; b"), tokenize("a & b"))  # html-unescaped twice
    with pytest.raises(ValueError, match="longer than context length"):
        tokenize("word " * 40, context_length=32)
    ids = tokenize("word " * 40, context_length=32, truncate=True)[0]
    assert ids[-1].item() == 49407 and ids.shape == (32,)
    assert decode(tokenize("the small red metal cube changed to blue")[0]) == "the small red metal cube changed to blue"


@pytest.mark.slow
def test_tokenizer_roundtrips_real_captions():
    texts = shared_captions()
    if not texts:
        pytest.skip("../shared/data absent")
    texts = texts[::14]  # about 2,000 of the 28,788 real sentences: keeps the suite fast
    ids = tokenize(texts, truncate=True)
    again = tokenize([decode(row) for row in ids], truncate=True)
    assert torch.equal(ids, again)
    st = openai_module("simple_tokenizer")
    if st is not None:
        ref = st.SimpleTokenizer()
        for text, row in zip(texts, ids):
            want = ([49406] + ref.encode(text) + [49407])[:76]
            assert row[:len(want)].tolist()[:75] == want[:75], text


def test_preprocess_any_mode():
    rgb = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    x = preprocess(Image.fromarray(rgb), 32)
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    white16 = Image.fromarray(np.full((20, 30), 65535, dtype=np.uint16))  # 16-bit: must not clip to garbage
    white8 = Image.fromarray(np.full((20, 30), 255, dtype=np.uint8))
    assert_close(preprocess(white16, 16), preprocess(white8, 16))
    mean = torch.tensor(clip_load.MEAN).view(3, 1, 1)
    std = torch.tensor(clip_load.STD).view(3, 1, 1)
    assert_close(preprocess(white8, 8), ((1 - mean) / std).expand(3, 8, 8))
    # every mode gives the image's own colours: lossless conversions equal the RGB original
    four = np.array([[200, 30, 30], [30, 200, 30], [30, 30, 200], [240, 240, 240]], dtype=np.uint8)[
        np.random.default_rng(1).integers(0, 4, (40, 60))]  # 4 colours: a palette holds them exactly
    want = preprocess(Image.fromarray(four), 24)
    for image in (Image.fromarray(four).convert("RGBA"), Image.fromarray(four).quantize(4),
                  Image.fromarray(four).convert("CMYK")):
        assert_close(preprocess(image, 24), want), image.mode
    grey = preprocess(Image.fromarray(rgb).convert("L"), 24) * std + mean  # back to 0..1: three equal channels
    assert_close(grey[0], grey[1])
    assert_close(grey[1], grey[2])
    assert_close(grey[0], preprocess(Image.fromarray(rgb).convert("L").convert("RGB"), 24)[0] * std[0] + mean[0])
    assert_close(preprocess(white8.convert("1"), 24), preprocess(white8, 24))


def test_16_bit_and_float_images_scale_by_their_depth(tmp_path):
    # a dark 16-bit image stays dark (it used to be read as 8-bit, 256x too bright), and the rule is the mode's,
    # not each image's own maximum: both images of a pair scale alike
    dark = np.full((20, 30), 1000, dtype=np.uint16)
    dark[5:9, 5:9] = 3000
    Image.fromarray(dark).save(tmp_path / "dark16.png")  # PIL reads a 16-bit PNG back in mode I or I;16
    read = clip_load.open_image(tmp_path / "dark16.png")
    assert read.mode.startswith("I")
    grey = np.asarray(clip_load.to_rgb(read))[..., 0]
    assert grey[0, 0] == round(1000 / 65535 * 255) == 4 and grey[6, 6] == round(3000 / 65535 * 255) == 12
    half = np.full((20, 30), 0.5, dtype=np.float32)
    assert np.asarray(clip_load.to_rgb(Image.fromarray(half, "F")))[0, 0, 0] == 128
    before, after = dark.copy(), dark.copy()
    after[10:12, 10:12] = 65535  # the after image alone has a bright spot: the rest must read the same in both
    b, a = (np.asarray(clip_load.to_rgb(Image.fromarray(x)))[..., 0] for x in (before, after))
    assert (b == a)[:10].all() and b[0, 0] == a[0, 0] == 4 and a[10, 10] == 255


def test_preprocess_keeps_channels_and_orientation():
    """A non-square image whose red grows left to right, green top to bottom, blue constant: a channel swap or an
    H/W transpose in preprocessing changes which axis each channel grows along."""
    h, w = 24, 40
    rgb = np.zeros((h, w, 3), dtype=np.uint8)
    rgb[..., 0] = np.linspace(0, 255, w).astype(np.uint8)[None, :]
    rgb[..., 1] = np.linspace(0, 255, h).astype(np.uint8)[:, None]
    rgb[..., 2] = 200
    x = clip_load.resize_uint8(Image.fromarray(rgb), 32).float()  # (3, 32, 32) before the mean/std
    assert x[0, :, -1].mean() - x[0, :, 0].mean() > 200 and (x[0, -1] - x[0, 0]).abs().max() < 3  # red along W
    assert x[1, -1].mean() - x[1, 0].mean() > 200 and (x[1, :, -1] - x[1, :, 0]).abs().max() < 3  # green along H
    assert (x[2] - 200).abs().max() < 2
    mean, std = torch.tensor(clip_load.MEAN).view(3, 1, 1), torch.tensor(clip_load.STD).view(3, 1, 1)
    assert_close(preprocess(Image.fromarray(rgb), 32), (x / 255 - mean) / std)


# -------------------------------------------------------------------------------------------------------------
# data.py: dataset loaders (real annotation files), errors, the image cache and its races, batching

def test_resolve_root_falls_back_to_synthetic_once(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    root = data.resolve_root("clevr", synth_pairs=5, synth_size=(48, 32), workers=1)
    out = capsys.readouterr().out
    assert root == Path(synth.SYNTH_ROOT) and "SYNTHETIC" in out and "README 'Real data and OpenAI's weights'" in out
    assert len(data.load_items("clevr", root, "train", "semantic")) == 5 - 1 - 1
    stamp = (root / "splits.json").stat().st_mtime_ns
    assert data.resolve_root("clevr", synth_pairs=5, synth_size=(48, 32)) == root
    assert (root / "splits.json").stat().st_mtime_ns == stamp  # cached, not rendered again
    assert data.resolve_root("spot") == Path("data/spot_the_diff")
    assert data.resolve_root("clevr", root="elsewhere") == Path("elsewhere")


# real annotation files with placeholder images
@pytest.mark.skipif(not (SHARED / "data" / "spot_the_diff").is_dir(), reason="needs ../shared/data")
def test_spot_the_diff_real_annotations(tmp_path):
    root = tmp_path / "spot"
    shutil.copytree(SHARED / "data" / "spot_the_diff", root / "annotations")
    ids = {str(d["img_id"]) for d in json.loads((root / "annotations" / "test.json").read_text())}
    placeholders([root / "resized_images" / f"{i}{s}.png" for i in ids for s in ("", "_2")])
    items = data.load_items("spot", root, "test")
    # 1,270 pairs and 2,107 sentences in the file; 7 sentences are empty, the only ones of their 7 pairs
    assert len(items) == 1270 - 7 and sum(len(it.captions) for it in items) == 2107 - 7
    assert all(it.change_type is None and it.after.endswith(f"{it.id}_2.png") for it in items)
    with pytest.raises(SystemExit,
                       match=r"image\(s\) of spot val missing, first .*resized_images.*README 'Real data and OpenAI's"):
        data.load_items("spot", root, "val")  # placeholders only for test
    (root / "annotations" / "val.json").unlink()
    with pytest.raises(SystemExit, match=r"missing .*val\.json.*README 'Real data and OpenAI's weights'"):
        data.load_items("spot", root, "val")


@pytest.mark.skipif(not (SHARED / "data" / "spot_the_diff").is_dir() or not AUTHORS.is_dir(),
                    reason="needs ../shared/data and the authors' code in ../shared/reference/authors_clip4idc")
def test_spot_the_diff_references_are_the_authors(tmp_path):
    """Our Spot-the-Diff test references against the authors' (gt/spot_total_change_captions_reformat.json, the file
    their evaluation scores against): the same caption lists, in order, for 1,263 of its 1,270 pairs; the other 7 hold
    one empty caption, which ours leaves out (README)."""
    root = tmp_path / "spot"
    shutil.copytree(SHARED / "data" / "spot_the_diff", root / "annotations")
    ids = {str(d["img_id"]) for d in json.loads((root / "annotations" / "test.json").read_text())}
    placeholders([root / "resized_images" / f"{i}{s}.png" for i in ids for s in ("", "_2")])
    ours = {it.id: it.captions for it in data.load_items("spot", root, "test")}
    gt = json.loads((AUTHORS / "gt" / "spot_total_change_captions_reformat.json").read_text())
    theirs = defaultdict(list)
    for a in gt["annotations"]:
        theirs[a["image_id"].removesuffix(".png")].append(a["caption"])
    assert {k: v for k, v in theirs.items() if k in ours} == ours and len(theirs) == 1270
    assert all(v == [""] for k, v in theirs.items() if k not in ours) and len(theirs) - len(ours) == 7


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
    counts = {t: sum(it.change_type == t for it in items) for t in synth.CHANGES + ("distractor",)}
    assert sum(counts.values()) == len(items) and counts["distractor"] == 1988 and min(counts.values()) > 300


# errors a person can act on
def test_errors_name_the_path(synth_set, tmp_path):
    with pytest.raises(SystemExit, match=r"no clevr dataset at .*nowhere.*README 'Real data and OpenAI's weights'"):
        data.load_items("clevr", tmp_path / "nowhere", "train")
    broken = tmp_path / "broken"
    shutil.copytree(synth_set, broken)
    (broken / "type_mapping.json").unlink()
    with pytest.raises(SystemExit, match=r"lacks type_mapping\.json.*README 'Real data and OpenAI's weights'"):
        data.load_items("clevr", broken, "train")
    shutil.copy(synth_set / "type_mapping.json", broken)
    victim = data.load_items("clevr", broken, "train", "semantic")[0]
    Path(victim.after).unlink()
    with pytest.raises(SystemExit, match=rf"missing, first {re.escape(victim.after)}.*--skip-missing"):
        data.load_items("clevr", broken, "train", "semantic")
    n = len(data.load_items("clevr", synth_set, "train", "semantic"))
    assert len(data.load_items("clevr", broken, "train", "semantic", skip_missing=True)) == n - 1
    shutil.copy(synth_set / "sc_images" / Path(victim.after).name, victim.after)
    Path(victim.before).write_bytes(b"not a png")  # present but unreadable: fails when decoded, naming it
    items = data.load_items("clevr", broken, "train", "total")
    with pytest.raises(OSError, match=rf"{re.escape(victim.before)}.*README 'Real data and OpenAI's weights'"):
        data.ImageDataset(items, 32)[0]
    assert len(data.load_items("clevr", broken, "train", "total", skip_missing=True)) == len(items) - 2
    with pytest.raises(SystemExit, match="unknown dataset"):
        data.resolve_root("coco")


# datasets and batching
def test_datasets(synth_set):
    items = data.load_items("clevr", synth_set, "train", "semantic")
    ds = data.CaptionDataset(items, size=32, context_length=32)
    assert len(ds) == sum(len(it.captions) for it in items)
    s = ds[7]
    before, after, tokens, i = s["before"], s["after"], s["ids"], s["index"]
    assert before.shape == after.shape == (3, 32, 32) and before.dtype == torch.uint8  # normalized on the device
    assert tokens.shape == (32,) and tokens[0] == 49406 and (i, 7) == (ds.samples[7][0], 7)
    first = [k for k, (owner, _) in enumerate(ds.samples) if owner == i][0]  # the item's first caption's sample
    assert torch.equal(tokens, tokenize(items[i].captions[7 - first], 32)[0])
    assert torch.equal(clip_load.normalize(before), load_image(items[i].before, 32))  # what the model sees
    swapped = data.CaptionDataset(items, size=32, swap_prob=1.0)[7]["before"]
    assert torch.equal(clip_load.normalize(swapped), load_image(items[i].alt_before, 32))
    s = data.ImageDataset(items, size=32)[2]
    a, i = s["after"], s["index"]
    assert set(s) == {"before", "after", "index"} and i == 2
    assert torch.equal(clip_load.normalize(a), load_image(items[2].after, 32))


def test_drawn_captions_and_features_in_place_of_images(synth_set):
    """caption.py's training samples: one per pair, its caption drawn from (seed, epoch, pair) among the pair's
    own, every caption drawn over the epochs; a frozen encoder's features replace the images, batches included."""
    items = data.load_items("clevr", synth_set, "train", "total")
    rows = torch.arange(sum(len(it.captions) for it in items))[:, None].repeat(1, 3)  # row r holds r: its own id
    owner = [i for i, it in enumerate(items) for _ in it.captions]
    feats = torch.randn(len(items), 5, 4)
    ds = data.CaptionDataset(items, 32, ids=rows, draw=True, seed=3, features=feats)
    assert len(ds) == len(items)
    seen = set()
    for epoch in range(40):
        ds.epoch = epoch
        for i in (0, 5):
            f, ids, j = (ds[i][k] for k in ("features", "ids", "index"))
            r = int(ids[0])
            assert j == i and owner[r] == i and torch.equal(f, feats[i])  # one of the pair's own captions
            assert r - owner.index(i) == data.sample_rng(3, epoch, i).integers(len(items[i].captions))
            seen.add(r)
    assert seen == {r for r, o in enumerate(owner) if o in (0, 5)}  # every caption of the two pairs, in 40 epochs
    f, ids, idx = ds.__getitems__([4, 1]).values()  # a whole batch, as the loader asks for it (no images)
    assert torch.equal(f, feats[[4, 1]]) and idx.tolist() == [4, 1] and ids.shape == (2, 3)
    ds.epoch = 0
    images = data.CaptionDataset(items, 32, ids=rows, draw=True, seed=3)[5]  # epoch 0 too
    assert list(images) == ["before", "after", "ids", "index"] and images["before"].shape == (3, 32, 32)
    assert torch.equal(images["ids"], ds[5]["ids"]) and images["index"] == 5  # the same draw as with features
    f, i = data.ImageDataset(items, 32, features=feats)[2].values()
    assert i == 2 and torch.equal(f, feats[2])


def test_annotation_files_of_the_wrong_shape_say_so(tmp_path):
    spot = tmp_path / "spot"
    (spot / "annotations").mkdir(parents=True)
    cases = {  # what the file holds -> what the message must say
        '{"img_id": 1, "sentences": ["a"]}': "Spot-the-Diff annotations",  # not a list
        '[{"sentences": ["a"]}]': "img_id",  # a missing key
        '[{"img_id": 1, "sentences": "a car moved"}]': "sentences",  # captions not a list
        '[{"img_id": 1, "sentences": [3]}]': "sentences",
    }
    for text, says in cases.items():
        (spot / "annotations" / "train.json").write_text(text)
        with pytest.raises(SystemExit, match=rf"train\.json is not in the expected format.*{says}"):
            data.load_items("spot", spot, "train")
    ier = tmp_path / "ier"
    ier.mkdir()
    (ier / "train.json").write_text('[{"img0": "a.jpg", "sents": ["x"], "uid": 1}]')
    with pytest.raises(SystemExit, match=r"train\.json is not in the expected format.*img1"):
        data.load_items("ier", ier, "train")
    clevr = tmp_path / "clevr"
    for d in ("images", "sc_images", "nsc_images"):
        (clevr / d).mkdir(parents=True)
    files = {"change_captions.json": {"CLEVR_default_000001.png": ["a cube moved"]},
             "no_change_captions.json": {"CLEVR_default_000001.png": ["no change"]},
             "type_mapping.json": {"move": ["000001.png"]}, "splits.json": {"train": ["1"], "val": [], "test": []}}
    for f, obj in files.items():
        (clevr / f).write_text(json.dumps(obj))
    placeholders([clevr / d / f"CLEVR_{n}_000001.png" for d, n in
                  (("images", "default"), ("sc_images", "semantic"), ("nsc_images", "nonsemantic"))])
    assert [it.id for it in data.load_items("clevr", clevr, "train")] == ["000001", "000001_n"]  # "1" is read as 1
    for f, bad, says in (("splits.json", {"train": ["one"]}, "integer image ids"),
                         ("splits.json", [1, 2], "split ids"),
                         ("change_captions.json", {"CLEVR_default_000001.png": "a cube moved"}, "captions"),
                         ("type_mapping.json", {"move": "000001.png"}, "change type")):
        (clevr / f).write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=rf"{f.replace('.', '[.]')} is not in the expected format.*{says}"):
            data.load_items("clevr", clevr, "train")
        (clevr / f).write_text(json.dumps(files[f]))


def test_levir_cc_layout(tmp_path):
    root = tmp_path / "levir"
    entries = [{"filename": f"{s}_{i:06d}.png", "split": s, "sentences": [{"raw": f" a road was built {i} .",
                                                                           "tokens": ["a"]}, {"raw": " "}]}
               for s, n in (("train", 3), ("val", 2), ("test", 1)) for i in range(n)]
    root.mkdir()
    (root / "LevirCCcaptions.json").write_text(json.dumps({"images": entries}))
    rng = np.random.default_rng(0)
    for e in entries:
        for side in ("A", "B"):
            (root / "images" / e["split"] / side).mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
                root / "images" / e["split"] / side / e["filename"])
    items = data.load_items("levir", root, "train")
    assert [it.id for it in items] == ["train_000000", "train_000001", "train_000002"]
    assert items[1].captions == ["a road was built 1 ."]  # raw text, stripped; the empty one left out
    assert items[1].before.endswith("images/train/A/train_000001.png") and "/B/" in items[1].after
    assert len(data.load_items("levir", root, "val")) == 2 and len(data.load_items("levir", root, "test")) == 1
    b, a, _ = data.ImageDataset(items, 32)[0].values()
    assert b.shape == a.shape == (3, 32, 32) and not torch.equal(a, b)
    (root / "LevirCCcaptions.json").write_text(json.dumps({"images": [{"filename": "x.png", "split": "train"}]}))
    with pytest.raises(SystemExit, match="LevirCCcaptions.json is not in the expected format"):
        data.load_items("levir", root, "train")


def own_pairs(root, entries, size=(60, 40)):
    """A --data pairs folder: pairs.json of `entries`, every image they name drawn (random)."""
    rng = np.random.default_rng(0)
    for e in entries:
        for side in ("before", "after"):
            if not (root / e[side]).exists():
                (root / e[side]).parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / e[side])
    (root / data.PAIRS).write_text(json.dumps(entries))
    return root


def readme_pairs():
    """README's example pairs.json, as shown."""
    text = (Path(__file__).resolve().parent / "README.md").read_text()
    return json.loads(re.search(r"## Your own image pairs.*?```json\n(.*?)```", text, re.S).group(1))


def test_your_own_pairs_and_each_bad_entry(tmp_path, capsys):
    root = own_pairs(tmp_path / "mine", readme_pairs())  # README's three entries, one per split
    for k, split in enumerate(("train", "val", "test")):
        (it,) = data.load_items("pairs", root, split)
        assert (it.id, it.captions) == (str(k), readme_pairs()[k]["captions"])
        assert it.before == str(root / readme_pairs()[k]["before"]) and Path(it.after).is_file()
    good = readme_pairs()
    bad = {"unknown split": ({"split": "dev"}, "entry 3 (from 0): its split 'dev' is not train, val or test"),
           "no caption": ({"captions": ["", " "]}, "entry 3 (from 0): its caption list is empty"),
           "repeated pair": ({"before": good[0]["before"], "after": good[0]["after"]},
                             "entry 3 (from 0): it repeats entry 0's"),
           "missing image": ({"after": "gone.png"}, f"entry 3 (from 0): no image at {root / 'gone.png'}: fix its path"),
           "malformed entry": ({"captions": "the cube moved"}, 'entry 3 (from 0): it needs "before" and "after" paths')}
    for kind, (change, message) in bad.items():
        entries = good + [{**good[1], "before": "extra_a.png", "after": "extra_b.png", **change}]
        own_pairs(root, entries)
        if kind == "missing image":
            (root / "gone.png").unlink()
        with pytest.raises(SystemExit, match=re.escape(message) + r".*\(or --skip-missing drops such entries\)"):
            data.load_items("pairs", root, "val")
        assert [it.id for it in data.load_items("pairs", root, "val", skip_missing=True)] == ["1"]
        assert [it.id for it in data.load_items("pairs", root, "train", skip_missing=True)] == ["0"]
        assert capsys.readouterr().out == f"--skip-missing: dropped 1 of 4 entries of {root / data.PAIRS} (1 {kind})\n"
    # a repeat of a dropped entry is kept
    own_pairs(root, [{**good[0], "split": "Train"}, *good])
    assert [it.id for it in data.load_items("pairs", root, "train", skip_missing=True)] == ["1"]
    (root / data.PAIRS).write_text(json.dumps([e for e in good if e["split"] != "test"]))
    with pytest.raises(SystemExit, match='has no test pair: give some entries "split": "test"'):
        data.load_items("pairs", root, "test")
    (root / data.PAIRS).write_text(json.dumps({"before": "a.png"}))
    with pytest.raises(SystemExit, match=r"pairs.json is not in the expected format: a list .*Your own image pairs"):
        data.load_items("pairs", root, "train")
    with pytest.raises(SystemExit, match=r"no pairs dataset at .*see README 'Your own image pairs'"):
        data.load_items("pairs", tmp_path / "absent", "train")


def test_empty_captions_are_not_trained_on(synth_set, tmp_path, capsys):
    # Spot-the-Diff's case through its loader: empty strings are gone and a pair with none is left out, counted
    spot = tmp_path / "spot"
    (spot / "annotations").mkdir(parents=True)
    (spot / "annotations" / "train.json").write_text(json.dumps([
        {"img_id": 1, "sentences": ["", "the red car moved", " "]}, {"img_id": 2, "sentences": [""]},
        {"img_id": 3, "sentences": ["a man left"]}]))
    placeholders([spot / "resized_images" / f"{i}{s}.png" for i in (1, 2, 3) for s in ("", "_2")])
    items = data.load_items("spot", spot, "train")
    assert [(it.id, it.captions) for it in items] == [("1", ["the red car moved"]), ("3", ["a man left"])]
    assert "3 empty caption(s) ignored; 1 pair(s) with no caption left out" in capsys.readouterr().out
    assert [s for s in data.CaptionDataset(items, 16).samples] == [(0, 0), (1, 1)]


@pytest.mark.slow
@pytest.mark.subprocess
def test_cache_build_stops_on_a_truncated_image(synth_set, tmp_path):
    """A truncated PNG met while decoding into the ImageCache (a Pool of workers) ends the run within seconds with
    a message naming the file; it used to end a worker and leave the pool waiting forever."""
    broken = tmp_path / "broken"
    shutil.copytree(synth_set, broken)
    victim = data.load_items("clevr", broken, "val", "total")[1].after
    Path(victim).write_bytes(Path(victim).read_bytes()[:300])
    code = (f"import data; items = data.load_items('clevr', {str(broken)!r}, 'val', 'total'); "
            f"data.ImageCache(items, 32, workers=2)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parent)
    assert r.returncode != 0 and victim in r.stderr and "readable image" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("damage", ["truncated", "zero bytes", "text named .png"])
def test_streaming_stops_on_a_bad_image(synth_set, tmp_path, damage):
    """adapt.py streaming its images through 2 DataLoader workers meets an undecodable image: it ends within
    seconds, naming the file and what to do, without a traceback; --skip-missing decodes every image first and
    drops that pair, counted."""
    broken = tmp_path / "broken"
    shutil.copytree(synth_set, broken)
    victim = data.load_items("clevr", broken, "train", "semantic")[2].after
    raw = Path(victim).read_bytes()
    Path(victim).write_bytes({"truncated": raw[:300], "zero bytes": b"", "text named .png": b"a caption\n"}[damage])
    cmd = [sys.executable, "adapt.py", "--data-root", str(broken), *TINY_ADAPT, "--epochs", "1", "--workers", "2",
           "--no-image-cache", "--out", str(tmp_path / "a.pt")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=Path(__file__).resolve().parent)
    assert r.returncode != 0 and f"cannot read image {victim}" in r.stderr and "--skip-missing" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr  # one line: the message
    if damage == "truncated":  # the header reads fine: only a full decode finds it
        r = subprocess.run(cmd + ["--skip-missing"], capture_output=True, text=True, timeout=180,
                           cwd=Path(__file__).resolve().parent)
        assert r.returncode == 0 and "--skip-missing: dropped 1 of" in r.stdout, r.stderr[-2000:]


def test_cache_equals_streaming(synth_set, tmp_path):
    items = data.load_items("clevr", synth_set, "train", "total")
    cache = data.ImageCache(items, size=48, workers=2, directory=tmp_path)
    assert cache.built and cache.data.dtype == torch.uint8 and cache.data.shape[1:] == (3, 48, 48)
    assert isinstance(cache.array, np.memmap)  # read from the file, not held in memory
    streamed, cached = data.ImageDataset(items, 48), data.ImageDataset(items, 48, cache=cache)
    for k in range(len(items)):
        assert all(torch.equal(streamed[k][f], cached[k][f]) for f in ("before", "after"))
    # whole batches (one sorted read per column) equal sample by sample, in the sampler's order
    keys = [5, 0, 3, 3, 1]
    for batch, one_by_one in ((cached.__getitems__(keys), [cached[k] for k in keys]),
                              (streamed.__getitems__(keys), [streamed[k] for k in keys])):
        assert all(torch.equal(col, torch.stack([s[f] for s in one_by_one]) if f != "index" else torch.tensor(
            [s[f] for s in one_by_one])) for f, col in batch.items())
    caps = data.CaptionDataset(items, 48, swap_prob=0.5, cache=cache)
    keyed = [7, 2, 7]
    for f, col in caps.__getitems__(keyed).items():
        want = [caps[k][f] for k in keyed]
        assert torch.equal(col, torch.stack(want) if torch.is_tensor(want[0]) else torch.tensor(want))
    # through a DataLoader with 2 workers: the same batches as streaming
    batches = lambda ds: [b for b in data.make_loader(ds, 4, shuffle=True, workers=2, seed=3)]
    for a, b in zip(batches(streamed), batches(cached)):
        assert a.keys() == b.keys() and all(torch.equal(a[f], b[f]) for f in a)


def test_cache_is_reused_and_follows_its_images(synth_set, tmp_path):
    items = data.load_items("clevr", synth_set, "test", "total")
    first = data.ImageCache(items, 32, workers=2, directory=tmp_path)
    again = data.ImageCache(items, 32, workers=2, directory=tmp_path)
    assert first.built and not again.built and again.folder == first.folder
    assert data.ImageCache(items, 24, workers=2, directory=tmp_path).folder != first.folder  # another size
    copy = tmp_path / "copy"
    shutil.copytree(synth_set, copy)
    moved = data.load_items("clevr", copy, "test", "total")
    assert data.ImageCache(moved, 32, workers=2, directory=tmp_path).folder != first.folder  # another root
    victim = Path(moved[0].after)
    Image.open(victim).transpose(Image.FLIP_LEFT_RIGHT).save(victim)  # the image changed: a new cache
    changed = data.ImageCache(moved, 32, workers=2, directory=tmp_path)
    assert changed.built and torch.equal(changed[str(victim)], data.ImageDataset(moved, 32)[0]["after"])


def test_a_killed_cache_build_is_never_read(synth_set, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(synth_set, broken)
    items = data.load_items("clevr", broken, "train", "total")
    victim = Path(items[3].after)
    good = victim.read_bytes()
    victim.write_bytes(good[:200])  # the build stops halfway, on this file
    with pytest.raises(SystemExit, match=re.escape(str(victim))):
        data.ImageCache(items, 32, workers=2, directory=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # nothing left that a later run could take for a cache
    victim.write_bytes(good)
    cache = data.ImageCache(items, 32, workers=2, directory=tmp_path / "cache")
    assert cache.built and torch.equal(cache[str(victim)], data.ImageDataset(items, 32)[3]["after"])


@pytest.mark.slow
@pytest.mark.subprocess
def test_cache_build_spares_a_live_build_and_takes_a_finished_one(synth_set, tmp_path):
    """Two runs on one cache folder: a second run started long into a first one's build leaves that build alone
    (writes through a memmap never update its folder's time, so age says nothing: its live pid does); a build that
    another process finished first is taken, not a crash; a killed build's leftovers go at once; and the folders
    are readable by the machine's other users as the umask says (a shared $CLIP4IDC_IMAGE_CACHE), not 0700."""
    items = data.load_items("clevr", synth_set, "test", "total")
    directory = tmp_path / "cache"
    old_umask = os.umask(0o022)
    live = None
    try:
        folder = data.ImageCache(items, 32, workers=1, directory=directory).folder
        assert folder.stat().st_mode & 0o777 == 0o755
        shutil.rmtree(folder)
        code = ("import pathlib, sys, time, data; tmp = data._start_build(pathlib.Path(sys.argv[1])); "
                "print(tmp, flush=True); time.sleep(300)")
        live = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parent)
        tmp = Path(live.stdout.readline().strip())
        assert tmp.is_dir() and tmp.name.startswith(folder.name + ".tmp")
        os.utime(tmp, (time.time() - 3600, time.time() - 3600))  # it started an hour ago
        second = data.ImageCache(items, 32, workers=1, directory=directory)
        assert second.built and tmp.is_dir()  # the live build is still there
        # the first build finishes after the second: the cache is there already, and it is the same
        paths = data.image_paths(items)
        data._build_cache(folder, paths, 32, 1, 0)
        assert np.array_equal(np.load(folder / "images.npy"), second.array)
        assert sorted(p.name for p in directory.iterdir()) == sorted([folder.name, tmp.name])  # no new leftover
        live.kill()  # SIGKILL: its process is gone, and the next build clears what it left
        live.wait(timeout=30)
        shutil.rmtree(folder)
        data.ImageCache(items, 32, workers=1, directory=directory)
        assert [p.name for p in directory.iterdir()] == [folder.name]
    finally:
        os.umask(old_umask)
        if live is not None and live.poll() is None:
            live.kill()


def test_loader_reproducible(synth_set):
    items = data.load_items("clevr", synth_set, "train", "semantic")
    ds = data.CaptionDataset(items, size=16, swap_prob=0.5)
    batches = lambda loader: [torch.cat([b["before"].flatten(1), b["ids"]], 1) for b in loader]
    a = data.make_loader(ds, 8, shuffle=True, workers=0, seed=3)
    b = data.make_loader(ds, 8, shuffle=True, workers=2, seed=3)  # workers draw the same swaps: (seed, epoch, index)
    for epoch in (0, 1):
        data.set_epoch(a, epoch)
        data.set_epoch(b, epoch)
        assert all(torch.equal(x, y) for x, y in zip(batches(a), batches(b)))
    first = [x["index"] for x in a]
    data.set_epoch(a, 0)
    assert not all(torch.equal(x, y) for x, y in zip(first, [x["index"] for x in a]))  # a new order each epoch
    swapped = lambda epoch: [ds.parts(k)[0]["before"] == items[ds.samples[k][0]].alt_before for k in range(len(ds))]
    ds.epoch = 0
    at0 = swapped(0)
    ds.epoch = 1
    assert at0 != swapped(1) and 0.3 < np.mean(at0) < 0.7  # about half swapped, anew each epoch
    assert not b.pin_memory and data.make_loader(ds, 8, device="cuda").pin_memory
    last = data.make_loader(ds, 8, drop_last=True)
    assert len(last) == len(ds) // 8


# -------------------------------------------------------------------------------------------------------------
# synth.py: the synthetic set, its captions and scene descriptions, reading captions back

# synthetic CLEVR-Change
def test_synth_roundtrip(synth_set):
    splits = json.loads((synth_set / "splits.json").read_text())
    assert sorted(sum(splits.values(), [])) == list(range(20)) and all(splits.values())
    seen = []
    for split in ("train", "val", "test"):
        sem = data.load_items("clevr", synth_set, split, "semantic")
        total = data.load_items("clevr", synth_set, split, "total")
        assert [it.id for it in sem] == [f"{i:06d}" for i in splits[split]]
        assert len(total) == 2 * len(sem)
        for it in sem:
            assert it.change_type in synth.CHANGES and Path(it.alt_before).name.startswith("CLEVR_nonsemantic")
            assert 4 <= len(it.captions) <= 6 and len(set(it.captions)) == len(it.captions)
            assert Image.open(it.after).size == SIZE
        for it in total[1::2]:
            assert it.change_type == "distractor" and it.alt_before is None
            assert it.captions[0] in synth.NO_CHANGE and it.after.endswith(f"CLEVR_nonsemantic_{it.id[:6]}.png")
        seen += sem
    assert {it.change_type for it in seen} == set(synth.CHANGES)  # 20 uniform draws of 5 types, seed 0


def test_synth_deterministic(synth_set, tmp_path):
    again = synth.make_synth(tmp_path / "again", pairs=20, seed=0, size=SIZE, workers=1)  # other worker split
    other = synth.make_synth(tmp_path / "other", pairs=3, seed=1, size=SIZE, workers=1)
    for f in ("change_captions.json", "splits.json", "type_mapping.json"):
        assert (again / f).read_text() == (synth_set / f).read_text()
    name = "sc_images/CLEVR_semantic_000002.png"
    assert np.array_equal(np.asarray(Image.open(again / name)), np.asarray(Image.open(synth_set / name)))
    assert not np.array_equal(np.asarray(Image.open(other / name)), np.asarray(Image.open(synth_set / name)))


def test_synth_change_view_is_near(synth_set):
    """The change image's camera moves by 0-0.3 jitter units, the distractor's by 0.5-1, so the change
    image differs from the default one less than the distractor does."""
    img = lambda d, name, i: np.asarray(Image.open(synth_set / d / f"CLEVR_{name}_{i:06d}.png"), dtype=float)
    moved = lambda d, name: np.mean([np.abs(img(d, name, i) - img("images", "default", i)).mean() for i in range(20)])
    assert moved("sc_images", "semantic") < 0.7 * moved("nsc_images", "nonsemantic")
    assert set(json.loads((synth_set / "synth.json").read_text())) == {"pairs", "size", "seed", "version"}


def test_synth_views_say_where_each_object_is(synth_set):
    """views (what pretrain.py probes) remakes each image as it is on disk, and the ray through the pixel where it
    says an object is meets that object."""
    picture = lambda i: np.asarray(Image.open(synth_set / f"images/CLEVR_default_{i:06d}.png"))
    for i in range(4):
        _, _, before, _, _, views = synth._scene(i, 0)
        _, jc, jl = views["images/CLEVR_default"]
        cam = synth.camera(jc)
        assert np.array_equal(synth.render(before, cam, synth.light(jl), *SIZE), picture(i))
        seen = synth.views(i, 0, size=SIZE)["images/CLEVR_default"]
        assert seen  # every object of these four before images in view
        for o, (u, v) in seen:
            ray = synth.rays(cam, *SIZE)[int(v * SIZE[1]), int(u * SIZE[0])]
            assert np.isfinite(synth.intersect(o, cam["pos"], ray[None])[0][0])


def test_synth_changes_are_what_the_type_says():
    for kind in synth.CHANGES:
        for s in range(10):
            rng = random.Random(s)
            before, after, k = synth.make_scene(rng, kind)
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


def test_referring_expressions_pick_out_one_visible_object():
    for s in range(300):
        rng = random.Random(s)
        kind = synth.CHANGES[s % 5]
        before, after, k = synth.make_scene(rng, kind)
        scene, o = (after, after[k]) if kind == "add" else (before, before[k])
        phrase = synth.refer(rng, o, scene, relate=0.5)
        assert synth.resolve(phrase, scene) == [o], (phrase, scene)


def test_captions_name_the_change():
    rng = random.Random(0)
    before, after, k = synth.make_scene(rng, "color")
    caps = synth.captions(rng, "color", before, after, k)
    assert len(caps) == 6
    new = set(synth.SAY.get(after[k]["color"], (after[k]["color"],)))
    assert all("color" in c or set(c.split()) & new for c in caps)


def test_captions_read_back_against_the_scene_records(synth_set):
    """Every reference caption of a rendered set, parsed with the renderer's templates, names its change type and
    exactly the changed object of scenes.json; the no-change sentences read as no change."""
    scenes = synth.read_scenes(synth_set)
    change = json.loads((synth_set / "change_captions.json").read_text())
    same = json.loads((synth_set / "no_change_captions.json").read_text())
    assert len(scenes) == 20
    for i, scene in scenes.items():
        for c in change[f"CLEVR_default_{i}.png"]:
            assert synth.judge(c, scene) == {"change": True, "type": True, "object": True}, (c, scene)
        assert all(synth.read(c) == ("no change", None) for c in same[f"CLEVR_default_{i}.png"])


DEV = SHARED / "data" / "real_clevr_change_dev"  # 25 triples from CLEVR-Change's own generator (measure, never train)


@pytest.mark.skipif(not DEV.is_dir(), reason="needs ../shared/data/real_clevr_change_dev")
def test_clevr_scene_records_read_their_own_references_back():
    """CLEVR-Change's own captions (its change phrases, "left of", "both ... and ...", "the other X that is the same
    colour as the Y") against CLEVR's scene records of the development set: every reference names its change type
    and exactly the changed object, by CLEVR's own spatial relations; every no-change sentence reads as no change."""
    scenes = synth.read_scenes(DEV)
    change = json.loads((DEV / "change_captions.json").read_text())
    same = json.loads((DEV / "no_change_captions.json").read_text())
    assert len(scenes) == 25 and {r["type"] for r in scenes.values()} == set(synth.CHANGES)
    for i, scene in scenes.items():
        refs = change[f"CLEVR_default_{i}.png"]
        assert refs and all(synth.judge(c, scene) == {"change": True, "type": True, "object": True} for c in refs), i
        assert all(synth.read(c) == ("no change", None) for c in same[f"CLEVR_default_{i}.png"])
    assert not synth.is_synthetic(DEV)  # no attention figure: CLEVR's records hold no camera


@pytest.mark.skipif(not DEV.is_dir(), reason="needs ../shared/data/real_clevr_change_dev")
def test_clevr_images_place_each_object_on_its_pixels():
    """pretrain.py --clevr-root reads CLEVR's renders as it reads its own: every image of the development set with its
    objects at CLEVR's pixel_coords, as fractions of the width and height. A coloured object's centre is coloured
    (the floor is grey), so coordinates off the objects would show."""
    images = pretrain.clevr_images(DEV)
    assert len(images) == 75 and all(0 < u < 1 and 0 < v < 1 for _, objs in images for _, (u, v) in objs)
    sat, floor = [], []
    for path, objs in images:
        img = np.asarray(Image.open(path).convert("RGB"), dtype=float)
        h, w, _ = img.shape
        sat += [np.ptp(img[int(v * h), int(u * w)]) for o, (u, v) in objs if o["color"] != "gray"]
        floor.append(np.ptp(img[5, 5]))
    assert np.median(sat) > 4 * max(np.median(floor), 5)


def clevr_scene(objects, rel):
    """A CLEVR scene record: objects (size, color, material, shape) and relationships[r][j], the objects r of j."""
    keys = ("size", "color", "material", "shape")
    return {"objects": [dict(zip(keys, o.split())) for o in objects], "relationships": rel}


def test_clevr_scene_records_and_foreign_ones(tmp_path, capsys):
    """synth.read_scenes on CLEVR-format records: each change pair's objects, the changed one (in the after scene
    for "add"), and CLEVR's relations read the right way round (relationships["left"][j]: the objects left of j).
    A scenes.json of another format is skipped with one line, said once."""
    before = ["large red rubber cube", "small red metal cube", "large blue rubber sphere"]
    rel = {"left": [[1], [], [0, 1]], "right": [[2], [0, 2], []], "behind": [[], [], []], "front": [[], [], []]}
    added = {"left": [[1], [], [0, 1], [0, 1, 2]], "right": [[2, 3], [0, 2, 3], [3], []],
             "behind": [[], [], [], []], "front": [[], [], [], []]}
    records = [{"image_index": 0, "change": {"type": "color", "object_index": 1},
                "default_scene": clevr_scene(before, rel), "semantic_scene": clevr_scene(before, rel)},
               {"image_index": 7, "change": {"type": "add", "object_index": 3},
                "default_scene": clevr_scene(before, rel),
                "semantic_scene": clevr_scene(before + ["small gray metal cylinder"], added)}]
    (tmp_path / "scenes.json").write_text(json.dumps({"info": {}, "scenes": records}))
    scenes = synth.read_scenes(tmp_path)
    assert set(scenes) == {"000000", "000007"} and scenes["000007"]["changed"] == 3
    color = scenes["000000"]
    yes = {"change": True, "type": True, "object": True}
    assert synth.judge("the red cube that is left of the large cube turned blue", color) == yes  # 1 is left of 0
    assert synth.judge("the red cube that is right of the large cube turned blue", color)["object"] is False
    assert synth.judge("the other red cube that is the same size as the blue ball turned blue", color)["object"] \
        is False  # the same size as the large sphere: the large cube
    assert synth.judge("the other cube that is made of the same material as the blue sphere became green",
                       color)["object"] is False
    assert synth.judge("the thing that is both left of the large red cube and left of the sphere changed to gray",
                       color) == yes
    assert synth.judge("the cylinder on the right side of the red metal cube has been newly placed",
                       scenes["000007"]) == yes
    (tmp_path / "scenes.json").write_text(json.dumps([{"objects": []}]))
    assert synth.read_scenes(tmp_path) is None and synth.read_scenes(tmp_path) is None
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "a scenes.json of another format" in said[0] and str(tmp_path) in said[0]


@pytest.mark.slow
def test_an_evaluation_only_set_with_clevr_records(trained, tmp_path, capsys):
    """A trained captioner evaluated on a CLEVR-Change-layout set with no training pairs and CLEVR's scene records:
    the constant-caption baseline is the best of the fixed no-change sentences (there are no training captions),
    and the captions are read back against the records by change type; no attention figure."""
    tmp, _ = trained
    root = tmp_path / "clevr"
    shutil.copytree(tmp / "clevr", root)
    (root / "splits.json").write_text(json.dumps({"train": [], "val": [], "test": list(CHANGES)}))
    one = {"left": [[]], "right": [[]], "behind": [[]], "front": [[]]}
    scene = lambda objs: clevr_scene(objs, {r: [[] for _ in objs] for r in one})
    obj = {"drop": ["large gray rubber sphere"], "color": ["small red rubber cube"],
           "move": ["large green rubber cylinder"], "add": []}
    after = {**obj, "add": ["large purple metal sphere"]}
    records = [{"image_index": i, "change": {"type": t, "object_index": 0}, "default_scene": scene(obj[t]),
                "semantic_scene": scene(after[t])} for i, (t, _) in CHANGES.items()]
    (root / "scenes.json").write_text(json.dumps({"scenes": records}))
    res = evaluate_py.main([*CPU, "--ckpt", str(tmp / "captioner.pt"), "--data-root", str(root), "--results",
                            str(tmp_path / "r.json"), "--workers", "0"])
    out = capsys.readouterr().out
    assert res["baseline"]["candidates"].startswith("fixed") and res["baseline"]["caption"] in synth.NO_CHANGE
    assert "best of the fixed no-change sentences" in out and "read back against the scenes" in out
    judged = res["read_back"]  # the fixture's model says each tiny_clevr caption word for word
    assert judged["change pairs"] == 4 and judged["no change on distractors %"] == 100, judged
    assert judged["right type %"] == 100 and judged["right object %"] == 75, judged  # "the large gray sphere
    # made of rubber" is not a referring expression of either grammar
    assert res["attention"] is None


def test_clevr_renders_captions_read_back():
    """CLEVR-Change's own captions of assets/clevr_renders (its generator's phrases and referring expressions: "has
    been newly placed", "on the left side of") against CLEVR's scene records: each names its change type and exactly
    the changed object."""
    root = ASSETS / "clevr_renders"
    scenes, change = synth.read_scenes(root), json.loads((root / "change_captions.json").read_text())
    said = [(c, scenes[i]) for i in scenes for c in change[f"CLEVR_default_{i}.png"]]
    assert len(said) > 50 and all(synth.judge(c, s) == {"change": True, "type": True, "object": True} for c, s in said)
    assert any(c.endswith(("has been newly placed", "is in a different location")) for c, _ in said)


def test_judge_catches_wrong_captions():
    rng = random.Random(1)
    before, after, k = synth.make_scene(rng, "color")
    scene = {"type": "color", "before": before, "after": after, "changed": k}
    o, other = before[k], next(p for p in before if p is not before[k])
    full = lambda x: " ".join(x[a] for a in synth.ATTRS)  # size color material shape: names one object
    new = after[k]["color"]
    assert synth.judge(f"the {full(o)} turned {new}", scene) == {"change": True, "type": True, "object": True}
    assert synth.judge(f"the {full(other)} turned {new}", scene)["object"] is False  # another object
    assert synth.judge(f"the {full(o)} is now metal" if o["material"] == "rubber" else
                           f"the {full(o)} is now rubber", scene)["type"] is False  # "is now" + a material
    assert synth.judge(f"the {full(o)} has moved", scene) == {"change": True, "type": False, "object": True}
    assert synth.judge("the thing changed its color", scene)["object"] is (len(before) == 1)  # ambiguous
    assert synth.judge("there is no change", scene) == {"change": False, "type": False, "object": False}
    assert synth.judge("the tiny brown rubber is now rubber", scene)["object"] is False  # no noun: no object
    assert synth.read("the tiny brown rubber is now rubber") == ("material", "tiny brown rubber")
    assert synth.judge("a red cube and a blue ball", scene)["change"] is False  # no sentence of ours
    preds = {"000001": f"the {full(o)} turned {new}", "000002": "there is no change",
             "000001_n": "nothing has changed", "000002_n": f"the {full(o)} has moved"}
    got = synth.report(preds, {"000001": scene, "000002": scene})
    assert got["change caption %"] == 50 and got["right type %"] == 50 and got["right object %"] == 50
    assert got["no change on distractors %"] == 50 and got["change pairs"] == got["distractor pairs"] == 2
    assert got["color"] == {"right type %": 50, "right object %": 50}
    # the attributes the captions name: one caption gets the changed object's size wrong
    o2 = {**o, "size": "large" if o["size"] == "small" else "small"}
    preds["000002"] = f"the {full(o2)} turned {new}"
    assert synth.named(preds["000002"], scene) == {"size": False, "color": True, "material": True, "shape": True}
    assert synth.report(preds, {"000001": scene, "000002": scene})["named attributes right %"] == {
        "size": 50, "color": 100, "material": 100, "shape": 100}
    assert synth.named("the thing changed its color", scene) == {} and synth.named("no change", scene) == {}


def test_probe_reads_what_the_vectors_hold():
    """synth.probe: vectors that hold the changed object's shape (one-hot, plus noise) and nothing else probe to 100 %
    for the shape and about the most frequent class for the rest; the changed object is the added one after an add."""
    rng = random.Random(0)
    objs = lambda: [{a: rng.choice(synth.VALUES[a]) for a in synth.ATTRS} for _ in range(3)]
    scenes = {}
    for i in range(400):
        before, after = objs(), objs()
        scenes[f"{i:06d}"] = {"type": rng.choice(synth.CHANGES), "before": before, "after": after, "changed": i % 3}
    shape = lambda i: synth.changed(scenes[i])[0][synth.changed(scenes[i])[1]]["shape"]
    g = torch.Generator().manual_seed(0)
    vec = lambda ids: torch.stack([F.one_hot(torch.tensor(synth.SHAPES.index(shape(i))), 3).float() for i in ids]) + \
        0.1 * torch.randn(len(ids), 3, generator=g)
    ids = sorted(scenes)
    got = synth.probe(ids[:300], vec(ids[:300]), ids[300:], vec(ids[300:]), scenes)
    assert set(got) == {*synth.ATTRS, "type"} and got["shape"] == 100
    assert all(got[k] < 60 for k in ("color", "type")), got
    add = next(i for i in ids if scenes[i]["type"] == "add")
    assert synth.changed(scenes[add])[0] is scenes[add]["after"]


def object_words(text):
    """The objects a description names, as sorted attribute tuples (read back with synth's own parser)."""
    found = re.findall(r"\ban? ((?:\w+ ){3}\w+)(?=,| and|$| on)", text)
    return sorted(tuple(synth._attributes(p)[a] for a in synth.ATTRS) for p in found)


def test_descriptions_name_every_object_and_negatives_differ_in_one_attribute():
    rng, kinds = random.Random(0), set()
    for i in range(12):
        for objs in synth.views(i, 3).values():
            if objs is None:
                continue
            objs = [o for o, _ in objs]
            seed = rng.randrange(1000)
            text = synth.description(objs, seed)
            assert object_words(text) == sorted(tuple(o[a] for a in synth.ATTRS) for o in objs), text
            neg = synth.hard_negative(rng, objs)
            changed = [(k, a) for k, (o, n) in enumerate(zip(objs, neg)) for a in synth.ATTRS if o[a] != n[a]]
            assert len(changed) in (1, 2) and len({a for _, a in changed}) == 1  # one attribute: changed or swapped
            if len(changed) == 2:  # a swap keeps the scene's values, bound to other objects
                (i1, a), (i2, _) = changed
                assert (neg[i1][a], neg[i2][a]) == (objs[i2][a], objs[i1][a])
            kinds.add(len(changed))
            assert object_words(synth.description(neg, seed)) != object_words(text)
            words, neg_words = text.split(), synth.description(neg, seed).split()  # worded alike but that
            assert len(words) == len(neg_words) and 1 <= sum(a != b for a, b in zip(words, neg_words)) <= 2
    assert kinds == {1, 2}


# -------------------------------------------------------------------------------------------------------------
# metrics.py: hand-checked cases and coco-caption agreement

REFERENCE = SHARED / "reference"


REFERENCE_SETS = sorted(REFERENCE.glob("*.json")) if REFERENCE.is_dir() else []


needs_reference = pytest.mark.skipif(not REFERENCE_SETS, reason="../shared/reference (coco-caption's figures) absent")


needs_synonyms = pytest.mark.skipif(metrics.load_synonyms() is None,
                                    reason="no synonym data (pip install pycocoevalcap)")


METEOR_DATA = metrics.meteor_data()


needs_meteor_data = pytest.mark.skipif(None in METEOR_DATA.values(),  # .ci/run fails when they are absent there
                                       reason="Meteor 1.5's data files absent (pip install -r requirements.txt)")


# --- tokenization: Stanford PTBTokenizer as coco-caption runs it (outputs checked against the CoreNLP 3.4.1 jar)
@pytest.mark.parametrize("raw, tok", [
    ("The man's T-shirt (left) isn't red.", "the man 's t-shirt -lrb- left -rrb- is n't red"),
    ('Change the word "TRUMP" to "JUMP", and done!', "change the word trump to jump and done"),
    ("make it black & white; crop it: now...", "make it black & white crop it now"),
    ("Paid for by Donald J. Trump, Inc.", "paid for by donald j. trump inc."),
    ("  a   b\tc ", "a b c"), ("I can't, we cannot", "i ca n't we can not"), ("it 's", "it 's"),
    ("the U.S. flag at 3.5 m, 1,000 cars", "the u.s. flag at 3.5 m 1,000 cars"), ("...", ""), ("", ""),
])
def test_tokenize(raw, tok):
    assert metrics.tokenize(raw) == tok


# --- BLEU
def test_bleu_identical_and_disjoint():
    refs = {1: ["a red cube is on the left"], 2: ["two spheres moved"]}
    corpus, items = bleu(refs, {1: "a red cube is on the left", 2: "two spheres moved"})
    assert corpus == pytest.approx([1.0] * 4, abs=1e-8)
    assert items[1] == pytest.approx([1.0] * 4, abs=1e-8)
    # 3 words have no 4-gram: coco-caption's (0 + 1e-15) / (0 + 1e-9) makes that precision 1e-6, not 0 or 1
    assert items[2] == pytest.approx([1.0, 1.0, 1.0, 1e-6 ** 0.25], abs=1e-8)
    corpus, _ = bleu(refs, {1: "x y z w v u t", 2: "p q r"})
    assert max(corpus) < 1e-6


def test_bleu_brevity_penalty_and_closest_reference():
    # 3 of 3 unigrams right, but the reference has 6 words: BP = exp(1 - 6/3)
    _, items = bleu({1: ["a b c d e f"]}, {1: "a b c"})
    assert items[1][0] == pytest.approx(math.exp(-1.0), rel=1e-6)
    # references of 3 and 5 words, candidate of 4: both are 1 away, the shorter counts, so no penalty
    _, items = bleu({1: ["a b c", "a b c d e"]}, {1: "a b c d"})
    assert items[1][0] == pytest.approx(1.0, abs=1e-8)
    # clipping: "the" 3 times in the candidate, at most 2 times in one reference
    _, items = bleu({1: ["the cat the mat", "the dog"]}, {1: "the the the"})
    assert items[1][0] == pytest.approx(2 / 3, rel=1e-6)


# --- ROUGE-L
def test_rouge_l_lcs_and_beta():
    _, items = rouge_l({1: ["a c b d"]}, {1: "a b c d"})  # LCS 3: P = R = 3/4
    assert items[1] == pytest.approx(0.75)
    _, items = rouge_l({1: ["a b c d"]}, {1: "a b"})  # P 1, R 1/2, beta 1.2
    assert items[1] == pytest.approx((1 + 1.44) * 0.5 / (0.5 + 1.44))
    _, items = rouge_l({1: ["x y"], 2: ["a b"]}, {1: "a b", 2: "a b"})
    assert items == {1: 0.0, 2: 1.0}


def test_lcs_matches_dynamic_programming():
    import random
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.choice("abcd") for _ in range(rng.randint(0, 12))]
        b = [rng.choice("abcd") for _ in range(rng.randint(0, 12))]
        table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
        for i in range(len(a)):
            for j in range(len(b)):
                table[i + 1][j + 1] = table[i][j] + 1 if a[i] == b[j] else max(table[i][j + 1], table[i + 1][j])
        assert metrics._lcs(a, b) == table[-1][-1]


# --- CIDEr-D
def test_cider_d_by_hand():
    # 2 items, no n-gram shared between them: every idf is log 2 (unseen n-grams count as df 1 too)
    refs = {1: ["a b"], 2: ["c d"]}
    _, items = cider_d(refs, {1: "a b e", 2: "c d"})
    # item 1: unigram cosine 2/sqrt(6), bigram 1/sqrt(2), no 3- or 4-grams in the reference; lengths 2 vs 1 bigrams
    assert items[1] == pytest.approx(10 * (2 / math.sqrt(6) + 1 / math.sqrt(2)) / 4 * math.exp(-1 / 72))
    assert items[2] == pytest.approx(5.0)  # identical, but a 2-word sentence has no 3- and 4-grams
    _, items = cider_d(refs, {1: "x y", 2: "c d"})
    assert items[1] == 0.0


def test_cider_d_clips_repeated_ngrams():
    """By hand: 2 items, so each n-gram of one item's reference has idf log 2. "red red" against "red cube": the
    unigram weights are h = (red: 2 log 2), r = (red: log 2, cube: log 2); the "-D" clipping credits min(h, r) * r =
    (log 2)^2, not h * r = 2 (log 2)^2. Cosine 1 / (2 sqrt 2) (unclipped: 1 / sqrt 2); no shared bigram; no 3- or
    4-grams; equal lengths (1 bigram each): CIDEr-D = 10 * cos / 4."""
    refs = {1: ["red cube"], 2: ["blue ball"]}
    _, items = cider_d(refs, {1: "red red", 2: "x"})
    assert items[1] == pytest.approx(10 * (1 / (2 * math.sqrt(2))) / 4, abs=1e-12)
    _, once = cider_d({1: ["a red cube", "a red ball"], 2: ["one green thing"]}, {1: "a red cube", 2: "x"})
    _, again = cider_d({1: ["a red cube", "a red ball"], 2: ["one green thing"]},
                       {1: "a red cube red cube red cube", 2: "x"})
    assert again[1] < once[1]


def test_cider_d_constant_equals_full_pass():
    refs = {i: [metrics.tokenize(s) for s in r] for i, r in {
        1: ["the red cube moved", "a red cube has moved"], 2: ["the blue sphere is gone", "no blue sphere"],
        3: ["nothing changed", "the scene is the same"], 4: ["the red cube is gone", "a cube was removed"]}.items()}
    prepared = cider_d_prepare(refs)
    captions = ["the red cube moved", "nothing changed", "the cube is gone", "", "zebra"]
    fast = cider_d_constant(prepared, captions)
    for caption, score in zip(captions, fast):
        assert score == pytest.approx(cider_d(refs, {i: caption for i in refs})[0], abs=1e-12)


# --- METEOR 1.5
def test_meteor_exact_stage_by_hand():
    # words outside WordNet and the paraphrase table: exact matches only. 3 of 4 content words, 2 chunks.
    _, items = meteor({1: ["w1 w2 w3 w5"]}, {1: "w1 w2 w4 w5"})
    assert items[1] == pytest.approx(0.75 * (1 - 0.6 * (2 / 3) ** 0.2))
    # a function word ("the") counts 1 - delta = 0.25, a content word 0.75: P = R = 0.25, one chunk of one match
    _, items = meteor({1: ["the w2"]}, {1: "the w1"})
    assert items[1] == pytest.approx(0.25 * (1 - 0.6))
    corpus, items = meteor({1: ["w1 w2"], 2: ["w4 w5"]}, {1: "w1 w2", 2: "w6 w7"})
    assert items == {1: 1.0, 2: 0.0}
    # corpus METEOR comes from summed statistics (a perfect segment adds no chunk): P = R = 1/2, frag 0
    assert corpus == pytest.approx(0.5)


def test_meteor_stem_stage():
    # "cubes" ~ "cube" by Snowball stem (weight 0.6): P = R = (0.75 + 0.6 * 0.75) / 1.5, one chunk, all matched
    _, items = meteor({1: ["w1 cube"]}, {1: "w1 cubes"})
    assert items[1] == pytest.approx((0.75 + 0.6 * 0.75) / 1.5)


@needs_synonyms
def test_meteor_synonym_stage():
    _, items = meteor({1: ["w1 automobile"]}, {1: "w1 car"})  # WordNet synset {car, auto, automobile, ...}: 0.8
    assert items[1] == pytest.approx((0.75 + 0.8 * 0.75) / 1.5)


@pytest.fixture
def fresh_meteor_sources(monkeypatch, tmp_path):
    """No user settings, caches in tmp_path, and the source lookups run again (before and after the test)."""
    monkeypatch.delenv("METEOR_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    metrics.load_synonyms.cache_clear(), metrics._warned.clear()
    yield
    metrics.load_synonyms.cache_clear(), metrics._warned.clear()


def test_meteor_reads_synonyms_from_meteors_jar(tmp_path, monkeypatch, fresh_meteor_sources):
    # a jar (a zip) laid out as meteor-1.5.jar: synsets are line pairs word / ids, exceptions base / irregular forms
    with zipfile.ZipFile(tmp_path / "meteor-1.5.jar", "w") as z:
        z.writestr("synonym/english.synsets", "car\n02958343 00001\nautomobile\n02958343\nmouse\n0777\n"
                                              "rodent\n0777 0888\n")
        z.writestr("synonym/english.exceptions", "mouse\nmice\n")
    monkeypatch.setenv("METEOR_DATA", str(tmp_path))
    assert metrics.meteor_data()["jar"] == tmp_path / "meteor-1.5.jar"
    one_synonym = (0.75 + 0.8 * 0.75) / 1.5
    _, items = meteor({1: ["w1 automobile"], 2: ["w1 rodent"], 3: ["w1 automobile"]},
                      {1: "w1 car", 2: "w1 mice", 3: "w1 mice"}, paraphrase=False)
    assert items[1] == pytest.approx(one_synonym)
    assert items[2] == pytest.approx(one_synonym)  # mice -> its base form mouse, which shares a synset with rodent
    assert items[3] == pytest.approx(0.5 * (1 - 0.6))  # w1 alone: P = R = 0.5, one chunk of one match


def test_meteor_paraphrase_stage(tmp_path, fresh_meteor_sources):
    table = tmp_path / "paraphrase.gz"  # Meteor's format: probability / phrase / paraphrase
    with gzip.open(table, "wt") as f:
        f.write("0.5\nw3\nw4 w5\n")
    # hyp "w3" ~ ref "w4 w5" (weight 0.6): P = (0.75 + 0.6 * 0.75) / 1.5, R = (0.75 + 0.6 * 1.5) / 2.25, one chunk
    _, items = meteor({1: ["w1 w4 w5"]}, {1: "w1 w3"}, paraphrase=table)
    p, r = 0.8, 1.65 / 2.25
    assert items[1] == pytest.approx(1 / (0.15 / p + 0.85 / r))  # 0.7426..., as the jar with this table


def test_paraphrase_index_matches_a_scan_and_follows_its_source(tmp_path, monkeypatch, fresh_meteor_sources):
    rng = random.Random(0)
    words = [f"w{i}" for i in range(40)]
    phrase = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
    entries = [(phrase(), phrase()) for _ in range(3000)]
    table = tmp_path / "paraphrase-en.gz"

    def write(entries):
        with gzip.open(table, "wt") as f:
            f.writelines(f"0.{i}\n{a}\n{b}\n" for i, (a, b) in enumerate(entries))

    def scan(vocab):  # what the index must give: every entry whose words are all in vocab, in the table's order
        out = defaultdict(list)
        for a, b in entries:
            if set(a.split()) <= vocab and set(b.split()) <= vocab:
                out[tuple(a.split())].append(tuple(b.split()))
        return dict(out)

    write(entries)
    umask = os.umask(0o022)
    os.umask(umask)
    for vocab in ({"w1", "w2", "w3"}, set(words[:25]), set(words)):
        assert metrics.load_paraphrases(table, vocab) == scan(vocab)
    built = sorted((tmp_path / "cache" / "clip4idc").iterdir())
    assert len(built) == 1 and (built[0] / "tokens.npy").is_file()
    assert built[0].stat().st_mode & 0o777 == 0o777 & ~umask  # a shared cache: readable by all, as the umask says
    other = tmp_path / "raced"  # another process finished the same index first: theirs is kept, no error
    shutil.copytree(built[0], other)
    assert metrics.build_paraphrase_index(table, other, log_every=0) == other and (other / "split.npy").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("raced")] == ["raced"]
    entries = entries[:1000] + [("w1", "w39 w38")]  # the source changes: a new index, the old one unused
    write(entries)
    assert metrics.load_paraphrases(table, {"w1", "w38", "w39"}) == scan({"w1", "w38", "w39"})
    assert len(list((tmp_path / "cache" / "clip4idc").iterdir())) == 2

    # a build killed before it is renamed into place leaves nothing that a later call trusts
    entries = entries[:500]
    write(entries)
    real_save = np.save
    monkeypatch.setattr(np, "save", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        metrics.load_paraphrases(table, {"w1"})
    monkeypatch.setattr(np, "save", real_save)
    assert not metrics._index_path(table).exists()
    assert metrics.load_paraphrases(table, set(words)) == scan(set(words))


def test_meteor_best_reference_and_normalizer():
    _, items = meteor({1: ["w3 w8", "w1 w2"]}, {1: "w1 w2"})
    assert items[1] == 1.0
    assert metrics.meteor_normalize("do n't wear the man 's t-shirt") == ["do", "n", "'t", "wear", "the", "man",
                                                                         "'", "s", "t", "shirt"]
    assert metrics.meteor_normalize("the u.s. and j. doe inc.") == ["the", "us", "and", "j.", "doe", "inc", "."]


# --- evaluate(): the API the stages call, and its input checks
def test_evaluate_identical_and_per_item():
    refs = {"a": ["A red cube moved.", "The red cube has moved"], "b": ["Nothing changed!", "no change"]}
    cands = {"a": "a red cube moved", "b": "nothing changed"}
    corpus, items = evaluate(refs, cands, per_item=True)
    assert set(corpus) == set(metrics.METRICS) and set(items) == set(metrics.METRICS)
    assert [corpus[m] for m in ("BLEU-1", "ROUGE-L", "METEOR")] == pytest.approx([1.0] * 3, abs=1e-8)
    assert items["CIDEr-D"].keys() == cands.keys()
    assert corpus["CIDEr-D"] == pytest.approx(sum(items["CIDEr-D"].values()) / 2)
    assert evaluate(refs, cands) == corpus


def test_evaluate_rejects_bad_input():
    refs = {1: ["a cube"], 2: ["a ball"]}
    with pytest.raises(ValueError, match="same ids"):
        evaluate(refs, {1: "a cube", 3: "a ball"})
    with pytest.raises(ValueError, match="same ids"):
        evaluate(refs, {1: "a cube"})
    with pytest.raises(TypeError, match="candidate 2"):
        evaluate(refs, {1: "a cube", 2: None})
    with pytest.raises(TypeError, match="references of 2"):
        evaluate({1: ["a cube"], 2: "a ball"}, {1: "a cube", 2: "a ball"})
    with pytest.raises(TypeError, match="references of 2"):
        evaluate({1: ["a cube"], 2: []}, {1: "a cube", 2: "a ball"})
    with pytest.raises(ValueError, match="no candidates"):
        evaluate({}, {})


def test_evaluate_empty_candidate_scores_zero():
    refs = {1: ["a red cube"], 2: ["a blue ball"]}
    with pytest.warns(UserWarning, match="1 empty candidates"):
        _, items = evaluate(refs, {1: "a red cube", 2: "..."}, per_item=True)
    assert all(items[m][2] < 1e-6 for m in metrics.METRICS)
    assert items["CIDEr-D"][1] > 0


@pytest.mark.subprocess
def test_command_line(tmp_path):
    (tmp_path / "refs.json").write_text(json.dumps({"1": ["a red cube moved"], "2": ["nothing changed"]}))
    (tmp_path / "cands.json").write_text(json.dumps({"1": "a red cube moved", "2": "something moved"}))
    out = subprocess.run([sys.executable, str(Path(metrics.__file__)), "--refs", str(tmp_path / "refs.json"),
                          "--cands", str(tmp_path / "cands.json")], capture_output=True, text=True, check=True).stdout
    header, values = out.strip().splitlines()[-2:]
    want = evaluate({"1": ["a red cube moved"], "2": ["nothing changed"]},
                    {"1": "a red cube moved", "2": "something moved"})
    assert [h.strip() for h in header.split("|")] == list(metrics.METRICS)
    assert [float(v) for v in values.split("|")] == [round(100 * want[m], 2) for m in metrics.METRICS]
    assert 0 < want["CIDEr-D"] and want["BLEU-1"] > 0  # figures of a half-right corpus, not zeros


# --- agreement with coco-caption on real caption sets (its tokenization, corpus and per-item scores)
def load_reference(path):
    ref = json.loads(path.read_text())
    return ref, evaluate(ref["refs"], ref["cands"], per_item=True)


@needs_reference
@pytest.mark.parametrize("path", REFERENCE_SETS, ids=lambda p: p.stem)
def test_matches_coco_caption(path):
    ref, (corpus, items) = load_reference(path)
    for i in ref["refs"]:  # tokenization alone: exactly the Java tokenizer's text
        assert [metrics.tokenize(s) for s in ref["refs"][i]] == ref["tokenized_refs"][i]
        assert metrics.tokenize(ref["cands"][i]) == ref["tokenized_cands"][i]
    for m in ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "ROUGE-L", "CIDEr-D"):
        assert corpus[m] == pytest.approx(ref["corpus"][m], abs=1e-9), m
        for i, score in ref["per_item"][m].items():
            assert items[m][i] == pytest.approx(score, abs=1e-9), (m, i)


@pytest.mark.slow
@needs_reference
@needs_meteor_data
@pytest.mark.parametrize("path", REFERENCE_SETS, ids=lambda p: p.stem)
def test_meteor_matches_coco_caption(path):
    # Meteor 1.5's own synonym files and paraphrase table, as pycocoevalcap installs them: the jar's figure
    ref, (corpus, items) = load_reference(path)
    assert corpus["METEOR"] == pytest.approx(ref["corpus"]["METEOR"], abs=0.0005)
    if "METEOR" in ref["per_item"]:
        assert np.abs([items["METEOR"][i] - s for i, s in ref["per_item"]["METEOR"].items()]).max() < 1e-9


@pytest.mark.slow
@needs_reference
def test_meteor_without_meteors_data_says_so_and_stays_near(monkeypatch, fresh_meteor_sources):
    # without pycocoevalcap: exact + stem only; each missing source is said once, with the size of the gap it leaves
    monkeypatch.setattr(metrics, "meteor_data", lambda: {"jar": None, "paraphrase": None})
    for path in REFERENCE_SETS:
        ref = json.loads(path.read_text())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            corpus, _ = meteor(ref["tokenized_refs"], ref["tokenized_cands"])
        said = " ".join(str(w.message) for w in caught)
        assert ("no paraphrase table" in said and "0.010" in said) == (path == REFERENCE_SETS[0])
        assert ("no synonym data" in said and "0.007" in said) == (path == REFERENCE_SETS[0])
        gap = ref["corpus"]["METEOR"] - corpus
        assert 0 <= gap <= 0.0175  # the gaps the warnings state, summed


# -------------------------------------------------------------------------------------------------------------
# adapt.py: the contrastive loss, retrieval metrics, training, resume, divergence

def test_retrieval_metrics_by_hand():
    # 2 pairs, 3 captions: captions 0, 1 belong to pair 0, caption 2 to pair 1
    owner = torch.tensor([0, 0, 1])
    sim = torch.tensor([[0.1, 0.9, 0.5],
                        [0.2, 0.3, 0.4]])
    m = adapt.retrieval_metrics(sim, owner)
    # pair -> text ranks caption sets by their best: pair 0's own set scores 0.9 against pair 1's 0.5 -> rank 1;
    # pair 1's 0.4 against 0.3 -> rank 1. text->pair: caption 0 -> pair 1 scores 0.2 > 0.1 -> rank 2; caption 1 -> rank 1;
    # caption 2 -> pair 0 scores 0.5 > 0.4 -> rank 2
    assert m["pair->text R@1"] == 100 and m["text->pair R@1"] == pytest.approx(100 / 3)
    assert m["text->pair MnR"] == pytest.approx(5 / 3) and m["text->pair MdR"] == 2
    const = adapt.retrieval_metrics(torch.zeros(2, 3), owner)  # ties rank pessimistically: no free rank 1
    assert const["text->pair R@1"] == 0 and const["pair->text R@1"] == 0
    chance = adapt.chance_metrics(2)
    assert chance["text->pair R@1"] == 50 == chance["pair->text R@1"]  # test_chance_is_the_mean_of_random_rankings


def test_contrastive_loss_matches_definition():
    torch.manual_seed(0)
    v, g = torch.randn(4, 8), torch.randn(4, 8)
    scale = torch.tensor(2.0)
    loss = adapt.contrastive_loss(v, g, scale)
    s = scale.exp() * torch.nn.functional.normalize(v, dim=-1) @ torch.nn.functional.normalize(g, dim=-1).t()
    want = -(s.log_softmax(1).diag().mean() + s.log_softmax(0).diag().mean()) / 2
    assert torch.allclose(loss, want, atol=1e-6)
    # the logit scale is clamped at ln 100
    assert adapt.contrastive_loss(v, g, torch.tensor(9.0)) == adapt.contrastive_loss(v, g, torch.tensor(4.7))


def test_contrastive_logits_fp32_under_autocast():
    """bf16 autocast (CUDA's path, here on the CPU) must not reach the logits: at scale 100 a bf16 matmul is off
    by up to ~0.4 per logit."""
    torch.manual_seed(0)
    v, g = torch.randn(64, 128), torch.randn(64, 128)
    g = v + 3 * g  # pairs near their captions: a loss of about 0.5, as in training
    scale = torch.tensor(math.log(100))
    want = adapt.contrastive_loss(v, g, scale)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = adapt.contrastive_loss(v, g, scale)
    assert got.dtype == torch.float32 and abs(got.item() - want.item()) < 1e-5, (got.item(), want.item())


def test_static_caption_length_gives_the_same_loss_and_gradients():
    """--compile pads every caption to the context length (static shapes: one compiled graph); the default trims the
    batch to its longest caption. The text tower is causal and reads the end token, so both give the same loss and
    gradients."""
    torch.manual_seed(0)
    model = M.CLIP(TINY)
    before, after = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32)
    ids = tokenize(["a red cube moved", "the small metal sphere is gone", "no change", "a thing"], 32)
    assert clip_load.trim(ids).shape[1] < clip_load.trim(ids, static=True).shape[1] == 32
    out = {}
    for static in (False, True):
        model.zero_grad()
        loss = adapt.contrastive_loss(*adapt.PairText(model)(before, after, clip_load.trim(ids, static)))
        loss.backward()
        out[static] = loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-6, rtol=1e-6)
    assert out[True][1].keys() == out[False][1].keys() and "token_embedding.weight" in out[True][1]
    for k, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][k], g, atol=1e-5, rtol=1e-4, msg=k)  # float noise only


@pytest.mark.slow
def test_loss_decreases_on_synthetic_batches(adapt_synth):
    args = adapt.settings(TINY_ADAPT + ["--data-root", str(adapt_synth)])
    torch.manual_seed(0)
    model = adapt.new_model(args)
    items = data.load_items("clevr", adapt_synth, "train", setting="semantic")[:8]
    ds = data.CaptionDataset(items, 32, 32, swap_prob=0.5)
    batch = next(iter(data.make_loader(ds, 8, shuffle=True)))
    batch = [clip_load.normalize(batch["before"]), clip_load.normalize(batch["after"]), batch["ids"]]
    train_utils.freeze(model.named_parameters(), adapt.lr_rule(args))
    opt = torch.optim.AdamW(train_utils.param_groups(model.named_parameters(), adapt.lr_rule(args), 0.0))
    net = adapt.PairText(model)
    losses = []
    for _ in range(30):
        loss = adapt.contrastive_loss(*net(*batch[:3]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.slow
def test_train_resume_equals_uninterrupted(adapt_synth, tmp_path, monkeypatch):
    """Stopped by Ctrl-C in the second epoch and resumed: the same weights as a run that was never stopped; an epoch
    is every caption once (the authors')."""
    base = TINY_ADAPT + ["--data-root", str(adapt_synth), "--epochs", "2"]
    adapt.main(base + ["--out", str(tmp_path / "a.pt")])
    full = torch.load(tmp_path / "a.last.pt", weights_only=False)
    assert Image.open(tmp_path / "a.curves.png").size == (1280, 240)  # the training curves, after every epoch

    real_epoch = ctrl_c_in_second_epoch(monkeypatch, adapt)
    with pytest.raises(SystemExit) as stop:
        adapt.main(base + ["--out", str(tmp_path / "b.pt")])
    assert stop.value.code == 130 and torch.load(tmp_path / "b.last.pt", weights_only=False)["epoch"] == 1
    monkeypatch.setattr(adapt, "train_epoch", real_epoch)
    adapt.main(base + ["--out", str(tmp_path / "b.pt"), "--resume"])
    resumed = torch.load(tmp_path / "b.last.pt", weights_only=False)
    assert resumed["epoch"] == full["epoch"] == 2
    items = data.load_items("clevr", adapt_synth, "train", setting="semantic")
    samples = sum(len(it.captions) for it in items)
    assert full["step"] == 2 * (samples // 8)  # --batch-size 8, the last part-batch dropped
    for k, v in full["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
    ckpt = torch.load(tmp_path / "b.pt", weights_only=False)
    assert {"model", "config", "tokenizer", "metrics", "args"} <= set(ckpt)
    assert "text->pair R@1" in ckpt["metrics"]["test"] and "val" in ckpt["metrics"]
    assert ckpt["args"]["swap_prob"] == 0.0  # the synthetic set's default
    probed = ckpt["metrics"]["probe"]  # on the synthetic set: what v knows of the change
    assert set(probed) == {*synth.ATTRS, "type"} and all(0 <= v <= 100 for v in probed.values())
    model = adapt.new_model(adapt.settings(base))
    v, g, _ = adapt.encode_split(model, items[:4], adapt.settings(base), train_utils.setup(0, "cpu", "off"))
    assert not v.requires_grad and not g.requires_grad  # evaluation builds no autograd graph


@pytest.mark.slow
def test_freeze_blocks_and_shared_p_train_the_inter_blocks_alone(adapt_synth, tmp_path, monkeypatch):
    """adapt.py --freeze-blocks --shared-p (the mini preset's values, that teach the inter blocks to compare):
    p starts alike for a patch's position in both images, of the given norm, none on [CLS]; through an epoch of
    steps the intra blocks stay bit-identical while the inter blocks, the text tower and e1, e2, p, ln_mid move.
    Without the flags every block moves and p starts independently drawn (the authors')."""
    made = []
    real = adapt.new_model
    monkeypatch.setattr(adapt, "new_model", lambda args: made.append(real(args)) or copy.deepcopy(made[-1]))
    argv = TINY_ADAPT + ["--data-root", str(adapt_synth), "--epochs", "1", "--vision-layers", "3", "--image-size",
                         "48", "--lr-clip", "1e-3"]  # 2 intra + 1 inter blocks, a 3x3 grid
    adapt.main(argv + ["--freeze-blocks", "2", "--shared-p", "5", "--out", str(tmp_path / "a.pt")])
    adapt.main(argv + ["--out", str(tmp_path / "b.pt")])
    for start, name, recipe in ((made[0], "a", True), (made[1], "b", False)):
        p = start.visual.joint_positional_embedding.detach()
        assert torch.equal(p[:10], p[10:]) == recipe and (p[0].abs().max() == 0) == recipe
        if recipe:
            assert torch.allclose(p[1:10].norm(dim=1), torch.full((9,), 5.0))
        before, after = start.state_dict(), torch.load(tmp_path / f"{name}.last.pt", weights_only=False)["model"]
        moved = {k for k in before if not torch.equal(before[k], after[k])}
        block = lambda k: int(k.split(".")[3]) if k.startswith("visual.transformer.resblocks.") else None
        intra, inter = ({k for k in before if block(k) in blocks} for blocks in ((0, 1), (2,)))
        assert (not intra & moved) == recipe and inter <= moved, sorted(moved)
        assert {"transformer.resblocks.0.attn.in_proj_weight", "visual.joint_positional_embedding",
                "visual.bef_embedding", "visual.ln_mid.weight"} <= moved


@pytest.mark.slow
def test_mini_preset_computes_the_fixed_intra_blocks_once(adapt_synth, tmp_path, monkeypatch, capsys):
    """CPU. adapt.py --preset mini on the shipped mini CLIP (4 fixed intra blocks, a 12x12 grid, 290 joint tokens):
    the training pairs' intra-block tokens computed once (fixed_intra) train the same model as the images through
    the blocks every step, to float rounding; with a distractor swap, or an intra block training, the images go
    through."""
    argv = ["--data-root", str(adapt_synth), "--preset", "mini", *FAST, "--epochs", "2"]
    adapt.main(argv + ["--out", str(tmp_path / "a.pt")])
    assert "computed once (fixed_intra)" in capsys.readouterr().out
    cached = torch.load(tmp_path / "a.last.pt", weights_only=False)
    real, calls = adapt.fixed_intra, []
    monkeypatch.setattr(adapt, "fixed_intra", lambda *a: calls.append(real(*a)))  # -> None: through the images
    adapt.main(argv + ["--out", str(tmp_path / "b.pt")])
    plain = torch.load(tmp_path / "b.last.pt", weights_only=False)
    assert calls[0].shape == (len(data.load_items("clevr", adapt_synth, "train", "semantic")), 2, 145, 128)
    assert "computed once" not in capsys.readouterr().out and cached["step"] == plain["step"] >= 4
    shipped = load_clip("mini64-synth").state_dict()
    trained = max_change(plain["model"], shipped, ["visual.transformer.resblocks.5.mlp.c_fc.weight"])
    assert min(trained.values()) > 2e-4  # the inter blocks learned: an equality of two untrained models proves nothing
    assert max(max_change(cached["model"], plain["model"], plain["model"]).values()) < 2e-5, "cached != plain"
    for extra in (["--swap-prob", "0.5"], ["--freeze-blocks", "3"]):
        args = adapt.settings(argv + extra)
        assert real(adapt.new_model(args), [], args, train_utils.setup(0, "cpu", "off"), None) is None, extra


@pytest.mark.slow
def test_a_diverged_evaluation_stops_the_run(adapt_synth, tmp_path, monkeypatch):
    """Weights gone NaN in epoch 2 (the loss of its steps still finite): NaN similarities would rank every pair
    first (R@1 100) and be saved as the best model. The run stops instead, and epoch 1's model stays chosen."""
    real_epoch, real_model, models = train_utils.train_epoch, adapt.new_model, []
    monkeypatch.setattr(adapt, "new_model", lambda args: models.append(real_model(args)) or models[-1])

    def diverge(*a, **k):
        loss = real_epoch(*a, **k)
        if a[5].epoch == 1:  # the Progress argument's epoch: the second
            with torch.no_grad():
                models[0].visual.proj.fill_(float("nan"))
        return loss
    monkeypatch.setattr(adapt, "train_epoch", diverge)
    with pytest.raises(SystemExit, match="after epoch 2: the encoder's features are NaN"):
        adapt.main(TINY_ADAPT + ["--data-root", str(adapt_synth), "--epochs", "2", "--out", str(tmp_path / "a.pt")])
    assert torch.load(tmp_path / "a.pt", weights_only=False)["metrics"]["epoch"] == 1
    assert torch.load(tmp_path / "a.last.pt", weights_only=False)["epoch"] == 1


@pytest.mark.slow
def test_swap_default_is_the_authors_on_real_clevr(adapt_synth, tmp_path, capsys):
    real = tmp_path / "clevr"  # the same files without synth.json: what the real CLEVR-Change looks like
    shutil.copytree(adapt_synth, real, ignore=shutil.ignore_patterns("synth.json"))
    adapt.main(TINY_ADAPT + ["--data-root", str(real), "--epochs", "1", "--out", str(tmp_path / "a.pt")])
    assert torch.load(tmp_path / "a.pt", weights_only=False)["args"]["swap_prob"] == 0.5
    assert " swap_prob=0.5 " in capsys.readouterr().out  # the settings line


# -------------------------------------------------------------------------------------------------------------
# caption.py: the captioner, scoring, the constant baseline, the two-image CLI, resume

def test_cider_by_change_type_scores_each_type_alone():
    """Per-type CIDEr-D (paper Table 2): each type's items scored as a corpus of their own (their own document
    frequencies), the right items in each type; a type's wrong captions lower that type only."""
    caps = {"color": ["the red cube turned blue", "the small ball became green", "a cylinder changed its color"],
            "drop": ["the gray cube is gone", "the metal ball disappeared", "someone removed the cylinder"],
            "distractor": ["nothing has changed", "the scene is the same", "no change was made"]}
    items = [data.Item(f"{t}{k}", "b.png", "a.png", [c], t) for t, cs in caps.items() for k, c in enumerate(cs)]
    exact = {it.id: it.captions[0] for it in items}
    _, by_type = caption.score(items, exact, by_type=True)
    assert set(by_type) == set(caps) and all(v > 0 for v in by_type.values())
    for t in caps:
        alone = {it.id: [metrics.tokenize(it.captions[0])] for it in items if it.change_type == t}
        assert by_type[t] == pytest.approx(100 * cider_d(alone, {i: r[0] for i, r in alone.items()})[0], abs=1e-9)
    wrong = {**exact, "drop0": "the red cube turned blue", "drop1": "nothing has changed"}
    _, worse = caption.score(items, wrong, by_type=True)
    assert worse["drop"] < by_type["drop"] and worse["color"] == by_type["color"]
    assert worse["distractor"] == by_type["distractor"]


def test_overfit_exact_captions(trained):
    tmp, results = trained
    preds = {p["id"]: p["caption"] for p in results["predictions"]}
    assert preds == {**{f"{i:06d}": c for i, (_, c) in CHANGES.items()}, **{f"{i:06d}_n": SAME for i in CHANGES}}
    assert results["scores"]["CIDEr-D"] > results["baseline"]["scores"]["CIDEr-D"]
    # the baseline is the best constant training caption, by a full CIDEr-D pass for each (not just any of them)
    refs = {f"{i:06d}": [c] for i, (_, c) in CHANGES.items()} | {f"{i:06d}_n": [SAME] for i in CHANGES}
    assert {p["id"]: p["references"] for p in results["predictions"]} == refs
    full = {c: evaluate(refs, {i: c for i in refs})["CIDEr-D"] * 100 for c in [SAME] + [c for _, c in CHANGES.values()]}
    assert results["baseline"]["caption"] == metrics.tokenize(max(full, key=full.get)) == SAME
    assert results["baseline"]["scores"]["CIDEr-D"] == pytest.approx(max(full.values()), abs=1e-9)
    assert set(results["scores_by_type"]) == {"color", "move", "add", "drop", "distractor"}
    saved = torch.load(tmp / "captioner.pt", weights_only=True)
    assert saved["stage"] == "caption" and saved["format"] == caption.FORMAT and "test" in saved["metrics"]


@pytest.mark.slow
def test_two_image_cli(trained, capsys, tmp_path):
    tmp, _ = trained
    evaluate_py.main([*CPU, "--ckpt", str(tmp / "captioner.pt"), "--before", str(REAL / "CLEVR_new_000000.png"),
                      "--after", str(REAL / "CLEVR_new_000000_del.png")])
    assert capsys.readouterr().out.strip() == CHANGES[0][1]
    # any size and mode: 8-bit grey and 16-bit grey images of other sizes still give a caption of known words
    grey = Image.open(REAL / "CLEVR_new_000000.png").convert("L").resize((200, 90))
    grey.save(tmp_path / "grey.png")
    Image.fromarray((np.asarray(grey).astype(np.uint16) * 257)).save(tmp_path / "grey16.png")
    evaluate_py.main([*CPU, "--ckpt", str(tmp / "captioner.pt"), "--before", str(tmp_path / "grey.png"),
                      "--after", str(tmp_path / "grey16.png")])
    vocab = {w for _, c in CHANGES.values() for w in c.split()} | set(SAME.split())
    said = capsys.readouterr().out.split()
    assert said and set(said) <= vocab  # words it learnt (an empty caption is no caption)
    # evaluating a saved captioner (beam search) and drawing the gallery
    out = evaluate_py.main([*CPU, "--ckpt", str(tmp / "captioner.pt"), "--results", str(tmp_path / "r.json"), "--beam",
                            "2", "--gallery", str(tmp_path / "g.png"), "--workers", "0"])
    assert out["scores"]["CIDEr-D"] > 0 and Image.open(tmp_path / "g.png").size[1] > 100
    # --explain: the caption, the two images and their heat maps in one PNG (two rows of 192 px images)
    evaluate_py.main([*CPU, "--ckpt", str(tmp / "captioner.pt"), "--before", str(REAL / "CLEVR_new_000000.png"),
                      "--after", str(REAL / "CLEVR_new_000000_del.png"), "--explain", str(tmp_path / "why.png")])
    w, h = Image.open(tmp_path / "why.png").size
    assert h > 2 * 192 and w > 2 * 192 and CHANGES[0][1] in capsys.readouterr().out
    assert Image.open(tmp / "captioner.curves.png").size == (1280, 240)  # written after every epoch
    with pytest.raises(SystemExit, match="is not a captioner but an encoder"):
        evaluate_py.main([*CPU, "--ckpt", str(tmp / "adapted.pt"), "--before", str(REAL / "CLEVR_new_000000.png"),
                          "--after", str(REAL / "CLEVR_new_000000_del.png")])


def test_evaluate_tests_a_frozen_encoders_captioner_as_caption_py(trained, tmp_path, monkeypatch):
    """evaluate.py on a captioner trained on a frozen encoder (the mini preset) reads the test pairs through the
    encoder's fp16 tokens, as caption.py's test did (from the images at full precision, 1 of the quickstart's 600
    captions differed): the same captions and scores."""
    tmp, results = trained
    encoded, real = [], caption.encode_all
    monkeypatch.setattr(caption, "encode_all", lambda *a, **k: encoded.append(len(a[1].dataset)) or real(*a, **k))
    again = evaluate_py.main([*CPU, "--ckpt", str(tmp / "captioner.pt"), "--results", str(tmp_path / "r.json"),
                              "--workers", "0"])
    assert encoded == [len(results["predictions"])]
    assert again["predictions"] == results["predictions"] and again["scores"] == results["scores"]


@pytest.mark.slow
def test_resume_equals_uninterrupted(trained, tmp_path, monkeypatch):
    tmp, _ = trained
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        shutil.copy(tmp / "adapted.pt", tmp_path / d / "adapted.pt")
    run(tmp_path / "a", epochs=3)
    real_epoch = ctrl_c_in_second_epoch(monkeypatch, caption)
    with pytest.raises(SystemExit):
        run(tmp_path / "b", epochs=3)
    monkeypatch.setattr(caption, "train_epoch", real_epoch)
    run(tmp_path / "b", "--resume", epochs=3)
    a, b = (torch.load(tmp_path / d / "captioner.last.pt", weights_only=False) for d in ("a", "b"))
    assert a["epoch"] == b["epoch"] == 3 and a["history"] == b["history"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.slow
def test_resume_after_early_stop_trains_no_more(trained, tmp_path, monkeypatch, capsys):
    """A run resumed after its early stop (killed in its final test, or run again) tests the model it chose; it
    does not train another epoch, which could choose another."""
    shutil.copy(trained[0] / "adapted.pt", tmp_path / "adapted.pt")
    scores, real = iter([50.0, 40.0]), caption.cider  # val CIDEr-D falls after epoch 1: patience 1 stops after 2
    monkeypatch.setattr(caption, "cider", lambda items, preds: next(scores, None) or real(items, preds))
    first = run(tmp_path, "--patience", "1", epochs=6)
    chosen = torch.load(tmp_path / "captioner.pt", weights_only=False)
    assert [h["epoch"] for h in chosen["metrics"]["history"]] == [1, 2] and chosen["metrics"]["epoch"] == 1
    again = run(tmp_path, "--patience", "1", "--resume", epochs=6)
    state, after = (torch.load(tmp_path / f, weights_only=False) for f in ("captioner.last.pt", "captioner.pt"))
    assert state["epoch"] == 2 and after["metrics"]["epoch"] == 1 and again["scores"] == first["scores"]
    assert all(torch.equal(after["captioner"][k], v) for k, v in chosen["captioner"].items())
    assert "had stopped early after epoch 2" in capsys.readouterr().out


@pytest.mark.slow
def test_synthetic_run_reads_its_captions_back(adapt_synth, tmp_path, capsys):
    """On a synthetic set caption.py parses every test caption against scenes.json, prints the figures and stores
    them in the results; on a real-format set (no scenes.json) it stores None."""
    tiny_encoder(tmp_path / "adapted.pt", adapt_synth)
    results = run(tmp_path, epochs=1)
    preds = {p["id"]: p["caption"] for p in results["predictions"]}
    assert results["read_back"] == synth.report(preds, synth.read_scenes(adapt_synth))
    assert 0 <= results["attention"]["map on the change %"] <= 100 and 0 < results["attention"]["random patch %"] < 100
    assert results["read_back"]["change pairs"] == results["read_back"]["distractor pairs"] == len(preds) // 2
    assert "read back against the scenes" in capsys.readouterr().out
    assert json.loads((tmp_path / "captions.json").read_text())["read_back"] == results["read_back"]
    # the figures themselves: the references read back as all right, "no change" everywhere as no change at all
    scenes, refs = synth.read_scenes(adapt_synth), {p["id"]: p["references"][0] for p in results["predictions"]}
    right = synth.report(refs, scenes)
    assert (right["change caption %"], right["right type %"], right["right object %"]) == (100.0, 100.0, 100.0)
    assert right["no change on distractors %"] == 100.0 and right["change pairs"] == len(refs) // 2
    types = Counter(scenes[i]["type"] for i in refs if not i.endswith("_n"))
    assert {t: right[t]["right type %"] for t in types} == {t: 100.0 for t in types}
    silent = synth.report({i: "there is no change" for i in refs}, scenes)
    assert (silent["change caption %"], silent["right type %"], silent["no change on distractors %"]) == (0, 0, 100)
    moved = synth.report({i: "the thing has moved" for i in refs}, scenes)  # a change, of one type, everywhere
    assert moved["change caption %"] == 100 and moved["no change on distractors %"] == 0
    assert moved["right type %"] == round(100 * types["move"] / sum(types.values()), 1) < 100
    real = tmp_path / "real"
    shutil.copytree(adapt_synth, real, ignore=shutil.ignore_patterns("scenes.json"))
    tiny_encoder(tmp_path / "adapted.pt", real)
    assert run(tmp_path, epochs=1)["read_back"] is None


def test_maps_on_the_change(synth_set):
    """A map whose strongest patch holds the changed object counts; the chance figure is the share of patches it
    covers."""
    items = [it for it in data.load_items("clevr", synth_set, "train", "total") if not it.id.endswith("_n")]
    g, maps = 6, []
    for it in items:
        region = synth.changed_region(synth_set, it.id)
        side = "after" if region["before"] is None else "before"
        x0, y0, x1, y1 = region[side]
        m = {s: np.zeros((g, g)) for s in ("before", "after")}
        m[side][int((y0 + y1) / 2 * g), int((x0 + x1) / 2 * g)] = 1.0
        maps.append(m)
    on, chance = plots.maps_on_change(maps, items, synth_set)
    assert on == 100 and 0 < chance < 50
    for m in maps:
        for side in m:
            m[side] = np.roll(m[side], (3, 3), axis=(0, 1))  # half a grid away
    assert plots.maps_on_change(maps, items, synth_set)[0] < 50


# -------------------------------------------------------------------------------------------------------------
# pretrain.py: CLIP in miniature (the run, its resume) and the small CLIP shipped in assets/

@pytest.mark.slow
def test_pretrain_lowers_its_loss_and_resumes_exactly(tmp_path, capsys):
    args = TINY_PRETRAIN + ["--root", str(tmp_path / "scenes")]
    full = pretrain.main(args + ["--out", str(tmp_path / "full.pt"), "--eval-every", "30"])
    assert len(full) == 2 and full[-1]["loss"] < 0.9 * full[0]["loss"], [h["loss"] for h in full]
    assert 0 <= full[-1]["hard-negative R@1"] <= 100 and all(f"probe {a}" in full[-1] for a in synth.ATTRS)
    # stopped by --time-limit after its first evaluation (step 20, inside the run above's first 30 steps), then
    # resumed: the same weights as the run that never stopped
    part = pretrain.main(args + ["--out", str(tmp_path / "cut.pt"), "--time-limit", "0"])
    assert len(part) == 1 and "continue with --resume" in capsys.readouterr().out
    pretrain.main(args + ["--out", str(tmp_path / "cut.pt"), "--resume"])
    a, b = (torch.load(tmp_path / f, weights_only=False)["model"] for f in ("full.pt", "cut.pt"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the shipped form: fp16, OpenAI's keys and no pair parameters, read by the loader of OpenAI's file
    pretrain.main(["--out", str(tmp_path / "full.pt"), "--export", str(tmp_path / "ship.pt")])
    sd, _ = clip_load.read_state_dict(tmp_path / "ship.pt")
    assert all(v.dtype == torch.float16 for v in sd.values()) and not any(k in sd for k in M.PAIR_KEYS)
    loaded = clip_load.load_clip(tmp_path / "ship.pt", n_inter=1)
    assert_close(loaded.state_dict()["visual.proj"], a["visual.proj"].half().float(), atol=0)


@pytest.mark.slow
def test_mimetic_init_attends_to_itself_and_subtracts(tmp_path, monkeypatch):
    """pretrain.mimetic_init_ (--mimetic-init): on random LayerNormed tokens every head of every block gives a token
    itself many times the uniform weight (OpenAI's init: about 1x), W_o W_v is about -0.4 I; main applies it to
    the image tower before training, the text tower untouched."""
    cfg = M.CLIPConfig(embed_dim=32, image_resolution=48, vision_layers=3, vision_width=128, vision_patch_size=16,
                       context_length=8, transformer_width=64, transformer_heads=1, transformer_layers=1, n_inter=1)
    torch.manual_seed(0)
    x = F.layer_norm(torch.randn(4, 30, 128), (128,))
    for mimetic in (False, True):
        m = M.CLIP(cfg)
        if mimetic:
            pretrain.mimetic_init_(m.visual)
        for block in m.visual.transformer.resblocks:
            own = plots.attention_weights(block.attn, x).diagonal(dim1=-2, dim2=-1).mean((0, 2)) * 30  # per head
            value = block.attn.out_proj.weight @ block.attn.in_proj_weight[256:]  # W_o W_v
            if mimetic:
                assert own.shape == (2,) and (own > 10).all() and abs(value.diagonal().mean() + 0.4) < 0.05
            else:
                assert (own < 2).all() and abs(value.diagonal().mean()) < 0.05
    seen = []
    real = pretrain.mimetic_init_
    monkeypatch.setattr(pretrain, "mimetic_init_", lambda visual: seen.append(visual) or real(visual))
    args = TINY_PRETRAIN + ["--root", str(tmp_path / "scenes"), "--samples", "32", "--eval-every", "2"]
    pretrain.main(args + ["--out", str(tmp_path / "a.pt"), "--no-mimetic-init"])
    assert not seen
    pretrain.main(args + ["--out", str(tmp_path / "b.pt")])  # on by default: the shipped file's command
    assert len(seen) == 1 and isinstance(seen[0], M.VisionTransformer)


@pytest.mark.slow
def test_object_loss_names_the_object_under_each_patch(tmp_path):
    """--object-loss: each object's row points at the patch its centre falls in (row = v, column = u) and at its
    own attributes, the phrases follow OBJECTS' order, the loss prefers a token's own phrase, and a run through
    main adds it to CLIP's loss and lowers both."""
    root = tmp_path / "scenes"
    synth.make_synth(root, 6, seed=5, workers=1)
    images = pretrain.scene_images(root, "train", 1)
    cache = data.ImageCache([data.Item(str(i), p, p, ["-"]) for i, (p, _) in enumerate(images)], 48, 1,
                            directory=tmp_path / "cache")
    ds = pretrain.Descriptions(images, cache, 1, 77, patch_size=16, objects=True)  # a 3 x 3 grid
    _, _, objects, phrases = ds.batch(list(range(len(images))), epoch=0).values()
    want = [(b, 1 + 3 * math.floor(3 * v) + math.floor(3 * u), tuple(o[a] for a in synth.ATTRS))
            for b, (_, objs) in enumerate(images) for o, (u, v) in objs]
    assert [(b, c, pretrain.OBJECTS[i]) for b, c, i in objects.tolist()] == want
    assert any((c - 1) // 3 != (c - 1) % 3 for _, c, _ in want)  # an object off the diagonal: u, v told apart
    named = [tuple(synth.WORD.get(w, w) for w in decode(ids).split()[1:]) for ids in phrases]
    assert named == pretrain.OBJECTS and len(named) == 96
    gen = torch.Generator().manual_seed(0)
    text, target = torch.randn(96, 32, generator=gen), torch.randint(96, (40,), generator=gen)
    own, shuffled = (pretrain.object_loss(text[t], text, target, torch.tensor(math.log(10))) for t in
                     (target, target.roll(1)))
    assert own < shuffled - 1, (own, shuffled)
    args = TINY_PRETRAIN + ["--root", str(root), "--scenes", "6", "--samples", "320", "--eval-every", "10",
                            "--batch-size", "8", "--eval-images", "8"]
    plain = pretrain.main(args + ["--out", str(tmp_path / "plain.pt")])
    both = pretrain.main(args + ["--out", str(tmp_path / "both.pt"), "--object-loss", "1"])
    assert both[0]["loss"] > plain[0]["loss"] + 1  # the object term (about ln 96 at first) is in the loss
    assert both[-1]["loss"] < 0.9 * both[0]["loss"], [h["loss"] for h in both]


def test_shipped_mini_clip_sees_objects(tmp_path):
    """The shipped mini CLIP: loaded by name with its SHA256 checked (resolve), at most 10 MB, shaped as OpenAI's
    (words as wide as its tokens, which the captioner needs), a 12x12 patch grid, and image -> description retrieval
    far above chance on scenes rendered here with a seed its pretraining never saw."""
    name = adapt.PRESETS["mini"]["clip"]
    path = clip_load.resolve(name)  # its SHA256 checked
    assert path.stat().st_size <= 10 * 2 ** 20 and clip_load.sha256(path) == clip_load.SHIPPED[name][1]
    clip = clip_load.load_clip(name)
    assert clip.cfg.vision_width == 128 and clip.visual.conv1.weight.dtype == torch.float32
    assert clip.cfg.embed_dim == clip.cfg.transformer_width == 64
    assert clip.cfg.image_resolution // clip.cfg.vision_patch_size == 12
    # scenes it never saw (another seed than its own): each image against every scene's description (chance 1/n)
    synth.make_synth(tmp_path, 24, seed=99, workers=1)
    images, texts = [], []
    for i in range(24):
        if (objs := synth.views(i, 99)["images/CLEVR_default"]) is not None:
            images.append(load_image(tmp_path / f"images/CLEVR_default_{i:06d}.png", clip.cfg.image_resolution))
            texts.append(synth.description([o for o, _ in objs], i))
    with torch.no_grad():
        img = F.normalize(clip.encode_image(torch.stack(images)), dim=-1)
        txt = F.normalize(clip.encode_text(tokenize(texts, clip.cfg.context_length)), dim=-1)
    right = ((img @ txt.t()).argmax(1) == torch.arange(len(texts))).float().mean().item()
    assert len(texts) >= 16 and right >= 0.5, f"image -> description R@1 {right:.0%} among {len(texts)}"


# -------------------------------------------------------------------------------------------------------------
# plots.py: attention maps and pictures

def test_pair_maps_and_pictures(tmp_path):
    g, heads = 3, 2
    T = 2 * (g * g + 1)
    w = np.full((heads, T, T), 1e-3)
    w[:, 0, g * g + 2 + 5] = w[:, g * g + 1, g * g + 2 + 5] = 1.0  # both [CLS] look at the after image's patch 5
    w /= w.sum(-1, keepdims=True)
    maps = plots.pair_maps(w, g)
    assert maps["after"].shape == (g, g) and divmod(int(maps["after"].argmax()), g) == divmod(5, g) == (1, 2)
    assert all(abs(m.sum() - 1) < 1e-9 for m in maps.values())  # a distribution over each image's patches
    assert np.allclose(maps["before"], 1 / (g * g))  # uniform where they do not look
    before, after = Image.new("RGB", (180, 120), (90, 90, 90)), Image.new("RGB", (180, 120), (200, 90, 90))
    hot = np.asarray(plots.overlay(after, maps["after"]))
    assert hot.shape == (120, 180, 3) and hot[60, 150].sum() > hot[10, 10].sum()  # bright where the map is
    assert plots.explain(tmp_path / "e.png", before, after, "a cube moved", maps).size == (2 * 288 + 12, 2 * 192 +
                                                                                            12 + 2 * 14 + 10 + 14)
    plots.gallery(tmp_path / "g.png", [{"before": before, "after": after, "maps": maps, "lines": ["x"]}] * 2)
    assert Image.open(tmp_path / "g.png").size == (4 * (192 + 4) + 440, 2 * 136)
    history = [{"epoch": e, "loss": 3 / e, "val CIDEr-D": 10 * e} for e in range(1, 6)]
    assert plots.curves(tmp_path / "c.png", history, "val CIDEr-D").size == (1280, 240)
    px = np.asarray(Image.open(tmp_path / "c.png").convert("RGB"))
    line = (px == (31, 119, 180)).all(-1)  # the curves' colour, in both panels
    assert line[:, :640].sum() > 100 and line[:, 640:].sum() > 100
    best = np.argwhere((px == (214, 39, 40)).all(-1))  # the best point of each panel, marked in red
    assert best[best[:, 1] < 640, 1].min() > 500 and best[best[:, 1] >= 640, 1].min() > 1100  # epoch 5 in both


# -------------------------------------------------------------------------------------------------------------
# train_utils.py: the training rule's table, the epoch loop, devices, processes

@pytest.mark.subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_setup_keeps_freed_memory_for_reuse():
    """train_utils.setup on a CPU: a 40 MiB tensor made and freed again and again (an MLP activation of the 12x12
    mini CLIP at batch 64 is 38 MiB) reuses the process's memory instead of faulting in fresh pages each time, as
    glibc does above its mmap threshold. Counted in page faults, in a fresh process (the setting is global)."""
    code = ("import resource, sys, torch, train_utils\n"
            "if sys.argv[1] == 'setup': train_utils.setup(0, 'cpu')\n"
            "faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "before = faults()\n"
            "for _ in range(10): a = torch.ones(10 << 20); b = a * 2; del a, b\n"
            "print((faults() - before) / 20 / (40 << 20 >> 12))")  # faulted pages per tensor / its pages
    share = {}
    for how in ("plain", "setup"):
        r = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parent)
        assert r.returncode == 0, r.stderr[-2000:]
        share[how] = float(r.stdout)
    if share["plain"] < 0.9:
        pytest.skip(f"this allocator reuses 40 MiB blocks by itself ({share['plain']:.2f} of the pages faulted)")
    assert share["setup"] < 0.5, share


def test_training_rule_in_plain_sight():
    """adapt.py's paper rule, printed as a table: the authors' frozen input embeddings, CLIP at 1e-7, the new pair
    parameters at 1e-4; freeze() alone changes requires_grad (param_groups only groups)."""
    cfg = M.CLIPConfig(embed_dim=64, image_resolution=64, vision_layers=4, vision_width=128, vision_patch_size=16,
                       context_length=24, transformer_width=128, transformer_heads=2, transformer_layers=2, n_inter=2)
    m = M.CLIP(cfg)
    rule = adapt.lr_rule(preset_settings(adapt, "paper"))
    train_utils.param_groups(m.named_parameters(), rule, 0.2)
    assert all(p.requires_grad for p in m.parameters())
    train_utils.freeze(m.named_parameters(), rule)
    assert not m.visual.conv1.weight.requires_grad and m.visual.proj.requires_grad
    rows = {line.split()[0]: line.split()[1:] for line in train_utils.policy_table(m.named_parameters(),
                                                                                     rule).splitlines()}
    assert rows["visual.conv1"][0] == "frozen" and rows["token_embedding"][0] == "frozen"
    assert rows["visual.transformer.resblocks"][:2] == ["lr", "1e-07"] and rows["visual.bef_embedding"][1] == "0.0001"
    assert sum(int(r[-1].replace(",", "")) for r in rows.values()) == sum(p.numel() for p in m.parameters())
    # --freeze-blocks: the intra blocks (here 2 of 4) frozen and given no gradient; the inter blocks and the text
    # tower train at --lr-clip. The mini preset freezes its 4 intra blocks; for 6 + 0 (--n-inter 0) the same
    # flag leaves the last blocks training, each image alone, and e1, e2, p, ln_mid after them (the authors')
    m = M.CLIP(cfg)
    args = preset_settings(adapt, "paper", "--freeze-blocks", "2", "--lr-clip", "3e-4")
    assert preset_settings(adapt, "paper").freeze_blocks == 0
    assert adapt.PRESETS["mini"]["freeze_blocks"] == 4
    # the paper preset's epochs, the authors' scripts': 12 on CLEVR-Change, 20 on Spot-the-Diff (a flag given wins)
    paper = lambda *a: adapt.settings(["--preset", "paper", "--clip", "mini64-synth", "--data-root", "absent", *a]
                                      ).epochs
    assert (paper(), paper("--data", "spot"), paper("--data", "spot", "--epochs", "3")) == (12, 20, 3)
    rule_6_0 = adapt.lr_rule(preset_settings(adapt, "mini", "--n-inter", "0"))
    assert rule_6_0("visual.transformer.resblocks.3.mlp.c_fc.weight") is None
    assert rule_6_0("visual.bef_embedding") == 1e-3
    assert rule_6_0("visual.transformer.resblocks.4.mlp.c_fc.weight") == 3e-4 == rule_6_0("visual.proj")
    train_utils.freeze(m.named_parameters(), adapt.lr_rule(args))
    blocks = m.visual.transformer.resblocks
    assert [all(p.requires_grad for p in b.parameters()) for b in blocks] == [False, False, True, True]
    x, ids = torch.randn(2, 3, 64, 64), bench.random_ids(2, 24, "cpu")
    adapt.contrastive_loss(*adapt.PairText(m)(x, x.flip(0), ids)).backward()
    assert blocks[0].attn.in_proj_weight.grad is None and blocks[2].attn.in_proj_weight.grad.abs().sum() > 0
    assert m.transformer.resblocks[0].attn.in_proj_weight.grad.abs().sum() > 0


def test_shared_p_lines_up_the_two_images_of_a_mimetic_clip():
    """model.share_joint_positions_ (adapt.py --shared-p): in a mimetically initialized pair encoder (several heads,
    a non-square batch of distinct before/after images) a patch then gives its own position in the other image
    tens of times the uniform weight in the inter block's attention, against a few times with the authors'
    independently drawn p."""
    cfg = M.CLIPConfig(embed_dim=32, image_resolution=96, vision_layers=4, vision_width=128, vision_patch_size=16,
                       context_length=8, transformer_width=64, transformer_heads=1, transformer_layers=1, n_inter=1)
    torch.manual_seed(0)
    clip = M.CLIP(cfg)
    pretrain.mimetic_init_(clip.visual)
    before = torch.randn(3, 3, 96, 96)
    after = before + torch.randn(3, 3, 96, 96)

    def own_position():  # per head: a before patch's weight on its position in the after image, x uniform (1/74)
        w = plots.inter_attention(clip.visual, before, after)  # (B, heads, 74, 74)
        return (w[:, :, torch.arange(1, 37), torch.arange(38, 74)].mean((0, 2)) * 74).tolist()
    drawn = own_position()
    M.share_joint_positions_(clip.visual, 30.0)
    shared = own_position()
    assert len(shared) == 2 and min(shared) > 20 and min(shared) > 2 * max(drawn), (drawn, shared)


def test_caption_loss_is_the_mean_over_words_not_padding():
    """caption_loss, paper Sec. 3.3: -(1/N) sum log p(w_t | w_<t, pair) over the N words of a padded batch, <eos>
    included and padding not, computed here by hand, word by word, on captions of different lengths as
    encode_captions pads them and caption.batch_loss shifts them (inputs ids[:, :-1], targets ids[:, 1:])."""
    items = [data.Item(str(i), "b.png", "a.png", [c]) for i, c in
             enumerate(["a red cube", "the small gray metal sphere has been moved", "no change"])]
    ids = caption.encode_captions(items, 12)
    targets = ids[:, 1:]
    torch.manual_seed(0)
    logits = torch.randn(3, 12, 49408) * 3
    terms = [-logits[b, t].log_softmax(-1)[targets[b, t]] for b in range(3) for t in range(12)
             if targets[b, t] != caption.PAD]
    assert len(terms) == 4 + 9 + 3  # each caption's words and its <eos>
    assert torch.allclose(caption.caption_loss(logits, targets), torch.stack(terms).mean(), atol=1e-6)


def test_batch_loss_keeps_the_end_of_a_caption_with_an_exclamation_mark():
    """caption.batch_loss cuts the batch's padding after its last token, not after its count of tokens: CLIP's BPE
    pads with 0, which is also "!" (as in "!("), so the longest caption, one with such a "!", keeps its end (the loss
    equals the uncut batch's, the decoder being causal)."""
    pair = paper_captioner()
    ids = caption.encode_captions([data.Item("0", "b", "a", ["the cube !( is red !; now", "a cube"])], 16)
    assert (ids[0, 1:ids[0].tolist().index(clip_load.EOT)] == 0).sum() == 2  # two "!" inside the caption
    grid = PAPER_CLIP.image_resolution // PAPER_CLIP.vision_patch_size
    batch = {"ids": ids, "features": torch.randn(2, 2 * (grid ** 2 + 1), PAPER_CLIP.embed_dim)}
    with torch.no_grad():
        got = caption.batch_loss(pair, batch, "cpu", frozen=True)
        logits = pair(ids[:, :-1], tokens=batch["features"])
    assert got.item() == pytest.approx(caption.caption_loss(logits, ids[:, 1:]).item(), rel=1e-6)


def test_caption_rule_and_presets_in_plain_sight(tmp_path):
    """caption.py's training settings come from its preset unless a flag says otherwise (the paper's weight decay,
    warmup, clipping and eps: the authors' 0.01, 0.1, 1.0 and 1e-6); its rule: the captioner at
    --lr, the text tower never, the pair encoder frozen or at --encoder-lr but its input embeddings (e1, e2, p,
    ln_mid too at 12 + 0: the authors' module uses them), the tied word embeddings at --words-lr, by default frozen but
    on Spot-the-Diff; a rate of 0 fixes."""
    for stage in (adapt, caption):  # complete: every preset sets every key
        assert len({tuple(p) for p in stage.PRESETS.values()}) == 1
    args = preset_settings(caption, "paper")
    assert (args.weight_decay, args.warmup, args.grad_clip, args.eps) == (0.01, 0.1, 1.0, 1e-6)
    assert all(getattr(args, k) == v for k, v in caption.PRESETS["paper"].items())
    args = caption.settings(["--ckpt", "mini64-synth", "--warmup", "0.3", "--weight-decay", "0.5", "--data-root",
                             "absent"])
    assert args.preset == "mini" and (args.warmup, args.weight_decay) == (0.3, 0.5)
    assert args.epochs == caption.PRESETS["mini"]["epochs"]
    assert args.encoder_lr == 0 and args.freeze_encoder  # the mini preset: a rate of 0, the encoder fixed
    assert caption.lr_rule(args)("clip.visual.bef_embedding") is None
    assert caption.lr_rule(args)("clip.token_embedding.weight") == args.words_lr > 0
    # the paper preset: the authors' rule (main_task_caption.py 640-667, --freeze_layer_num 0)
    args = preset_settings(caption, "paper", "--lr", "2e-4", "--encoder-lr", "1e-6", data="clevr")
    rule = caption.lr_rule(args)
    assert rule("captioner.decoder.0.attn.q_proj.weight") == 2e-4 == rule("captioner.head_bias")
    assert rule("clip.visual.transformer.resblocks.0.attn.in_proj_weight") == 1e-6 == rule("clip.visual.proj")
    assert all(rule("clip." + k) is None for k in ("visual.conv1.weight", "visual.class_embedding",
                                                    "visual.positional_embedding", "visual.ln_pre.bias"))
    assert rule("clip.visual.bef_embedding") == 1e-6 and rule("clip.transformer.resblocks.0.ln_1.weight") is None
    assert rule("clip.token_embedding.weight") is None is rule("clip.positional_embedding")  # the tied words, CLEVR
    spot = caption.settings(["--ckpt", "mini64-synth", "--data", "spot", "--data-root", "absent", "--preset", "paper",
                             "--encoder-lr", "1e-6", *CPU])  # the words' rate decided by the data
    assert spot.words_lr == 1e-6 and not spot.pair_distractors
    spot = caption.lr_rule(spot)
    assert spot("clip.token_embedding.weight") == 1e-6 == rule("clip.visual.ln_post.weight")  # theirs: trained there
    assert spot("clip.visual.bef_embedding") == 1e-6
    own = caption.lr_rule(preset_settings(caption, "paper", "--words-lr", "3e-5", data="clevr"))
    assert own("clip.token_embedding.weight") == 3e-5 and own("clip.positional_embedding") is None
    # an encoder adapted with the scratch preset is captioned with the mini one
    torch.save({"model": load_clip("mini64-synth").state_dict(), "stage": "adapt", "args": {"preset": "scratch"}},
               tmp_path / "adapted.pt")
    args = caption.settings(["--ckpt", str(tmp_path / "adapted.pt"), "--data-root", "absent"])
    assert args.preset == "mini" and all(getattr(args, k) == v for k, v in caption.PRESETS["mini"].items())


@pytest.mark.slow
def test_step_flops_match_torch_counter():
    """bench.adapt_step_flops (the MFU numerator) equals torch's FLOP counter on a pair step with several heads,
    non-square counts of intra/inter blocks and a frozen patch convolution (attention through the plain path,
    which the counter sees as matmuls)."""
    from torch.utils.flop_counter import FlopCounterMode
    cfg = M.CLIPConfig(embed_dim=64, image_resolution=64, vision_layers=5, vision_width=128, vision_patch_size=16,
                       context_length=24, transformer_width=128, transformer_heads=2, transformer_layers=2, n_inter=2)
    m = M.CLIP(cfg)
    rule = adapt.lr_rule(preset_settings(adapt, "paper", "--n-inter", "2"))
    train_utils.freeze(m.named_parameters(), rule)  # conv1 and the embeddings frozen, as the paper preset
    x, ids = torch.randn(3, 3, 64, 64), bench.random_ids(3, 24, "cpu")
    old = M.USE_SDPA
    M.USE_SDPA = False
    try:
        with FlopCounterMode(display=False) as counter:
            adapt.contrastive_loss(*adapt.PairText(m)(x, x.flip(0), ids)).backward()
    finally:
        M.USE_SDPA = old
    want = bench.adapt_step_flops(cfg, 3, 24)
    assert abs(counter.get_total_flops() - want) / want < 1e-4, (counter.get_total_flops(), want)


@pytest.mark.slow
def test_bench_e2e_runs_on_cpu(tmp_path, capsys):
    """`bench.py e2e` on the CPU (what .ci/gpu_checks.sh runs on a GPU): it renders its set, builds a fresh image
    cache in its workdir, and the loader alone delivers every timed batch's pairs (a rate, not a timing)."""
    bench.main(["e2e", "--device", "cpu", "--scenes", "8", "--batch", "4", "--batches", "2", "--workers", "0",
                "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "rendered 8 scenes" in out and "building the cache" in out
    assert float(re.search(r"loader alone: +([\d.]+) pairs/s", out).group(1)) > 0
    assert len(list(tmp_path.glob("tmp*/*/images.npy"))) == 1  # the cache went into the workdir, not the user's


@pytest.mark.slow
def test_bench_adapt_runs_on_cpu(capsys):
    """`bench.py adapt` on the CPU: one ViT-B/32 step under adapt.py's own paper-preset arguments (not a copy)."""
    args = bench.paper_adapt_args()
    assert (args.lr_new, args.lr_clip, args.batch_size, args.warmup, args.grad_clip) == (1e-4, 1e-7, 128, 0.1, 1.0)
    bench.main(["adapt", "--device", "cpu", "--batch", "2", "--repeats", "1"])
    assert re.search(r"ours, fp32 on the CPU: \d+ ms/step", capsys.readouterr().out)


@pytest.mark.slow
def test_bench_compiled_step_inside_the_graph_trains_as_eager():
    """`bench.py adapt --impl ours+compile+graphs` (the compiled step inside the CUDA graph) on the CPU, where the
    graph step runs as it is and the compile is real (inductor): from the same weights its first steps' losses are
    the eager step's (TINY: a 4 x 4 grid, two heads), so on the GPU only the capture is new."""
    cpu, losses = torch.device("cpu"), []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for impl in ("ours", "ours+compile+graphs"):
        torch.manual_seed(0)
        compiled, graphs = bench.ADAPT_IMPLS[impl]
        _, step = bench.our_adapt_step(cpu, train_utils.autocast(cpu), compiled, 4, 24, graphs, cfg=TINY)
        losses.append(torch.stack([step().detach() for _ in range(3)]))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the model went through the compiler
    assert losses[0][0] > losses[0][2] and torch.allclose(losses[0], losses[1], rtol=1e-4), losses


def test_selection_ties_go_to_the_later_epoch_as_the_authors(tmp_path):
    """Model selection (train_utils.end_epoch), in every preset: an epoch whose val figure equals the best is saved
    (the authors' `best_score <= R1`), stage 1 by text->pair R@1; a lower one counts an epoch without gain (stage 2's
    paper preset stops after 11 of them: their early_stop > 10)."""
    assert adapt.SELECT == "text->pair R@1"
    run, val = train_utils.new_run(), {"text->pair R@1": 30.0, "pair->text R@1": 10.0}
    saved = [train_utils.end_epoch(run, 1.0, val, val["text->pair R@1"]),
             train_utils.end_epoch(run, 1.0, {**val, "pair->text R@1": 99.0}, val["text->pair R@1"])]
    assert saved == [True, True] and (run["best"], run["best_epoch"], run["epochs_without_gain"]) == (30.0, 2, 0)
    assert not train_utils.end_epoch(run, 1.0, val, 29.0) and run["epochs_without_gain"] == 1
    assert train_utils.end_epoch(run, 1.0, val, 31.0) and run["epochs_without_gain"] == 0
    assert caption.PRESETS["paper"]["patience"] == 11


def test_resume_refuses_other_settings():
    """--resume continues a run as it was set: a setting that differs from the saved one (a learning rate the saved
    optimizer would overwrite) is an error naming it; the run-only ones (device, workers, logging) may change."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = train_utils.authors_schedule(opt, 10)
    saved = {"args": {"lr_new": 1e-3, "workers": 0}, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict(), "rng": train_utils.rng_state(), **train_utils.new_run()}
    with pytest.raises(SystemExit, match="the run was set lr_new=0.001, this command lr_new=0.002"):
        train_utils.resume_run(saved, model, opt, sched, train_utils.Settings(lr_new=2e-3, workers=0))
    run = train_utils.resume_run(saved, model, opt, sched, train_utils.Settings(lr_new=1e-3, workers=4))
    assert run == train_utils.new_run()
    # --amp auto is saved as what it ran: a CPU run resumed on a GPU is refused, not switched to bf16 midway
    amp = lambda device: train_utils.concrete_amp("auto", device)
    assert (amp("cpu"), amp("cuda:0"), train_utils.concrete_amp("bf16", "cpu")) == ("off", "bf16", "bf16")
    saved["args"] = {"lr_new": 1e-3, "amp": amp("cpu"), "device": "cpu"}
    with pytest.raises(SystemExit, match="the run was set amp='off', this command amp='bf16'"):
        train_utils.resume_run(saved, model, opt, sched, train_utils.Settings(lr_new=1e-3, amp=amp("cuda:0"),
                                                                              device="cuda:0"))


def _steps(graphed, n=5, rates=None):
    """n training steps of a tiny CLIP (2 heads per tower) on random pairs -> (losses, weights, learning rates):
    adapt.py's eager step, or GraphedStep (adapt.py --cuda-graphs), which a CPU runs uncaptured; BertAdam and the
    authors' schedule. rates: a list that gets each step's (lr tensor objects, their values) as the step reads them."""
    torch.manual_seed(0)
    model = M.CLIP(TINY)
    net = adapt.PairText(model)
    rule = adapt.lr_rule(SimpleNamespace(clip="a CLIP file", n_inter=TINY.n_inter, lr_new=3e-3, lr_clip=1e-3,
                                         freeze_blocks=0))
    train_utils.freeze(model.named_parameters(), rule)
    groups = train_utils.param_groups(model.named_parameters(), rule, 0.2, train_utils.authors_decays(model))
    optimizer = train_utils.BertAdam(groups, lr=3e-3, betas=(0.9, 0.98))
    scheduler = train_utils.authors_schedule(optimizer, n + 2, 0.3)
    if rates is not None:
        optimizer.register_step_pre_hook(lambda opt, *_: rates.append(
            [(id(g["lr"]), float(g["lr"])) for g in opt.param_groups]))
    params = [p for g in groups for p in g["params"]]
    ctx = SimpleNamespace(device=torch.device("cpu"), amp=train_utils.autocast(torch.device("cpu")))
    g = torch.Generator().manual_seed(1)
    words = ["a red cube", "the small red metal cube changed to blue", "no change", "a ball", "the cylinder moved"]
    batches = [{"before": torch.randn(5, 3, 32, 32, generator=g), "after": torch.randn(5, 3, 32, 32, generator=g),
                "ids": tokenize(words[i:] + words[:i])} for i in range(n)]
    def update(b):  # adapt.py's
        with ctx.amp:
            loss = adapt.contrastive_loss(*net(b["before"], b["after"], b["ids"]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss.detach()

    def step(b):
        optimizer.zero_grad(set_to_none=True)
        loss = update(b)
        scheduler.step()
        return loss
    if graphed:
        step = train_utils.GraphedStep(ctx, update, optimizer, scheduler, params)
    losses = [float(step(b)) for b in batches]
    return losses, model.state_dict(), [float(group["lr"]) for group in optimizer.param_groups]


def test_graphed_step_reads_the_authors_rate_each_step():
    """GraphedStep with BertAdam and the authors' schedule (adapt.py --cuda-graphs), on a CPU, where nothing is
    captured: the same losses, weights and rates as the eager step, and its rates are tensors that stay the same
    objects (a captured graph reads them at their address) while the schedule fills them anew before each step: a
    rate read once as a Python number would be captured once and never change. The capture needs a GPU (the cuda
    group)."""
    eager, graphed = [], []
    (l1, w1, lr1), (l2, w2, lr2) = _steps(False, 6, eager), _steps(True, 6, graphed)
    assert l1 == pytest.approx(l2, rel=1e-6) and l1[0] != l1[-1]
    assert lr1 == pytest.approx(lr2, rel=1e-6) and len(set(lr1)) == 2
    torch.manual_seed(0)
    assert not torch.equal(w1["visual.proj"], M.CLIP(TINY).state_dict()["visual.proj"])  # the steps moved it
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], atol=1e-6, rtol=1e-6, msg=k)
    assert [v for step in eager for _, v in step] == pytest.approx([v for step in graphed for _, v in step])
    assert len({tuple(i for i, _ in step) for step in graphed}) == 1  # the same tensors every step
    assert len({step[0][1] for step in graphed}) == 6 and graphed[0][0][1] == 0  # new values; their first rate 0


def test_normalize_copies_nothing_to_the_device_twice():
    """clip_load.normalize inside a captured step (GraphedStep): CUDA refuses a copy from unpinned CPU memory during
    a capture, so CLIP's mean and std reach a device once, at the first call there (the warm-up), and never again.
    Checked on the meta device, which stands for any device but the CPU here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CrossDevice(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in (*args, out) if isinstance(t, torch.Tensor)]
            if len({t.device for t in tensors}) > 1:
                self.seen.append(str(func))
            return out
    with CrossDevice() as mode:
        torch.ones(3).to("meta")
    assert mode.seen == ["aten._to_copy.default"]  # the mode sees a copy to the device: the check below can fail
    x = torch.zeros(2, 3, 4, 5, dtype=torch.uint8, device="meta")
    clip_load.normalize(x)
    mode.seen.clear()
    with mode:
        y = clip_load.normalize(x)
    assert y.shape == x.shape and y.dtype == torch.float32 and not mode.seen, mode.seen


@pytest.mark.slow
def test_cuda_graphs_flag_trains_as_eager(adapt_synth, tmp_path, monkeypatch):
    """adapt.py --cuda-graphs through main on a CPU (every step through GraphedStep: static caption length, the
    learning rates as tensors; no capture): the epoch's loss and the adapted weights of a run without it, to float
    tolerance."""
    argv = TINY_ADAPT + ["--data-root", str(adapt_synth), "--epochs", "1"]
    adapt.main(argv + ["--out", str(tmp_path / "eager.pt")])
    calls, real = [], train_utils.GraphedStep.__call__
    monkeypatch.setattr(train_utils.GraphedStep, "__call__", lambda self, b: calls.append(1) or real(self, b))
    adapt.main(argv + ["--out", str(tmp_path / "graphs.pt"), "--cuda-graphs"])
    assert len(calls) == torch.load(tmp_path / "graphs.last.pt", weights_only=False)["step"] > 0
    (a, b), (la, lb) = ((torch.load(tmp_path / f"{n}.pt", weights_only=False)["model"] for n in ("eager", "graphs")),
                        (torch.load(tmp_path / f"{n}.last.pt", weights_only=False)["history"][0]["loss"]
                         for n in ("eager", "graphs")))
    assert la == pytest.approx(lb, rel=1e-5)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=k)
    groups = [torch.load(tmp_path / f"{n}.last.pt", weights_only=False)["optimizer"]["param_groups"]
              for n in ("eager", "graphs")]
    assert not any(g.get("capturable") or isinstance(g["lr"], torch.Tensor) for g in groups[0])
    assert all(isinstance(g["lr"], torch.Tensor) for g in groups[1])  # GraphedStep


def test_train_epoch_stops_on_nan():
    model = torch.nn.Linear(2, 1)
    opt = train_utils.BertAdam([{"params": list(model.parameters()), "lr": 0.1}], lr=0.1)
    sched = train_utils.authors_schedule(opt, 10)
    ctx = train_utils.setup(0, "cpu")
    batches = [{"x": torch.ones(4, 2)}] * 3 + [{"x": torch.full((4, 2), float("nan"))}] + [{"x": torch.ones(4, 2)}] * 3

    def step(b):
        opt.zero_grad()
        loss = model(b["x"]).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        return loss.detach()
    with pytest.raises(SystemExit, match="loss became nan between steps 4 and 6 .*--resume"):
        train_utils.train_epoch(ctx, batches, step, opt, train_utils.new_run(), train_utils.Progress(0, 1, 7, 3))


def test_device_cuda_gets_an_index(monkeypatch):
    """--device cuda (offered by --help) is cuda:0, and cuda:1 stays cuda:1: torch.cuda.set_device refuses a
    device without an index (checked here by torch's own index rule; this machine has no GPU to set)."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.cuda._utils._get_device_index(d)))
    for device, want in (("cuda", 0), ("cuda:0", 0), ("cuda:1", 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CUDA autocast asked for on a machine without CUDA
            ctx = train_utils.setup(0, device)
        assert ctx.device == torch.device("cuda", want) and chosen[-1] == want


def test_device_flag_says_what_this_machine_has(monkeypatch):
    """--device's argparse type on a machine with two GPUs (faked: this one has none) and on this one: a device
    that exists passes, anything else is one line naming what is here."""
    bad = lambda text: pytest.raises(argparse.ArgumentTypeError, match=re.escape(text))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [train_utils.device_arg(d) for d in ("cpu", "cuda", "cuda:1")] == ["cpu", "cuda", "cuda:1"]
    with bad("'cuda:7' is not a device here; this machine has cpu, cuda:0 to cuda:1"):
        train_utils.device_arg("cuda:7")
    with bad("'mps' is not a device here; this machine has cpu, cuda:0 to cuda:1"):
        train_utils.device_arg("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with bad("'cuda': no CUDA here"):
        train_utils.device_arg("cuda")
    with bad("'gpu' is not a device here; this machine has cpu"):
        train_utils.device_arg("gpu")


# every entry point, each bad value of each flag that takes one: "argv => the flag the one-line error must name"
# (default: the first flag in argv). A case must fail before any real work (rendering, training).
BAD_FLAGS = {
    "adapt.py": ["--device cuda", "--device cuda:7", "--device mps", "--device gpu", "--batch-size 0",
                 "--batch-size x", "--epochs 0", "--warmup 1", "--swap-prob 2", "--workers -1",
                 "--n-inter -1", "--n-inter 7", "--preset scratch --n-inter 13 => --n-inter", "--image-size 0",
                 "--preset scratch --image-size 100 => --image-size", "--context-length 1",
                 "--vision-width 0", "--preset scratch --vision-width 200 => --vision-width", "--vision-layers 0",
                 "--patch-size 0", "--text-width 0", "--text-layers 0", "--embed-dim 0", "--lr-new -1",
                 "--lr-clip nan", "--weight-decay -1", "--grad-clip -1", "--eval-batch-size 0", "--log-every 0",
                 "--clip nowhere.pt", "--data-root nowhere", "--data spot => --data-root",
                 "--resume --out nowhere.pt", "--seed x", "--clip mini64-synth --vision-width 64 => --vision-width",
                 "--data spot --swap-prob 0.5 => --swap-prob", "--shared-p -1",
                 "--preset scratch --clip mini64-synth => --clip", "--authors-numerics --amp bf16 => --amp"],
    "caption.py": ["--device cuda", "--device cuda:7", "--device mps", "--device gpu",
                   "--patience 0", "--ckpt nowhere.pt", "--workers -1", "--n-inter -1",
                   "--heads 0", "--enc-layers 0", "--dec-layers 0", "--dropout 1",
                   "--epochs 0", "--batch-size 0", "--lr -1", "--encoder-lr -1", "--words-lr -1", "--weight-decay -1",
                   "--warmup 1", "--grad-clip -1", "--log-every 0", "--eval-batch-size 0",
                   "--ckpt mini64-synth --resume --out x.pt => --resume", "--ckpt mini64-synth --n-inter 9 => --n-inter",
                   "--ckpt mini64-synth --heads 3 => --heads",
                   "--ckpt mini64-synth --preset paper --enc-layers 2 => --enc-layers"],
    "evaluate.py": ["--device cuda", "--device gpu", "--beam 0", "--ckpt nowhere.pt", "--workers -1",
                    "--eval-batch-size 0", "--before a.png => --after", "--explain why.png => --explain",
                    "--before a.png --after b.png --gallery g.png => --gallery"],
    "pretrain.py": ["--device cuda", "--device cuda:7", "--device mps", "--device gpu", "--scenes 0",
                    "--image-size 0", "--patch-size 0", "--image-size 100 => --image-size", "--vision-width 0",
                    "--vision-width 200", "--vision-layers 0", "--text-width 0", "--text-layers 0", "--embed-dim 0",
                    "--context-length 1", "--batch-size 0", "--negatives -1", "--lr -1", "--weight-decay -1",
                    "--warmup 1", "--object-loss -1", "--grad-clip -1", "--samples 0", "--eval-every 0",
                    "--eval-images 0", "--time-limit -1", "--workers 0", "--log-every 0",
                    "--eval-only --ckpt nowhere.pt => --ckpt", "--eval-only --out nowhere.pt",
                    "--eval-only --ckpt mini64-synth --clevr-root nowhere => --clevr-root",
                    "--export x.pt --out nowhere.pt", "--resume --out nowhere.pt", "--ckpt mini64-synth => --ckpt"],
    "bench.py": ["decode --device cuda", "decode --device cuda:7", "decode --device mps", "decode --device gpu",
                 "adapt --device gpu", "decode --batch 0", "decode --max-len 0",
                 "decode --vocab 0", "decode --repeats 0", "decode --threads -1",
                 "adapt --batch 0", "adapt --text-len 0", "adapt --impl foo", "adapt --profile foo",
                 "e2e --root nowhere", "e2e --scenes 0", "e2e --batch 0", "e2e --workers -1", "e2e --batches 0",
                 "matmul --n 0"],
    "synth.py": ["make --pairs 0", "make --size 0 0", "make --workers 0"],
    "metrics.py": ["--refs nowhere.json --cands nowhere.json", "--refs list.json --cands list.json",
                   "--refs text.txt --cands text.txt",
                   "--refs refs.json --cands refs.json --paraphrase nowhere.gz => --paraphrase",
                   "--refs refs.json => --cands"],
}
# each case runs as its script's __main__ (runpy, exactly what `python SCRIPT ARGS` runs) in one subprocess per
# script, so torch is imported once: anything but SystemExit would print a traceback to a user
_RUN_CASES = r"""
import contextlib, io, json, runpy, sys, traceback
script, cases = sys.argv[1], json.loads(sys.argv[2])
out = []
for argv in cases:
    buf, code = io.StringIO(), 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        sys.argv = [script] + argv
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else (print(e.code, file=sys.stderr) or 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    out.append({"code": code, "text": buf.getvalue()})
print(json.dumps(out))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("script", list(BAD_FLAGS))
def test_every_bad_flag_is_one_line_not_a_traceback(script, tmp_path):
    """Each entry point with each bad flag value exits non-zero with one line that names the flag (and
    the value, and what is allowed), never a traceback. Run in an empty folder: no adapted.pt, no data/."""
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "text.txt").write_text("not json")
    (tmp_path / "refs.json").write_text(json.dumps({"1": ["a cube"]}))
    cases = [case.split(" => ") for case in BAD_FLAGS[script]]
    argvs = [argv.split() for argv, *_ in cases]
    # CUDA hidden: `--device cuda` is then a bad value on every machine, and no case can start real work on a GPU;
    # the repository prepended to PYTHONPATH, so that packages found through it (module systems) stay found
    here = str(Path(__file__).resolve().parent)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "CLIP4IDC_IMAGE_CACHE": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", _RUN_CASES, str(Path(__file__).resolve().parent / script),
                        json.dumps(argvs)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    wrong = []
    for (argv, *flag), argv_list, res in zip(cases, argvs, json.loads(r.stdout.splitlines()[-1])):
        flag = flag[0] if flag else next(a for a in argv_list if a.startswith("--"))
        lines = [line for line in res["text"].splitlines() if line.strip()]
        if res["code"] in (0, None) or "Traceback" in res["text"] or flag not in (lines[-1] if lines else ""):
            wrong.append(f"{script} {argv}: exit {res['code']}, says: {res['text'][-400:]!r}")
    assert not wrong, "\n".join(wrong)
    assert not (tmp_path / "data").exists()  # no case got as far as rendering a set


# every command the documents show runs at HEAD: it parses with its script's own argument parser
# each script's function that decides its settings (parse, check, resolve) from a command line
SCRIPTS = {"adapt.py": adapt.settings, "caption.py": caption.settings, "evaluate.py": evaluate_py.get_args,
           **{m.__name__ + ".py": m.get_args for m in (pretrain, bench, synth, metrics)}}
PLACEHOLDERS = {"S": "0", "N": "2", "LR": "1e-5"}  # the rest in capitals (SET, DIR, CKPT, CLIP, DEV) are paths
FILE_FLAGS = ("--ckpt", "--clip", "--before", "--after", "--refs", "--cands", "--paraphrase")


def shown_commands(text):
    """`[python] SCRIPT.py ARGS` in code blocks and inline code (wrapped or not), continuation lines joined; (script,
    argv, has python). A command after `git checkout <commit> &&` runs older code and is not HEAD's to parse."""
    inline = re.findall(r"`[^`]+`", re.sub(r"```.*?```", "", text, flags=re.S))  # inline code may wrap a line
    for span in re.findall(r"```.*?```", text, re.S) + [s.replace("\n", " ") for s in inline]:
        for line in span.replace("\\\n", " ").splitlines():
            parts = re.split(r"&&|;|\|", line.split(" #")[0])
            for i, part in enumerate(parts):
                if any("git checkout" in before for before in parts[:i]):
                    continue
                for m in re.finditer(r"(?<![\w/.-])(python3? +)?([\w-]+\.py)((?: +[^\s`>]+)*)", part):
                    yield m.group(2), m.group(3).split(), bool(m.group(1))


def documents():
    """The documents a reader is shown, as paths relative to the repository."""
    here = Path(__file__).resolve().parent
    return ["README.md", "RESULTS.md", "BENCHMARKS.md"] + sorted(str(p.relative_to(here))
                                                                 for p in here.glob("assets/*/README.md"))


def test_shown_commands_are_read():
    """The reader of documents finds what a reader sees, with and without `python`, and skips old code's."""
    text = ("run `python adapt.py --seed S && python caption.py --ckpt adapted.pt` or `synth.py make --pairs 9`;\n"
            "```bash\npython pretrain.py --out p8.pt \\\n  --export x.pt   # a comment --nope\n```\n"
            "`git checkout abc && python bench.py numerics`, `clip/model.py`, `caption.py`, `python data.py --size\n2`")
    assert list(shown_commands(text)) == [
        ("pretrain.py", ["--out", "p8.pt", "--export", "x.pt"], True), ("adapt.py", ["--seed", "S"], True),
        ("caption.py", ["--ckpt", "adapted.pt"], True), ("synth.py", ["make", "--pairs", "9"], False),
        ("caption.py", [], False), ("data.py", ["--size", "2"], True)]


@pytest.mark.parametrize("doc", documents())
def test_every_shown_command_parses_at_head(doc, tmp_path, monkeypatch, capsys):
    """Every command in README.md, RESULTS.md, BENCHMARKS.md and the assets' READMEs that runs one of the
    project's scripts parses with that script's own settings (its flags, subcommands and checks),
    placeholders in capitals replaced by valid values and the files it names made (empty) in an empty folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(clip_load, "CACHE", tmp_path / "clip_cache")  # no ViT-B-32.pt found: presets as a newcomer's
    # the weights' sizes without reading the (empty) files: ViT-B/32's, the shipped ones their own; no set rendered
    real = clip_load.clip_config
    monkeypatch.setattr(clip_load, "clip_config",
                        lambda c, act=None: real(c, act) if c in clip_load.SHIPPED else M.CLIPConfig())
    monkeypatch.setattr(data, "resolve_root", lambda name, root=None, *a, **k: Path(root or data.ROOTS[name]))
    wrong, n = [], 0
    for script, argv, python in shown_commands((Path(__file__).resolve().parent / doc).read_text()):
        if script not in SCRIPTS:
            if python and script != "test_all.py":
                wrong.append(f"python {script}: no such script (those with a command line: {sorted(SCRIPTS)})")
            continue
        if not argv and not python:
            continue  # the file's name in prose
        argv = [PLACEHOLDERS.get(a, a) for a in argv]
        argv = ["cpu" if flag == "--device" else a for flag, a in zip([""] + argv, argv)]  # a GPU's command, here
        for flag, value in zip(argv, argv[1:]):
            if value.startswith("-") or value in clip_load.SHIPPED or value in clip_load.MODELS:
                continue
            if flag in FILE_FLAGS or Path(value).suffix in (".pt", ".png", ".json", ".gz"):
                Path(value).parent.mkdir(parents=True, exist_ok=True)
                Path(value).write_text("{}")  # metrics.py reads its JSON files before it scores
                if flag == "--ckpt" and "captioner" in value:  # a trained captioner: caption.py refuses it
                    torch.save({"model": {}, "stage": "caption"}, value)
            elif flag in ("--data-root", "--clevr-root", "--root"):
                Path(value).mkdir(parents=True, exist_ok=True)
                (Path(value) / "scenes.json").touch()
        n += 1
        try:
            SCRIPTS[script](argv)
        except SystemExit as e:
            if e.code not in (0, None):
                wrong.append(f"{script} {' '.join(argv)}: {capsys.readouterr().err.strip().splitlines()[-1:]}")
    assert n > 0 or doc.startswith("assets/meteor")
    assert not wrong, f"{doc}: " + "\n".join(wrong)


# -------------------------------------------------------------------------------------------------------------
# paths that span stages: the paper path through both mains (an OpenAI-format CLIP with several heads, the
# authors' frozen set, two learning rates), presets, ablations, bf16, killed runs

@pytest.mark.slow
def test_a_setting_given_is_decided_once_printed_saved_and_used(adapt_synth, tmp_path, monkeypatch, capsys):
    """Each stage: a flag given over its preset is in the settings line printed at the start, in the checkpoint's
    settings, and in what it names (adapt.py --lr-new: the optimizer's rate of e1, e2, p, ln_mid; caption.py
    --dec-layers: the captioner's layers; pretrain.py --batch-size: its steps); a preset's eps, which no flag
    gives, reaches the optimizer. Settings cannot change once made."""
    monkeypatch.setitem(adapt.PRESETS["scratch"], "eps", 3e-7)  # not make_optimizer's default
    monkeypatch.setitem(caption.PRESETS["mini"], "eps", 2e-7)
    out = tmp_path / "adapted.pt"
    adapt.main(TINY_ADAPT + ["--data-root", str(adapt_synth), "--out", str(out), "--lr-new", "0.0042", "--epochs", "1",
                             "--workers", "0"])
    assert " lr_new=0.0042 " in capsys.readouterr().out
    state = torch.load(train_utils.last_path(out), weights_only=False)
    assert torch.load(out, weights_only=False)["args"]["lr_new"] == 0.0042 == state["args"]["lr_new"]
    groups = [g for g in state["optimizer"]["param_groups"] if g["initial_lr"] == 0.0042]
    assert sum(len(g["params"]) for g in groups) == len(M.PAIR_KEYS)  # e1, e2, p, ln_mid's two
    assert {g["eps"] for g in state["optimizer"]["param_groups"]} == {3e-7}
    tiny_clevr(tmp_path / "clevr")
    tiny_encoder(tmp_path / "adapted.pt", tmp_path / "clevr")
    run(tmp_path, "--enc-layers", "3", "--dec-layers", "3", epochs=1)
    assert " dec_layers=3 " in capsys.readouterr().out
    saved = torch.load(tmp_path / "captioner.pt", weights_only=True)
    assert saved["args"]["dec_layers"] == 3 == saved["captioner_config"]["dec_layers"]
    assert len({k.split(".")[1] for k in saved["captioner"] if k.startswith("decoder.")}) == 3
    state = torch.load(train_utils.last_path(tmp_path / "captioner.pt"), weights_only=False)
    assert saved["args"]["eps"] == 2e-7 and {g["eps"] for g in state["optimizer"]["param_groups"]} == {2e-7}
    pre = tmp_path / "pretrained.pt"
    pretrain.main(TINY_PRETRAIN + ["--root", str(tmp_path / "scenes"), "--out", str(pre), "--samples", "64",
                                   "--batch-size", "32", "--eval-every", "100"])
    assert " batch_size=32 " in capsys.readouterr().out
    state = torch.load(train_utils.last_path(pre), weights_only=False)
    assert state["args"]["batch_size"] == 32 and state["step"] == 64 // 32
    args = adapt.settings(TINY_ADAPT + ["--data-root", str(adapt_synth)])
    with pytest.raises(AttributeError, match="decided before the run starts"):
        args.epochs = 2


@pytest.mark.slow
def test_paper_path_through_main(openai_archive, adapt_synth, tmp_path, monkeypatch, capsys):
    # adaptation: the preset follows what is given (--preset, else --clip, else the dataset), never the cache
    monkeypatch.setattr(clip_load, "CACHE", tmp_path)
    real = tmp_path / "real_clevr"  # a dataset folder without the synthetic set's synth.json
    real.mkdir()
    pick = lambda *a, root=adapt_synth: adapt.settings([*a, "--data-root", str(root)])
    assert pick().preset == "mini"  # the synthetic set: the shipped small pretrained CLIP
    assert pick("--clip", "mini64-synth").preset == "mini" and pick("--clip", str(openai_archive)).preset == "paper"
    assert pick("--preset", "scratch").clip is None  # the small model from nothing, one flag away
    as_cached_release(monkeypatch, openai_archive)
    assert pick().preset == "mini"  # OpenAI's weights in the cache change nothing
    assert (pick(root=real).preset, pick(root=real).clip, pick(root=real).swap_prob) == ("paper", "ViT-B/32", 0.5)
    out = tmp_path / "adapted.pt"
    adapt.main(["--clip", str(openai_archive), "--data-root", str(adapt_synth), "--out", str(out)] + FAST)
    log = capsys.readouterr().out
    assert "preset 'paper'" in log and " cuda_graphs=False " in log and " image_size=32 " in log  # the file's size
    assert re.search(r"lr \d\.\d\de-0[45]/\d\.\d\de-0[78] ", log)  # both learning rates on the progress line
    train_utils.seed_everything(0)  # adapt.main's seed: the same fresh pair parameters
    start = clip_load.load_clip(openai_archive, n_inter=3).state_dict()
    adapted = torch.load(out, weights_only=False)["model"]
    steps = torch.load(train_utils.last_path(out), weights_only=False)["step"]
    moved = max_change(adapted, start, start)
    clip_moved = []
    for k, d in moved.items():
        if k.startswith(M.INPUT_EMBEDDINGS):  # the authors' frozen input embeddings: bit-identical
            assert d == 0, k
        elif k.startswith(M.PAIR_KEYS):  # e1, e2, p, ln_mid at 1e-4
            assert 1e-5 < d <= 2 * steps * 1e-4, (k, d)
        else:  # CLIP's own weights at 1e-7: Adam moves a weight by about lr per step at most
            assert d <= 2 * steps * 1e-7, (k, d)
            clip_moved.append(d > 0)
    # all but a few moved: a 1e-7 step rounds away on an fp32 weight of 2 or more (logit_scale is 2.66 here)
    assert sum(clip_moved) >= len(clip_moved) - 2, moved

    # captioning with the paper preset: the encoder fine-tuned at --encoder-lr, a captioner from scratch
    cap, results = tmp_path / "captioner.pt", tmp_path / "captions.json"
    caption.main([*CPU, "--ckpt", str(out), "--preset", "paper", "--out", str(cap), "--results", str(results),
                  "--epochs",
                  "2", "--batch-size", "4", "--workers", "0", "--encoder-lr", "1e-6", "--log-every", "1000"])
    trained = torch.load(cap, weights_only=False)
    steps = torch.load(train_utils.last_path(cap), weights_only=False)["step"]
    moved = max_change(trained["model"], adapted, adapted)
    assert all(d == 0 for k, d in moved.items() if not k.startswith("visual."))  # the text tower takes no part
    assert all(d == 0 for k, d in moved.items() if k.startswith(M.INPUT_EMBEDDINGS))  # the authors' frozen ones
    visual = [d for k, d in moved.items() if k.startswith("visual.")]
    # BertAdam has no bias correction: its k-th step is up to (1 - b1^k) / sqrt(1 - b2^k) times the rate (6.5 at k = 10)
    bound = 1e-6 * sum((1 - 0.9 ** k) / math.sqrt(1 - 0.999 ** k) for k in range(1, steps + 1))
    assert 0 < max(visual) <= 1.1 * bound and sum(d > 0 for d in visual) > 0.9 * len(visual)
    history = trained["metrics"]["history"]
    # it learns; the loss is the authors' loss1 + loss2 (change pairs, their distractors): each below chance's
    assert history[-1]["loss"] < history[0]["loss"] < 2 * math.log(trained["captioner_config"]["vocab_size"]), history
    # the saved captioner, evaluated again, and on two images of one's own
    first = json.loads(results.read_text())["predictions"]
    again = evaluate_py.main([*CPU, "--ckpt", str(cap), "--results", str(tmp_path / "again.json"), "--workers", "0"])
    assert [p["caption"] for p in again["predictions"]] == [p["caption"] for p in first]
    capsys.readouterr()
    evaluate_py.main([*CPU, "--ckpt", str(cap), "--before", first[0]["before"], "--after", first[0]["after"]])
    assert capsys.readouterr().out.strip() == first[0]["caption"]


@pytest.mark.slow
def test_vit_b16_by_name_and_your_own_pairs_through_both_stages(tmp_path, monkeypatch, capsys):
    """`--clip ViT-B/16` (a random one with 16-pixel patches on a 5 x 5 grid, as the release is cached) on a pairs.json
    through README's commands: the paper presets' sizes follow the file, the activation is recorded, both stages and
    the gallery run, and nothing is read back."""
    cfg = M.CLIPConfig(**{**MH.__dict__, "image_resolution": 80, "vision_patch_size": 16})
    torch.manual_seed(0)
    archive = tmp_path / "clip_cache" / "ViT-B-16.pt"
    archive.parent.mkdir()
    save_archive(M.CLIP(cfg), archive)
    monkeypatch.setattr(clip_load, "CACHE", archive.parent)
    url = f"https://example.invalid/{clip_load.sha256(archive)}/ViT-B-16.pt"  # its SHA256 as the release's
    monkeypatch.setitem(clip_load.MODELS, "ViT-B/16", url)
    words = ["red", "blue", "green", "gray"]
    entries = [{"before": f"img/{k}a.png", "after": f"img/{k}b.png", "split": ["val", "test"][k % 2] if k >= 16 else
                "train", "captions": [f"the {words[k % 4]} cube moved", f"a {words[k % 4]} cube has moved"]}
               for k in range(24)]
    root = own_pairs(tmp_path / "mine", entries, size=(90, 70))
    out, cap, gallery = tmp_path / "adapted.pt", tmp_path / "captioner.pt", tmp_path / "gallery.png"
    with pytest.raises(SystemExit, match="--batch-size 64: more than the 32 training samples, so no step would run"):
        adapt.main(["--data", "pairs", "--data-root", str(root), "--clip", "ViT-B/16"] + FAST + ["--batch-size", "64"])
    adapt.main(["--data", "pairs", "--data-root", str(root), "--clip", "ViT-B/16", "--out", str(out)] + FAST)
    log = capsys.readouterr().out
    assert "preset 'paper'" in log and " image_size=80 " in log and " patch_size=16 " in log and "16 pairs" in log
    adapted = torch.load(out, weights_only=False)
    assert adapted["config"]["activation"] == "quick_gelu" and adapted["args"]["activation"] == "quick_gelu"
    assert adapted["model"]["visual.joint_positional_embedding"].shape[0] == 2 * (5 * 5 + 1)
    caption.main([*CPU, "--ckpt", str(out), "--out", str(cap), "--results", str(tmp_path / "captions.json"),
                  "--epochs", "1", "--batch-size", "4", "--workers", "0"])
    log = capsys.readouterr().out
    assert "preset paper" in log and "memory 52 tokens" in log and "read-back skipped" in log
    saved = torch.load(cap, weights_only=False)
    assert saved["config"]["activation"] == "quick_gelu" and saved["captioner_config"]["memory_len"] == 52
    results = evaluate_py.main([*CPU, "--ckpt", str(cap), "--results", str(tmp_path / "again.json"), "--workers", "0",
                                "--gallery", str(gallery)])
    assert len(results["predictions"]) == 4 and results["read_back"] is None and Image.open(gallery).size[0] > 0
    (root / data.PAIRS).write_text(json.dumps(entries + [{**entries[0], "split": "Train"}]))  # dropped in each split
    again = evaluate_py.main([*CPU, "--ckpt", str(cap), "--results", str(tmp_path / "third.json"), "--workers", "0",
                              "--skip-missing"])
    assert again["predictions"] == results["predictions"]


@pytest.mark.slow
def test_every_preset_runs_the_same_classes_optimizer_schedule_and_sampler(adapt_synth, openai_archive, tmp_path,
                                                                           monkeypatch):
    """One method: in each stage every preset (paper, mini, and stage 1's scratch) builds at run time the same module
    classes, optimizer, schedule and sampler, seen as main builds them; a preset that picked another (an optimizer, a
    captioner, a batch order) would show here. Only values differ (the CLIP, sizes, rates)."""
    seen = defaultdict(set)

    def spy(stage, name, what):
        real = getattr(stage, name)

        def call(*a):
            out = real(*a)
            seen[stage.__name__, name].add(what(out, *a))
            return out
        monkeypatch.setattr(stage, name, call)
    order = lambda b: type(b.sampler if isinstance(b, torch.utils.data.BatchSampler) else b).__name__
    for stage in (adapt, caption):
        spy(stage, "new_model", lambda model, *a: frozenset(type(m).__name__ for m in model.modules()))
        spy(stage, "authors_schedule", lambda sched, opt, *a: (type(opt).__name__, repr(a[2:])))
        spy(stage, "train_epoch", lambda loss, ctx, loader, *a: order(loader.batch_sampler))
    monkeypatch.setattr(clip_load, "CACHE", tmp_path)
    for preset, clip in (("paper", ["--clip", str(openai_archive)]), ("mini", []), ("scratch", TINY_ADAPT[2:])):
        adapt.main(["--data-root", str(adapt_synth), "--out", str(tmp_path / f"{preset}.pt"), "--preset", preset,
                    *clip, *FAST])
    tiny_clevr(tmp_path / "clevr")
    tiny_encoder(tmp_path / "adapted.pt", tmp_path / "clevr")
    for preset in ("paper", "mini"):
        caption.main([*CPU, "--ckpt", str(tmp_path / "adapted.pt"), "--out", str(tmp_path / f"cap_{preset}.pt"),
                      "--results", str(tmp_path / "c.json"), "--preset", preset, "--epochs", "1", "--batch-size",
                      "4", "--heads", "2", "--enc-layers", "1", "--dec-layers", "1", "--workers", "0"])
    assert seen["adapt", "train_epoch"] == {"EpochSampler"} and seen["caption", "train_epoch"] == {"DistractorBatches"}
    assert seen["adapt", "authors_schedule"] == {("BertAdam", "()")}  # the cosine
    assert seen["caption", "authors_schedule"] == {("BertAdam", "('linear',)")}
    for stage in ("adapt", "caption"):
        assert len(seen[stage, "new_model"]) == 1, seen[stage, "new_model"]
    assert {"Captioner", "BertLayer", "VisionTransformer"} <= next(iter(seen["caption", "new_model"]))


@pytest.mark.slow
def test_mini_preset_adapts_the_shipped_clip(adapt_synth, tmp_path, monkeypatch, capsys):
    """The quickstart's two commands in miniature, the paper's method with the mini preset's values: adapt.py adapts
    the shipped 12x12 CLIP (145 tokens an image) with its 4 intra blocks and input embeddings fixed, p alike in both
    images; caption.py trains the authors' captioner (64 wide, 4 heads, 2 + 2 layers, CLIP's words tied) over all 290
    tokens of the fixed encoder, computed once, each change pair beside its distractor."""
    monkeypatch.setattr(clip_load, "CACHE", tmp_path)  # no ViT-B-32.pt anywhere
    out = tmp_path / "adapted.pt"
    adapt.main(["--data-root", str(adapt_synth), "--out", str(out), "--preset", "mini"] + FAST)
    log = capsys.readouterr().out
    assert "preset 'mini'" in log and "PRETRAINED ON SYNTHETIC SCENES" in log and "clip=mini64-synth" in log
    assert "computed once (fixed_intra)" in log
    start, adapted = clip_load.load_clip("mini64-synth").state_dict(), torch.load(out, weights_only=False)
    assert adapted["config"]["n_inter"] == 2 and adapted["data"]["image_size"] == 96
    assert adapted["config"]["vision_patch_size"] == 8 and adapted["config"]["vision_width"] // 64 == 2  # heads
    adapted = adapted["model"]
    intra = [k for k in start if k.startswith(M.INPUT_EMBEDDINGS) or re.match(r"visual\.transformer\.resblocks\.[0-3]\.", k)]
    assert len(intra) > 7 and all(torch.equal(adapted[k], start[k]) for k in intra)
    inter = [k for k in start if k.startswith(("visual.transformer.resblocks.4.", "visual.transformer.resblocks.5."))]
    assert all(not torch.equal(adapted[k], start[k]) for k in inter)
    p = adapted["visual.joint_positional_embedding"]  # shared p: a patch's position alike in both images
    assert p.shape == (2 * 145, 64 * 2) and not torch.equal(p, start["visual.joint_positional_embedding"])
    # caption.py's mini preset: every token, the encoder fixed (its tokens computed once), CLIP's words trained
    cap = tmp_path / "captioner.pt"
    res = caption.main([*CPU, "--ckpt", str(out), "--out", str(cap), "--results", str(tmp_path / "c.json"),
                        "--epochs", "1", "--batch-size", "8", "--workers", "0", "--log-every", "1000"])
    log = capsys.readouterr().out
    assert "encoded" in log and "once (frozen encoder)" in log
    saved = torch.load(cap, weights_only=False)
    config = saved["captioner_config"]
    assert (config["memory_len"], config["width"], config["heads"], config["vocab_size"]) == (290, 64, 4, 49408)
    assert (config["enc_layers"], config["dec_layers"]) == (2, 2)
    assert all(torch.equal(saved["model"][k], v) for k, v in adapted.items() if k != "token_embedding.weight")
    assert not torch.equal(saved["model"]["token_embedding.weight"], adapted["token_embedding.weight"])
    n_change = len(data.load_items("clevr", adapt_synth, "train", "semantic"))
    assert torch.load(train_utils.last_path(cap), weights_only=False)["step"] == n_change // 8  # 8 + 8 a step
    n_test = len(data.load_items("clevr", adapt_synth, "test", "semantic"))
    assert len(res["predictions"]) == 2 * n_test and all(p["caption"] for p in res["predictions"])


@pytest.mark.slow
def test_ablations_through_main(openai_archive, adapt_synth, tmp_path):
    # 12 + 0: no inter blocks; e1, e2, p, ln_mid after the last block train, as the authors'
    out = tmp_path / "adapted_12_0.pt"
    adapt.main(["--clip", str(openai_archive), "--n-inter", "0", "--data-root", str(adapt_synth),
                "--out", str(out)] + FAST)
    ckpt = torch.load(out, weights_only=False)
    assert ckpt["config"]["n_inter"] == 0
    train_utils.seed_everything(0)
    start = clip_load.load_clip(openai_archive, n_inter=0).state_dict()
    assert not any(torch.equal(ckpt["model"][k], start[k]) for k in M.PAIR_KEYS)
    assert not torch.equal(ckpt["model"]["visual.proj"], start["visual.proj"])  # the rest did train
    # not adapted: the same stage-1 command with every rate 0 trains nothing and keeps its starting p
    adapt.main(["--clip", str(openai_archive), "--data-root", str(adapt_synth), "--out", str(tmp_path / "none.pt"),
                "--lr-new", "0", "--lr-clip", "0"] + FAST)
    none = torch.load(tmp_path / "none.pt", weights_only=False)
    train_utils.seed_everything(0)
    start = clip_load.load_clip(openai_archive, n_inter=3).state_dict()
    assert all(torch.equal(none["model"][k], v) for k, v in start.items()) and none["metrics"]["epoch"] == 0
    assert "text->pair R@1" in none["metrics"]["test"] and not os.path.exists(tmp_path / "none.last.pt")
    # no adaptation: the raw CLIP archive as caption.py's encoder, frozen (the mini preset)
    res = caption.main([*CPU, "--ckpt", str(openai_archive), "--data-root", str(adapt_synth), "--preset", "mini",
                        "--out", str(tmp_path / "cap.pt"), "--results", str(tmp_path / "c.json"), "--epochs", "1",
                        "--batch-size", "8", "--workers", "0", "--log-every", "1000"])
    saved, raw = torch.load(tmp_path / "cap.pt", weights_only=False), clip_load.load_clip(openai_archive).state_dict()
    n_change = len(data.load_items("clevr", adapt_synth, "train", "semantic"))  # each beside its distractor
    assert torch.load(tmp_path / "cap.last.pt", weights_only=False)["step"] == n_change // 8
    assert all(torch.equal(saved["model"][k], v) for k, v in raw.items()
               if k not in M.PAIR_KEYS and k != "token_embedding.weight")
    preds = {p["id"]: p["caption"] for p in res["predictions"]}
    refs = {p["id"]: p["references"] for p in res["predictions"]}
    assert len(preds) == 2 * len(data.load_items("clevr", adapt_synth, "test", "semantic"))  # with distractors
    want = evaluate(refs, preds)
    assert all(res["scores"][m] == pytest.approx(100 * want[m], abs=1e-9) for m in metrics.METRICS)


@pytest.mark.slow
def test_bf16_autocast_through_main(adapt_synth, tmp_path):
    """One epoch of each stage with bf16 autocast on the CPU: the code path a CUDA run takes (train_utils.autocast
    decides it in one place). The training loss stays within 2 % of fp32's."""
    loss = {}
    for amp in ("off", "bf16"):
        out = tmp_path / f"adapt_{amp}.pt"
        adapt.main(TINY_ADAPT + ["--data-root", str(adapt_synth), "--epochs", "1", "--amp", amp, "--out", str(out)])
        loss["adapt", amp] = torch.load(train_utils.last_path(out), weights_only=False)["history"][0]["loss"]
        cap = tmp_path / f"cap_{amp}.pt"
        caption.main([*CPU, "--ckpt", str(out), "--out", str(cap), "--results", str(tmp_path / f"{amp}.json"),
                      "--amp", amp,
                      "--epochs", "1", "--batch-size", "8", "--workers", "0", "--log-every", "1000"])
        loss["caption", amp] = torch.load(train_utils.last_path(cap), weights_only=False)["history"][0]["loss"]
    for stage in ("adapt", "caption"):
        assert loss[stage, "bf16"] != loss[stage, "off"], loss  # autocast really ran
        assert abs(loss[stage, "bf16"] - loss[stage, "off"]) < 0.02 * loss[stage, "off"], loss


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigkilled_runs_resume_to_the_same_weights(adapt_synth, tmp_path):
    """Both stages as real processes, killed (SIGKILL: no handler runs) mid-epoch or halfway through writing a
    checkpoint, then resumed: the final weights and the chosen model equal those of a run never stopped."""
    stages = {
        "adapt": TINY_ADAPT + ["--data-root", str(adapt_synth), "--epochs", "2", "--workers", "0"],
        "caption": [*CPU, "--ckpt", str(tmp_path / "full_adapt.pt"), "--preset", "mini", "--heads", "2",
                    "--enc-layers", "1", "--dec-layers", "1", "--epochs", "2", "--batch-size", "4", "--workers", "0",
                    "--patience", "100", "--log-every", "1"],
    }
    kills = {"mid_epoch": {"kill_at_line": "epoch 2/2 step "}, "mid_write": {"kill_at_save": 3}}
    side_by_side = lambda fn: list(ThreadPoolExecutor(2).map(fn, kills))  # the two ways of dying, on 2 cores
    for stage, argv in stages.items():
        out = lambda name: ["--out", str(tmp_path / f"{name}_{stage}.pt")] + (
            ["--results", str(tmp_path / f"{name}.json")] if stage == "caption" else [])
        rc, log_full = run_killable(stage, argv + out("full"))
        assert rc == 0, log_full[-3000:]
        full = torch.load(tmp_path / f"full_{stage}.last.pt", weights_only=False)
        assert side_by_side(lambda name: run_killable(stage, argv + out(name), **kills[name])[0]) == [-9, -9]
        for name in kills:
            assert torch.load(tmp_path / f"{name}_{stage}.last.pt", weights_only=False)["epoch"] == 1
        again = side_by_side(lambda name: run_killable(stage, argv + out(name) + ["--resume"]))
        for name, (rc, log) in zip(kills, again):
            assert rc == 0 and "resumed from" in log, log[-3000:]
            resumed = torch.load(tmp_path / f"{name}_{stage}.last.pt", weights_only=False)
            assert resumed["epoch"] == 2 and resumed["history"] == full["history"], (stage, name)
            for k in full["model"]:
                assert torch.equal(full["model"][k], resumed["model"][k]), (stage, name, k)
            chosen = [torch.load(tmp_path / f"{n}_{stage}.pt", weights_only=False) for n in ("full", name)]
            key = "model" if stage == "adapt" else "captioner"
            assert chosen[0]["metrics"]["epoch"] == chosen[1]["metrics"]["epoch"]
            assert all(torch.equal(v, chosen[1][key][k]) for k, v in chosen[0][key].items()), (stage, name)
        assert not list(tmp_path.glob("*.tmp*"))  # the killed writes' partial files went with the next save


# -------------------------------------------------------------------------------------------------------------
# CUDA: `pytest test_all.py -rs -m cuda` on a GPU machine (one GPU is enough); skipped in one line without one.
# Both stages' main on the GPU under bf16 autocast (the quickstart's mini CLIP, and a random ViT-B/32 through the
# paper preset), checkpoints written on the GPU read on the CPU, --before/--after, greedy decoding in fp32,
# --compile. Timings are bench.py's.

NO_CUDA = "needs a CUDA GPU: the cuda group runs with `pytest test_all.py -rs -m cuda` on a GPU machine"


@pytest.fixture(scope="session")
def gpu():
    """The cuda group's device flag. Without a GPU the whole group skips here, one line in the summary, before any
    of its fixtures is built."""
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return ["--device", "cuda"]


@pytest.fixture
def fp32_matmuls():
    """Plain fp32 on the GPU: a stage's setup turns TF32 on for a run under autocast, and the flag is global."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def watch_steps(monkeypatch):
    """Record each training step's (loss device, autocast dtype, weight dtype): what a run really trained in (a
    step captured as a CUDA graph is recorded in its warm-up and capture, not in its replays)."""
    seen = []

    def watch(real, weight):  # the loss under the step's autocast, and a weight of the model it came from
        def loss(*args, **kwargs):
            out = real(*args, **kwargs)
            amp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
            seen.append((out.device.type, amp, weight(*args).dtype))
            return out
        return loss
    monkeypatch.setattr(adapt, "contrastive_loss", watch(adapt.contrastive_loss, lambda v, g, scale: scale))
    monkeypatch.setattr(caption, "batch_loss", watch(caption.batch_loss, lambda model, *a: next(model.parameters())))
    return seen


def tensor_devices(obj):
    """The devices of every tensor in a checkpoint's dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return {obj.device.type}
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return set().union(*(tensor_devices(v) for v in values))


def assert_cpu_checkpoints(*outs):
    """Each run's chosen model and resumable state hold CPU tensors only (loaded without map_location)."""
    for out in outs:
        for path in (out, train_utils.last_path(out)):
            assert tensor_devices(torch.load(path, weights_only=False)) == {"cpu"}, path


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_quickstart_stages_in_bf16_read_back_on_the_cpu(gpu, adapt_synth, tmp_path, monkeypatch, capsys):
    """The quickstart's two commands on a tiny synthetic set on the GPU: the mini preset adapts the shipped 12x12
    CLIP, the mini preset captions (with --gallery: the attention maps on the GPU). Every step trains on the GPU
    under bf16 autocast with fp32 weights. The checkpoints hold CPU tensors, and the captioner written on the GPU
    writes the same test captions, and the same caption of one pair (--before/--after), on the GPU and on the CPU,
    fp32 on both sides."""
    monkeypatch.setattr(clip_load, "CACHE", tmp_path)  # no ViT-B-32.pt here: the mini preset
    steps = watch_steps(monkeypatch)
    out, cap = tmp_path / "adapted.pt", tmp_path / "captioner.pt"
    adapt.main([*gpu, "--data-root", str(adapt_synth), "--out", str(out), "--preset", "mini", "--epochs", "1",
                "--batch-size", "8", "--eval-batch-size", "16", "--workers", "0", "--log-every", "1"])
    assert "preset 'mini'" in capsys.readouterr().out
    caption.main([*gpu, "--ckpt", str(out), "--out", str(cap), "--results", str(tmp_path / "c.json"), "--epochs", "3",
                  "--batch-size", "8", "--workers", "0", "--log-every", "1000"])
    evaluate_py.main([*gpu, "--ckpt", str(cap), "--results", str(tmp_path / "c.json"), "--workers", "0", "--gallery",
                      str(tmp_path / "g.png")])
    assert len(steps) > 10 and set(steps) == {("cuda", torch.bfloat16, torch.float32)}, set(steps)
    assert (tmp_path / "g.png").stat().st_size > 0
    assert_cpu_checkpoints(out, cap)
    again = {name: evaluate_py.main([*device, "--amp", "off", "--ckpt", str(cap), "--results",
                                     str(tmp_path / f"{name}.json"), "--workers", "0"])
             for name, device in (("gpu", gpu), ("cpu", CPU))}  # --amp off: no autocast, no TF32
    assert [p["caption"] for p in again["gpu"]["predictions"]] == [p["caption"] for p in again["cpu"]["predictions"]]
    assert again["gpu"]["scores"] == pytest.approx(again["cpu"]["scores"])
    pair = again["cpu"]["predictions"][0]
    capsys.readouterr()
    for device in (gpu, CPU):
        evaluate_py.main([*device, "--ckpt", str(cap), "--before", pair["before"], "--after", pair["after"]])
    assert capsys.readouterr().out.split("\n")[:2] == [pair["caption"]] * 2


@pytest.fixture(scope="module")
def vit_b32_archive(gpu, tmp_path_factory):
    """A random-weight ViT-B/32 (OpenAI's sizes: 12 blocks, 768 wide, 224 px) in OpenAI's archive format."""
    path = tmp_path_factory.mktemp("vit_b32") / "ViT-B-32.pt"
    torch.manual_seed(0)
    save_archive(M.CLIP(M.CLIPConfig()), path)
    return path


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_paper_preset_on_vit_b32(gpu, vit_b32_archive, adapt_synth, tmp_path, monkeypatch, capsys):
    """The paper path on the GPU: --clip ViT-B/32 (a random-weight archive in the cache) chooses the paper preset
    (9 + 3 blocks at 224 px, the step captured as a CUDA graph), both stages train under bf16 autocast (adaptation
    at two learning rates, the encoder fine-tuned while captioning), and their checkpoints hold CPU tensors."""
    as_cached_release(monkeypatch, vit_b32_archive)
    steps = watch_steps(monkeypatch)
    out, cap = tmp_path / "adapted.pt", tmp_path / "captioner.pt"
    adapt.main([*gpu, "--clip", "ViT-B/32", "--data-root", str(adapt_synth), "--out", str(out), "--epochs", "1",
                "--batch-size", "16",
                "--eval-batch-size", "32", "--workers", "0", "--log-every", "1"])
    log = capsys.readouterr().out
    assert "preset 'paper'" in log and "lr 1.00e-04/1.00e-07" in log
    assert "captured as one CUDA graph" in log  # the paper preset's default on one GPU
    res = caption.main([*gpu, "--ckpt", str(out), "--out", str(cap), "--results", str(tmp_path / "c.json"),
                        "--epochs", "1", "--batch-size", "8", "--workers", "0", "--log-every", "1000"])
    assert "preset paper" in capsys.readouterr().out
    assert steps and set(steps) == {("cuda", torch.bfloat16, torch.float32)}, set(steps)
    assert torch.load(out, weights_only=False)["config"]["vision_width"] == 768 and res["predictions"]
    assert_cpu_checkpoints(out, cap)


@pytest.mark.cuda
def test_cuda_greedy_decoding_with_and_without_the_cache(gpu, fp32_matmuls):
    """generate() on the GPU in fp32, with the key/value cache and without, equals greedy decoding written out per
    pair on the whole prefix (the CPU test's captioners, moved to the GPU)."""
    for seed in (0, 5, 6):
        cap, memory = sharp_captioner(seed)
        cap, memory = cap.cuda(), memory.cuda()
        want = [greedy_reference(cap, m) for m in memory]
        width = max(len(c) for c in want)
        for use_kv_cache in (True, False):
            assert torch.equal(M.generate(cap, memory, BOS, EOS, use_kv_cache=use_kv_cache).cpu(), padded(want, width))


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.subprocess
def test_cuda_adapt_with_compile(gpu, adapt_synth, tmp_path):
    """`adapt.py --compile` on the GPU (a real process under a timeout): the compiled training step with its static
    caption length."""
    out = tmp_path / "a.pt"
    cmd = [sys.executable, "adapt.py", *TINY_ADAPT, *gpu, "--data-root", str(adapt_synth), "--epochs", "1",
           "--workers", "0", "--compile", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            cwd=Path(__file__).resolve().parent)
    try:
        log = proc.communicate(timeout=240)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the compiler's workers too
        pytest.fail("adapt.py --compile did not finish in 240 s")
    assert proc.returncode == 0 and "done in" in log, log[-3000:]
    assert_cpu_checkpoints(out)


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_graphs_capture_the_step(gpu, adapt_synth, tmp_path, capsys):
    """adapt.py --cuda-graphs on the GPU with BertAdam (its rate read from a device tensor the schedule fills): the
    step is captured once and replayed, the epoch's loss is eager's to bf16 tolerance (2 %); its checkpoint holds
    CPU tensors."""
    argv = TINY_ADAPT + [*gpu, "--data-root", str(adapt_synth), "--epochs", "1", "--no-cuda-graphs"]
    adapt.main(argv + ["--out", str(tmp_path / "eager.pt")])
    adapt.main(argv + ["--out", str(tmp_path / "graphs.pt"), "--cuda-graphs"])
    assert capsys.readouterr().out.count("captured as one CUDA graph") == 1
    la, lb = (torch.load(tmp_path / f"{n}.last.pt", weights_only=False)["history"][0]["loss"]
              for n in ("eager", "graphs"))
    assert lb == pytest.approx(la, rel=0.02)
    assert_cpu_checkpoints(tmp_path / "graphs.pt")


