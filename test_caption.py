"""caption.py and the captioner in model.py: cache equals no cache, overfit a handful of pairs to their exact
captions, the two-image CLI on a real CLEVR render, resume equals uninterrupted. Tiny models, a few seconds."""
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import caption
import model
from model import CLIP, Captioner, CaptionerConfig, CLIPConfig

SHARED = Path(__file__).resolve().parent.parent / "shared"
REAL = SHARED / "data" / "real_pairs"
CHANGES = {  # scene -> (change type, change caption); scene 0 is the real render pair when ../shared is there
    0: ("drop", "the large gray sphere made of rubber is missing"),
    1: ("color", "the small red cube changed to blue"),
    2: ("move", "the green cylinder has moved"),
    3: ("add", "a purple metal sphere has been added"),
}
SAME = "nothing has changed"


def tiny_clevr(root):
    """A CLEVR-Change-format dataset of 4 scenes, the same in train, val and test: memorization is the point."""
    rng = np.random.default_rng(0)
    for d in ("images", "sc_images", "nsc_images"):
        (root / d).mkdir(parents=True)
    for i in CHANGES:
        if i == 0 and REAL.is_dir():
            before, after = Image.open(REAL / "CLEVR_new_000000.png"), Image.open(REAL / "CLEVR_new_000000_del.png")
        else:
            before, after = (Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)) for _ in range(2))
        before.save(root / "images" / f"CLEVR_default_{i:06d}.png")
        after.save(root / "sc_images" / f"CLEVR_semantic_{i:06d}.png")
        # the distractor: the same scene seen from elsewhere (mirrored) and lit differently
        moved = np.asarray(before.convert("RGB"))[:, ::-1].astype(int) + rng.integers(-25, 25, (1, 1, 3))
        Image.fromarray(np.clip(moved, 0, 255).astype(np.uint8)).save(root / "nsc_images" / f"CLEVR_nonsemantic_{i:06d}.png")
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
    """An adapt.py-style checkpoint of a tiny random CLIP (2 vision blocks, the last one inter)."""
    torch.manual_seed(0)
    cfg = CLIPConfig(embed_dim=32, image_resolution=32, vision_layers=2, vision_width=64, vision_patch_size=8,
                     context_length=8, vocab_size=100, transformer_width=32, transformer_heads=1,
                     transformer_layers=1, n_inter=1)
    torch.save({"model": CLIP(cfg).state_dict(), "config": asdict(cfg), "stage": "adapt",
                "data": {"name": "clevr", "root": str(root), "image_size": 32}}, path)


def run(tmp, *extra, epochs):
    return caption.main(["--ckpt", str(tmp / "adapted.pt"), "--out", str(tmp / "captioner.pt"), "--results",
                         str(tmp / "captions.json"), "--preset", "small", "--width", "64", "--heads", "2",
                         "--enc-layers", "1", "--dec-layers", "1", "--epochs", str(epochs), "--batch-size", "4",
                         "--lr", "2e-3", "--patience", "100", "--workers", "0", "--log-every", "1000", *extra])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine two threads run them ~10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, one_thread):
    tmp = tmp_path_factory.mktemp("caption")
    tiny_clevr(tmp / "clevr")
    tiny_encoder(tmp / "adapted.pt", tmp / "clevr")
    results = run(tmp, "--dropout", "0", epochs=15)
    return tmp, results


def test_cache_equals_no_cache():
    torch.manual_seed(0)
    cap = Captioner(CaptionerConfig(vocab_size=50, memory_dim=32, memory_len=10, width=64, heads=4, enc_layers=2,
                                    dec_layers=2, max_len=12)).eval()
    memory = torch.randn(16, 10, 32)
    cached, full = cap.generate(memory, 1, 2, use_cache=True), cap.generate(memory, 1, 2, use_cache=False)
    assert torch.equal(cached, full)
    # the cached step's logits are the full prefix's last-position logits
    caches, mem = [{} for _ in cap.decoder], cap.encode(memory)
    steps = [cap.decode(full[:, t - 1:t] if t else torch.ones(16, 1, dtype=torch.long), mem, caches, start=t)[:, -1]
             for t in range(5)]
    prefix = torch.cat([torch.ones(16, 1, dtype=torch.long), full[:, :4]], dim=1)
    torch.testing.assert_close(torch.stack(steps, 1), cap.decode(prefix, mem), atol=1e-5, rtol=1e-5)
    try:  # the plain softmax attention path decodes the same
        model.USE_SDPA = False
        assert torch.equal(cap.generate(memory, 1, 2), cached)
    finally:
        model.USE_SDPA = True
    assert torch.equal(cap.beam_search(memory, 1, 2, beam=1), cached)  # a beam of one is greedy
    assert cap.beam_search(memory, 1, 2, beam=3).shape[0] == 16


