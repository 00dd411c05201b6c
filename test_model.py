# ---- model.py / clip_load.py: CLIP parity, the pair encoder, checkpoints, tokenizer, preprocessing
import importlib.util
import json
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import clip_load
import model as M
from clip_load import load_clip, preprocess, tokenize, decode

SHARED = Path(__file__).resolve().parent.parent / "shared"
TINY = M.CLIPConfig(embed_dim=32, image_resolution=32, vision_layers=4, vision_width=64, vision_patch_size=8,
                    context_length=77, vocab_size=49408, transformer_width=64, transformer_heads=1,
                    transformer_layers=2, n_inter=2)


def assert_close(a, b, atol=1e-5):
    diff = (a - b).abs()
    assert diff.max() <= atol, f"max |diff| {diff.max():.3g}, mean {diff.mean():.3g}"


def openai_module(name):
    """OpenAI's own clip/model.py or clip/simple_tokenizer.py (test-only reference), loaded by path so that
    clip/__init__.py (which needs torchvision) is never run; None when the openai-clip package is absent."""
    spec = importlib.util.find_spec("clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / f"{name}.py"
    if not path.is_file():
        return None
    mod_spec = importlib.util.spec_from_file_location(f"openai_clip_{name}", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def tiny_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(3, 3, 32, 32, generator=g)
    text = tokenize(["a red cube", "the small red metal cube changed to blue", ""])
    return images, text


def to_fp16(module):
    """What OpenAI's convert_weights does to the release: matrices and embeddings fp16, LayerNorms fp32."""
    for name, p in module.named_parameters():
        if p.ndim >= 2 or name.endswith(("in_proj_bias", "class_embedding", "bef_embedding", "aft_embedding")) \
                or ".mlp." in name or "out_proj" in name:
            p.data = p.data.half()
    return module


def write_archive(module, path, images, text):
    """A TorchScript archive with fp16 weights, as OpenAI's ViT-B-32.pt is written."""
    traced = torch.jit.trace_module(module.eval(), {"encode_image": images.half(), "encode_text": text},
                                    check_trace=False)
    torch.jit.save(traced, str(path))
    return module.float()  # the same fp16-rounded weights, run in fp32: the "original module"


def test_openai_archive_matches_openai_code(tmp_path):
    ref = openai_module("model")
    if ref is None:
        pytest.skip("openai-clip not installed (pip install --no-deps openai-clip==1.0.1)")
    torch.manual_seed(0)
    original = ref.CLIP(embed_dim=32, image_resolution=32, vision_layers=4, vision_width=64, vision_patch_size=8,
                        context_length=77, vocab_size=49408, transformer_width=64, transformer_heads=1,
                        transformer_layers=2)
    images, text = tiny_inputs()
    ref.convert_weights(original)  # OpenAI's own fp16 conversion
    original = write_archive(original, tmp_path / "ViT-tiny.pt", images, text).eval()
    ours = load_clip(tmp_path / "ViT-tiny.pt")
    assert ours.cfg.vision_layers == 4 and ours.cfg.image_resolution == 32 and ours.cfg.embed_dim == 32
    with torch.no_grad():
        assert_close(ours.encode_image(images), original.encode_image(images))
        assert_close(ours.encode_text(text), original.encode_text(text))
        a, b = ours(images, text), original(images, text)
        assert_close(a[0], b[0], atol=1e-4)


def test_archive_roundtrip_and_state_dict(tmp_path):
    torch.manual_seed(0)
    original = to_fp16(M.CLIP(TINY))
    images, text = tiny_inputs()
    original = write_archive(original, tmp_path / "a.pt", images, text).eval()
    torch.save(original.state_dict(), tmp_path / "sd.pt")
    for path in (tmp_path / "a.pt", tmp_path / "sd.pt"):
        ours = load_clip(path, n_inter=2)
        assert next(ours.parameters()).dtype == torch.float32 and not ours.training
        with torch.no_grad():
            assert_close(ours.encode_image(images), original.encode_image(images))
            assert_close(ours.encode_text(text), original.encode_text(text))
            assert_close(ours.encode_pair(images, images.flip(0))[0], original.encode_pair(images, images.flip(0))[0])


def test_strict_load_of_openai_keys():
    """OpenAI's key set (no pair parameters, plus the three scalars) loads with strict=True."""
    sd = {k: v for k, v in M.CLIP(TINY).state_dict().items() if k not in M.PAIR_KEYS}
    sd.update(input_resolution=torch.tensor(32), context_length=torch.tensor(77), vocab_size=torch.tensor(49408))
    sd = {k: v for k, v in sd.items() if k not in clip_load.NON_PARAMETERS}
    model = M.build_model(sd, n_inter=2)
    model.load_state_dict(sd, strict=True)


def test_pair_encoder_without_inter_blocks_is_plain_clip():
    torch.manual_seed(0)
    model = M.CLIP(M.CLIPConfig(**{**TINY.__dict__, "n_inter": 0})).eval()
    images, _ = tiny_inputs()
    before, after = images, images.roll(1, 0)
    with torch.no_grad():
        tokens, v = model.encode_pair(before, after)
        n1 = tokens.shape[1] // 2
        assert tokens.shape == (3, 2 * 17, 32)  # (32/8)^2 patches + [CLS], two images
        assert_close(tokens[:, 0], model.encode_image(before))
        assert_close(tokens[:, n1], model.encode_image(after))
        assert_close(v, (model.encode_image(before) + model.encode_image(after)) / 2)


def test_pair_encoder_order_matters():
    torch.manual_seed(0)
    model = M.CLIP(TINY).eval()  # 2 intra + 2 inter blocks
    images, _ = tiny_inputs()
    with torch.no_grad():
        t1, v1 = model.encode_pair(images, images.roll(1, 0))
        t2, v2 = model.encode_pair(images.roll(1, 0), images)
    assert t1.shape == (3, 34, 32) and v1.shape == (3, 32)
    assert (v1 - v2).abs().max() > 1e-3  # e1 != e2 and p: the encoder knows which image came first
    assert (t1[:, :17] - t2[:, 17:]).abs().max() > 1e-3


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


def test_sdpa_and_plain_attention_agree():
    torch.manual_seed(0)
    model = M.CLIP(TINY).eval()
    images, text = tiny_inputs()
    with torch.no_grad():
        a = model.encode_pair(images, images.flip(0))[0], model.encode_text(text)
        M.USE_SDPA = False
        try:
            b = model.encode_pair(images, images.flip(0))[0], model.encode_text(text)
        finally:
            M.USE_SDPA = True
    assert_close(a[0], b[0])
    assert_close(a[1], b[1])


def test_bf16_autocast_runs():
    model = M.CLIP(TINY).eval()
    images, text = tiny_inputs()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        tokens, v = model.encode_pair(images, images)
        t = model.encode_text(text)
    assert torch.isfinite(tokens.float()).all() and torch.isfinite(t.float()).all()
    assert_close(v.float(), model.encode_pair(images, images)[1].detach(), atol=0.1)


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
    with pytest.raises(SystemExit, match="no file at"):
        load_clip(tmp_path / "missing.pt")


def test_offline_download_is_a_clear_error(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(clip_load, "CACHE", tmp_path)
    monkeypatch.setattr(clip_load.urllib.request, "urlopen", offline)
    with pytest.raises(SystemExit, match="could not download .*Offline"):
        load_clip("ViT-B/32")
    assert not list(tmp_path.iterdir())  # no half file left behind


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


def test_tokenizer_roundtrips_real_captions():
    texts = shared_captions()
    if not texts:
        pytest.skip("../shared/data absent")
    texts = texts[::7]  # a few thousand real sentences: keeps the suite fast (the note reports the full count)
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
    for image in (Image.fromarray(rgb).convert("L"), Image.fromarray(rgb).convert("RGBA"),
                  Image.fromarray(rgb).convert("P"), Image.fromarray(rgb).convert("CMYK"), white8.convert("1")):
        assert preprocess(image, 24).shape == (3, 24, 24), image.mode
    mean = torch.tensor(clip_load.MEAN).view(3, 1, 1)
    std = torch.tensor(clip_load.STD).view(3, 1, 1)
    assert_close(preprocess(white8, 8), ((1 - mean) / std).expand(3, 8, 8))
    assert preprocess(Image.fromarray(rgb), 32, crop=True).shape == (3, 32, 32)
