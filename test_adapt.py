# ---- adapt.py: contrastive loss, retrieval metrics, training, resume, 2-process DDP
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import adapt
import data
import model as M
import train_utils

TINY_ADAPT = ["--preset", "small", "--image-size", "32", "--patch-size", "16", "--vision-width", "32",
              "--vision-layers", "2", "--n-inter", "1", "--text-width", "32", "--text-layers", "1",
              "--embed-dim", "16", "--batch-size", "8", "--eval-batch-size", "16", "--log-every", "1"]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    data.make_synth(root, 24, seed=0, size=(120, 80), workers=1)
    return root


def test_retrieval_metrics_by_hand():
    # 2 pairs, 3 captions: captions 0, 1 belong to pair 0, caption 2 to pair 1
    owner = torch.tensor([0, 0, 1])
    sim = torch.tensor([[0.1, 0.9, 0.5],
                        [0.2, 0.3, 0.4]])
    m = adapt.retrieval_metrics(sim, owner)
    # pair 0: best own caption (0.9) is first -> rank 1; pair 1: its caption (0.4) is behind 0.2? no: ahead of
    # 0.2 and 0.3 -> rank 1. text->pair: caption 0 -> pair 1 scores 0.2 > 0.1 -> rank 2; caption 1 -> rank 1;
    # caption 2 -> pair 0 scores 0.5 > 0.4 -> rank 2
    assert m["pair->text R@1"] == 100 and m["text->pair R@1"] == pytest.approx(100 / 3)
    assert m["text->pair MnR"] == pytest.approx(5 / 3) and m["text->pair MdR"] == 2
    const = adapt.retrieval_metrics(torch.zeros(2, 3), owner)  # ties rank pessimistically: no free rank 1
    assert const["text->pair R@1"] == 0 and const["pair->text R@1"] == 0
    chance = adapt.chance_metrics(owner, 2)
    assert chance["text->pair R@1"] == 50 and chance["pair->text R@1"] == pytest.approx(100 * (2 / 3 + 1 / 3) / 2)


def test_contrastive_loss_matches_definition():
    torch.manual_seed(0)
    v, g = torch.randn(4, 8), torch.randn(4, 8)
    scale = torch.tensor(2.0)
    loss = adapt.contrastive_loss(v, g, scale)
    s = scale.exp() * torch.nn.functional.normalize(v, dim=-1) @ torch.nn.functional.normalize(g, dim=-1).t()
    want = -(s.log_softmax(1).diag().mean() + s.log_softmax(0).diag().mean()) / 2
    assert torch.allclose(loss, want, atol=1e-6)
    assert adapt.contrastive_loss(v, g, torch.tensor(9.0)) == adapt.contrastive_loss(v, g, torch.tensor(4.7))  # ln 100 clamp


def test_loss_decreases_on_synthetic_batches(synth):
    args = adapt.get_args(TINY_ADAPT + ["--data-root", str(synth)])
    torch.manual_seed(0)
    model = adapt.build_model(args)
    items = data.load_items("clevr", synth, "train", setting="semantic")[:8]
    ds = data.CaptionDataset(items, 32, 32, swap_prob=0.5)
    batch = next(iter(data.make_loader(ds, 8, shuffle=True)))
    opt = torch.optim.AdamW(adapt.param_groups(model.named_parameters(), adapt.lr_for(args), 0.0))
    net = adapt.PairText(model)
    losses = []
    for _ in range(30):
        loss = adapt.contrastive_loss(*net(*batch[:3]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_train_resume_equals_uninterrupted(synth, tmp_path, monkeypatch):
    base = TINY_ADAPT + ["--data-root", str(synth), "--epochs", "2"]
    adapt.main(base + ["--out", str(tmp_path / "a.pt")])
    full = torch.load(tmp_path / "a.last.pt", weights_only=False)

    real_epoch = train_utils.train_epoch

    def ctrl_c_in_second_epoch(*a, **k):
        if a[6] == 1:  # epoch index
            raise KeyboardInterrupt
        return real_epoch(*a, **k)
    monkeypatch.setattr(adapt, "train_epoch", ctrl_c_in_second_epoch)
    with pytest.raises(SystemExit) as stop:
        adapt.main(base + ["--out", str(tmp_path / "b.pt")])
    assert stop.value.code == 130 and torch.load(tmp_path / "b.last.pt", weights_only=False)["epoch"] == 1
    monkeypatch.setattr(adapt, "train_epoch", real_epoch)
    adapt.main(base + ["--out", str(tmp_path / "b.pt"), "--resume"])
    resumed = torch.load(tmp_path / "b.last.pt", weights_only=False)
    assert resumed["epoch"] == full["epoch"] == 2
    for k, v in full["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
    ckpt = torch.load(tmp_path / "b.pt", weights_only=False)
    assert {"model", "config", "tokenizer", "metrics", "args"} <= set(ckpt)
    assert "text->pair R@1" in ckpt["metrics"]["test"] and "val" in ckpt["metrics"]


def _ddp_worker(rank, world, port, path):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    ctx = train_utils.setup(seed=0, device="cpu")
    model, batch = _ddp_problem()
    net = torch.nn.parallel.DistributedDataParallel(adapt.PairText(model))
    n = len(batch[0]) // world
    local = [t[rank * n:(rank + 1) * n] for t in batch]
    loss = adapt.contrastive_loss(*net(*local))
    loss.backward()
    if ctx.main:
        torch.save({"loss": loss.detach(), "grads": {k: p.grad for k, p in model.named_parameters()}}, path)
    torch.distributed.destroy_process_group()


def _ddp_problem():
    torch.manual_seed(0)
    cfg = M.CLIPConfig(embed_dim=16, image_resolution=32, vision_layers=2, vision_width=32, vision_patch_size=16,
                       context_length=16, transformer_width=32, transformer_heads=1, transformer_layers=1, n_inter=1)
    model = M.CLIP(cfg)
    before, after = torch.randn(8, 3, 32, 32), torch.randn(8, 3, 32, 32)
    ids = torch.randint(1, 49000, (8, 16))
    ids[:, 10] = 49407
    return model, (before, after, ids)


def test_two_processes_equal_one_on_the_global_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path / "ddp.pt")), nprocs=2, join=True)
    got = torch.load(tmp_path / "ddp.pt", weights_only=False)
    model, batch = _ddp_problem()
    loss = adapt.contrastive_loss(*adapt.PairText(model)(*batch))
    loss.backward()
    assert torch.allclose(got["loss"], loss, atol=1e-6)
    for k, p in model.named_parameters():
        assert torch.allclose(got["grads"][k], p.grad, atol=1e-6, rtol=1e-4), k