def test_overfit_exact_captions(trained):
    tmp, results = trained
    preds = {p["id"]: p["caption"] for p in results["predictions"]}
    assert preds == {**{f"{i:06d}": c for i, (_, c) in CHANGES.items()}, **{f"{i:06d}_n": SAME for i in CHANGES}}
    assert results["scores"]["CIDEr-D"] > results["baseline"]["scores"]["CIDEr-D"]
    assert set(results["scores_by_type"]) == {"color", "move", "add", "drop", "distractor"}
    saved = torch.load(tmp / "captioner.pt", weights_only=True)
    assert saved["stage"] == "caption" and saved["vocab"][:4] == caption.SPECIALS and "test" in saved["metrics"]


@pytest.mark.skipif(not REAL.is_dir(), reason="needs ../shared/data/real_pairs")
def test_two_image_cli(trained, capsys, tmp_path):
    tmp, _ = trained
    caption.main(["--ckpt", str(tmp / "captioner.pt"), "--before", str(REAL / "CLEVR_new_000000.png"),
                  "--after", str(REAL / "CLEVR_new_000000_del.png")])
    assert capsys.readouterr().out.strip() == CHANGES[0][1]
    # any size and mode: 8-bit grey and 16-bit grey images of other sizes still give a caption of known words
    grey = Image.open(REAL / "CLEVR_new_000000.png").convert("L").resize((200, 90))
    grey.save(tmp_path / "grey.png")
    Image.fromarray((np.asarray(grey).astype(np.uint16) * 257)).save(tmp_path / "grey16.png")
    caption.main(["--ckpt", str(tmp / "captioner.pt"), "--before", str(tmp_path / "grey.png"),
                  "--after", str(tmp_path / "grey16.png")])
    vocab = set(torch.load(tmp / "captioner.pt", weights_only=True)["vocab"])
    assert set(capsys.readouterr().out.split()) <= vocab
    # evaluating a saved captioner (beam search) and drawing the gallery
    out = caption.main(["--ckpt", str(tmp / "captioner.pt"), "--results", str(tmp_path / "r.json"), "--beam", "2",
                        "--gallery", str(tmp_path / "g.png"), "--workers", "0"])
    assert out["scores"]["CIDEr-D"] > 0 and Image.open(tmp_path / "g.png").size[1] > 100
    with pytest.raises(SystemExit, match="trained captioner"):
        caption.main(["--ckpt", str(tmp / "adapted.pt"), "--before", str(REAL / "CLEVR_new_000000.png"),
                      "--after", str(REAL / "CLEVR_new_000000_del.png")])


def test_resume_equals_uninterrupted(trained, tmp_path, monkeypatch):
    tmp, _ = trained
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        shutil.copy(tmp / "adapted.pt", tmp_path / d / "adapted.pt")
    run(tmp_path / "a", epochs=3)
    real_epoch = caption.train_epoch

    def interrupt_second(*args, **kw):
        if args[6] == 1:  # epoch index
            raise KeyboardInterrupt
        return real_epoch(*args, **kw)
    monkeypatch.setattr(caption, "train_epoch", interrupt_second)
    with pytest.raises(SystemExit):
        run(tmp_path / "b", epochs=3)
    monkeypatch.setattr(caption, "train_epoch", real_epoch)
    run(tmp_path / "b", "--resume", epochs=3)
    a, b = (torch.load(tmp_path / d / "captioner.last.pt", weights_only=False) for d in ("a", "b"))
    assert a["epoch"] == b["epoch"] == 3 and a["history"] == b["history"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
