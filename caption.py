"""Stage 2 of CLIP4IDC: train the authors' Transformer captioner on the adapted pair encoder (paper Sec. 3.3).

    python caption.py --ckpt adapted.pt      # train, select on val CIDEr-D, test once -> captioner.pt, captions.json
    python caption.py --ckpt ViT-B/32        # the same on CLIP not adapted (paper Table 5)

The captioner (model.Captioner) reads every token of the pair encoder and writes CLIP's BPE words, learning by
word-level cross entropy on change pairs, each beside its distractor ("no change"). The encoder trains at a tiny rate
or (rate 0) stays fixed, its tokens then computed once. Presets: paper (the authors' values), mini (the same method
with smaller numbers, for adapt.py's small CLIP on a CPU).
"""
import argparse
import json
import os
import time
import zipfile
from dataclasses import asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

import clip_load
import data
import metrics
import plots
import synth
from model import INPUT_EMBEDDINGS, MAX_LEN, Captioner, CaptionerConfig, authors_fp16_, beam_search, generate, heads_for
from train_utils import (BertAdam, HelpFormatter, Progress, Settings, at_least, authors_decays, authors_schedule,
                         check_resume, concrete_amp, end_epoch, flag_error, fmt_time, freeze, given_flags,
                         image_cache_flag, interrupted, load_resume, log, new_run, over_preset, param_groups,
                         pick_device, policy_table, preset_values, resume_run, run_flags, save_atomic, save_state,
                         setup, train_epoch, where)

# -----------------------------------------------------------------------------
# settings: a literal preset (None: decided by the weights or data), the flags given over it

PRESETS = {
    # the authors' (scripts/caption_clevr.sh; patience: main_task_caption.py 743-750); heads None: width / 64;
    # words_lr None: CLIP's words train at encoder_lr on Spot-the-Diff, else stay fixed (main_task_caption.py 640-667)
    "paper": dict(heads=None, enc_layers=3, dec_layers=3, batch_size=16, epochs=50, lr=1e-4, encoder_lr=1e-7,
                  words_lr=None, betas=(0.9, 0.999), eps=1e-6, warmup=0.1, grad_clip=1.0, weight_decay=0.01,
                  dropout=0.1, patience=11),
}
# for a CPU: the small CLIP fixed; its words train (its pretraining saw no change verbs); 2 + 2 layers, 4 heads of
# 16; 2 change pairs a step: the captioner learns by steps more than by pairs; 1e-3 is near the edge (at 2e-3 it says
# "no change" to everything; RESULTS.md's screen)
PRESETS["mini"] = {**PRESETS["paper"], "heads": 4, "enc_layers": 2, "dec_layers": 2, "batch_size": 2, "epochs": 5,
                   "lr": 1e-3, "encoder_lr": 0.0, "words_lr": 5e-4, "dropout": 0.0, "patience": 5}
PAD = 0  # CLIP's BPE pads with 0 (its "!")
CHANGE_TYPES = ("color", "material", "move", "add", "drop", "distractor")
FORMAT = 4  # captioner.pt's layout


def parser():
    pre = preset_values(PRESETS)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--ckpt", default="adapted.pt", help="adapted.pt, or a CLIP (as adapt.py's --clip): the "
                   "no-adaptation ablation")
    clip_load.activation_flag(p)
    p.add_argument("--out", default="captioner.pt", help="the best captioner (resumable state: *.last.pt)")
    p.add_argument("--preset", choices=list(PRESETS), default=None, help="default: --ckpt's adaptation preset "
                   "(scratch: mini); a CLIP: mini if shipped, else paper")
    test_flags(p)
    image_cache_flag(p)
    # model
    p.add_argument("--n-inter", type=at_least(0), default=None, help="inter blocks (default: the checkpoint's, else 3)")
    p.add_argument("--heads", type=at_least(1), default=None, help="captioner heads (default: width / 64) "
                   f"{pre('heads')}")
    p.add_argument("--enc-layers", type=at_least(1), default=None, help=f"captioner encoder layers {pre('enc_layers')}")
    p.add_argument("--dec-layers", type=at_least(1), default=None, help=f"captioner decoder layers {pre('dec_layers')}")
    p.add_argument("--dropout", type=at_least(0.0, float, below=1.0), default=None,
                   help=f"captioner dropout {pre('dropout')}")
    # optimization: BertAdam, warmup then linear decay (the authors')
    p.add_argument("--epochs", type=at_least(1), default=None, help=f"most epochs {pre('epochs')}")
    p.add_argument("--batch-size", type=at_least(1), default=None, help="pairs per step (CLEVR: change pairs, and "
                   f"their distractors) {pre('batch_size')}")
    p.add_argument("--lr", type=at_least(0.0, float), default=None, help=f"captioner learning rate {pre('lr')}")
    p.add_argument("--encoder-lr", type=at_least(0.0, float), default=None, help="pair encoder's learning rate (0: "
                   f"fixed, its tokens computed once) {pre('encoder_lr')}")
    p.add_argument("--words-lr", type=at_least(0.0, float), default=None, help="learning rate of CLIP's words, the "
                   f"captioner's input and output (default: --encoder-lr on spot, else 0) {pre('words_lr')}")
    p.add_argument("--weight-decay", type=at_least(0.0, float), default=None,
                   help=f"weight decay {pre('weight_decay')}")
    p.add_argument("--authors-numerics", action="store_true", help="the authors' fp16 (model.authors_fp16_)")
    run_flags(p, log_every=50, pre=pre)
    p.add_argument("--patience", type=at_least(1), default=None, help="stop after this many epochs without val "
                   f"CIDEr-D gain {pre('patience')}")
    return p


def test_flags(p):
    """The data flags of caption.py and evaluate.py, alike."""
    p.add_argument("--data", choices=list(data.ROOTS), default=None,
                   help="dataset (default: the checkpoint's, else clevr; pairs: README 'Your own image pairs')")
    p.add_argument("--data-root", default=None, help="dataset directory (default: the checkpoint's)")
    p.add_argument("--skip-missing", action="store_true", help="drop pairs whose images are missing")
    p.add_argument("--results", default="captions.json", help="test scores, baseline and predictions (JSON)")
    p.add_argument("--workers", type=at_least(0), default=2, help="image-loading processes")
    p.add_argument("--eval-batch-size", type=at_least(1), default=64, help="pairs per decoding batch")


def settings(argv=None):
    """Every setting, decided once: the preset, the flags given over it, what the encoder, data and device decide."""
    p = parser()
    flags, given = p.parse_args(argv), given_flags(p, argv)
    bad = lambda flag, why: p.error(f"argument {flag}: {why}")
    if not os.path.exists(flags.ckpt) and flags.ckpt not in clip_load.MODELS and flags.ckpt not in clip_load.SHIPPED:
        bad("--ckpt", f"no file at {flags.ckpt}: run `python adapt.py` first (it writes adapted.pt)")
    info = {} if flags.ckpt in clip_load.MODELS else read_ckpt_info(flags.ckpt)
    if info.get("stage") == "caption":
        bad("--ckpt", f"{flags.ckpt} is a captioner: evaluate it with `python evaluate.py --ckpt {flags.ckpt}`")
    adapted_with = info.get("args", {}).get("preset")
    preset = flags.preset or ({"scratch": "mini"}.get(adapted_with, adapted_with) if adapted_with else
                              "mini" if flags.ckpt in clip_load.SHIPPED else "paper")
    s = over_preset(flags, given, PRESETS, preset, bad)
    if s["enc_layers"] < s["dec_layers"]:
        bad("--enc-layers", f"the authors' decoder layer i reads encoder layer i: give at least {s['dec_layers']}")
    check_resume(p, s["resume"], s["out"])

    # the encoder decides
    clip = clip_load.clip_config(flags.ckpt, flags.activation)
    s["activation"] = clip.activation
    s["n_inter"] = clip.n_inter if flags.n_inter is None else flags.n_inter
    if s["n_inter"] > clip.vision_layers:
        bad("--n-inter", f"{flags.ckpt} has {clip.vision_layers} vision blocks")
    if clip.embed_dim != clip.transformer_width:  # its words are the captioner's, its tokens the memory
        bad("--ckpt", f"the captioner needs {flags.ckpt}'s words ({clip.transformer_width} wide) as wide as its "
                      f"tokens ({clip.embed_dim}), as in every OpenAI ViT: adapt a CLIP so shaped")
    s["width"] = clip.transformer_width
    s["heads"] = s["heads"] or heads_for(s["width"])
    if s["width"] % s["heads"]:
        bad("--heads", f"{s['heads']} heads do not divide the width {s['width']}")

    # the data decides
    name, root = data_source(flags.data, flags.data_root, info)
    if s["words_lr"] is None:
        s["words_lr"] = s["encoder_lr"] if name == "spot" else 0.0
    s.update(data=name, data_root=str(root), device=pick_device(s["device"]), adapted=info.get("stage") == "adapt",
             freeze_encoder=s["encoder_lr"] == 0, pair_distractors=name == "clevr")  # only CLEVR has distractors
    s["amp"] = concrete_amp(s["amp"], s["device"])
    return Settings(**s)


def data_source(name, root, info):
    """The dataset: the flags', else the checkpoint's (read_ckpt_info)."""
    made_on = info.get("data") or {}
    name = name or made_on.get("name", "clevr")
    root = root or (made_on.get("root") if made_on.get("name") == name else None)
    if info.get("authors") and root is None and not os.path.exists(data.ROOTS[name]):
        flag_error("--data-root", f"no {name} dataset at {data.ROOTS[name]} for the authors' weights")
    return name, data.resolve_root(name, root)


# -----------------------------------------------------------------------------
# the words: CLIP's BPE tokens (the authors')


def encode_captions(items, max_len):
    """Every caption -> ids (N, max_len + 1): start, words, end, padding 0 (dataloader_clevr_caption.py 152-172)."""
    rows = [[clip_load.SOT] + clip_load.encode(c)[:max_len - 1] + [clip_load.EOT] for it in items for c in it.captions]
    return torch.tensor([r + [PAD] * (max_len + 1 - len(r)) for r in rows])


def to_text(ids):
    """Generated ids -> the caption, cut at the end token and at "!" (id 0), as the authors (main_task_caption.py
    589-596)."""
    return clip_load.decode(ids).split("<|endoftext|>")[0].split("!")[0].strip()


def caption_loss(logits, targets):
    """Word-level cross entropy (paper Sec. 3.3): -(1/N) sum_t log p(w_t | w_<t, pair) over the batch's N words;
    logits (B, T, vocab), padding ignored, or (N, vocab) of the words alone."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=PAD)


def batch_loss(model, batch, device, frozen=False, paired=False):
    """caption_loss of a batch; paired (data.DistractorBatches: its change pairs, then their distractors): both halves'
    losses summed, the authors' loss1 + loss2 (main_task_caption.py 307-341). Only the words get the vocabulary's
    logits: a third of a batch's positions are padding."""
    last = int((batch["ids"] != PAD).any(0).nonzero().max())  # the batch's longest caption ends there
    ids = batch["ids"][:, :last + 1].to(device)  # 0 pads (BPE's "!" too: the loss ignores both)
    words = ids[:, 1:] != PAD
    logits = model(ids[:, :-1], words, **model_inputs(batch, device, frozen))  # (N, vocab), batch-major
    targets = ids[:, 1:][words]
    if paired:
        n = int(words[:len(ids) // 2].sum())  # x[words] keeps batch order: the change pairs' words come first
        return caption_loss(logits[:n], targets[:n]) + caption_loss(logits[n:], targets[n:])
    return caption_loss(logits, targets)


# -----------------------------------------------------------------------------
# the model: pair encoder + captioner in one module (one optimizer, one state dict)


class PairCaptioner(nn.Module):
    def __init__(self, clip, captioner):
        super().__init__()
        self.clip, self.captioner = clip, captioner

    def memory(self, before=None, after=None, tokens=None):
        """The pair encoder's tokens, or encode_all's `tokens`."""
        return tokens if tokens is not None else self.clip.visual.forward_pair(before, after).tokens.float()

    def forward(self, ids, words=None, **inputs):
        """Teacher forcing: ids (B, T) given the pair (before=, after= or tokens=) -> logits (B, T, vocab); words:
        Captioner.decode's."""
        return self.captioner(self.memory(**inputs), ids, words)

    @torch.no_grad()
    def caption(self, beam=1, **inputs):
        mem = self.memory(**inputs)
        if beam > 1:
            return beam_search(self.captioner, mem, clip_load.SOT, clip_load.EOT, beam)
        return generate(self.captioner, mem, clip_load.SOT, clip_load.EOT)


def model_inputs(batch, device, frozen):
    """A batch's frozen-encoder tokens, else its images normalized."""
    if frozen:
        return {"tokens": batch["features"].to(device, non_blocking=True)}
    return dict(zip(("before", "after"), data.pair_images(batch, device)))


@torch.no_grad()
def encode_all(model, loader, ctx):
    """Every item's PairCaptioner.memory in fp16 (half fp32's memory)."""
    out = []
    for batch in loader:
        with ctx.amp:
            out.append(model.memory(**model_inputs(batch, ctx.device, False)).half().cpu())
    return torch.cat(out)


def lr_rule(args):
    """What trains, at which rate: parameter name -> learning rate (None: fixed), the authors' (main_task_caption.py
    640-667): the captioner at lr; CLIP's words (the captioner's input and output) at words_lr; the image tower but
    its input embeddings at encoder_lr; the text tower fixed (theirs gets no gradient), with it its positions, which the
    captioner ties in. A rate of 0 fixes."""
    def lr(name):
        if name.startswith("captioner."):
            rate = args.lr
        elif name == "clip.token_embedding.weight":  # the tied words go by their clip.* name
            rate = args.words_lr
        else:
            image_tower = name.startswith("clip.visual.") and not name[len("clip."):].startswith(INPUT_EMBEDDINGS)
            rate = args.encoder_lr if image_tower else 0
        return rate or None
    return lr


# -----------------------------------------------------------------------------
# evaluation: captions, scores, the test (final_test, evaluate.py's too)


@torch.no_grad()
def predict(model, loader, items, ctx, beam=1):
    """-> {item id: caption}"""
    model, frozen = model.eval(), loader.dataset.features is not None
    out = {}
    for batch in loader:
        with ctx.amp:
            ids = model.caption(beam, **model_inputs(batch, ctx.device, frozen))
        for i, row in zip(batch["index"].tolist(), ids.tolist()):
            out[items[i].id] = to_text(row)
    return out


def cider(items, preds):
    """CIDEr-D (x100) of these items: the selection (METEOR would cost far more)."""
    refs_tok = {it.id: [metrics.tokenize(r) for r in it.captions] for it in items}
    return 100 * metrics.cider_d(refs_tok, {i: metrics.tokenize(preds[i]) for i in refs_tok})[0]


def score(items, preds, by_type=False):
    """metrics.evaluate (x100); by_type: CIDEr-D of each CLEVR-Change type's subset (paper Table 2)."""
    scores = {k: 100 * v for k, v in metrics.evaluate({it.id: it.captions for it in items}, preds).items()}
    subsets = {t: [it for it in items if it.change_type == t] for t in (CHANGE_TYPES if by_type else ())}
    return scores, {t: cider(subset, preds) for t, subset in subsets.items() if subset}


def summary(scores):
    return " ".join(f"{k} {scores[k]:.1f}" for k in metrics.METRICS if k in scores)


def final_test(model, loader, train_items, items, ctx, name, root, results_path, beam=1):
    """The captioner on test -> results, to results_path and the log."""
    t0 = time.time()
    preds = predict(model, loader, items, ctx, beam)
    scores, by_type = score(items, preds, by_type=name == "clevr")
    seconds = time.time() - t0
    scenes = synth.read_scenes(root) if name == "clevr" else None  # what really changed
    if name == "pairs":
        log("read-back skipped: your own pairs have no scene records to check the captions against")
    explained = bool(scenes) and synth.is_synthetic(root) and model.clip.cfg.n_inter > 0
    results = {"scores": scores, "scores_by_type": by_type,
               "baseline": metrics.constant_baseline([c for it in train_items for c in it.captions],
                                                     {it.id: it.captions for it in items}, synth.NO_CHANGE),
               "read_back": synth.report(preds, scenes) if scenes else None,
               "attention": plots.attention_on_change(model, items, root, ctx.device) if explained else None,
               "predictions": [{"id": it.id, "before": it.before, "after": it.after, "caption": preds[it.id],
                                "references": it.captions} for it in items]}
    with open(results_path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(results_path + ".tmp", results_path)
    report(results, results_path, beam, len(items), seconds)
    return results


def report(results, results_path, beam, n, seconds):
    scores, baseline, judged, attention = (results[k] for k in ("scores", "baseline", "read_back", "attention"))
    types = " ".join(f"{t} {v:.1f}" for t, v in results["scores_by_type"].items())
    log(f"test ({n} pairs, {'beam ' + str(beam) if beam > 1 else 'greedy'}, {seconds:.0f}s): "
        f"{summary(scores)}" + (f" | CIDEr-D by type: {types}" if types else ""))
    fixed = "" if baseline["candidates"] == "training captions" else f" (best of the {baseline['candidates']})"
    log(f"constant-caption baseline {baseline['caption']!r}{fixed}: CIDEr-D {baseline['scores']['CIDEr-D']:.1f} (model "
        f"/ baseline = {scores['CIDEr-D'] / max(baseline['scores']['CIDEr-D'], 1e-9):.1f}x) -> {results_path}")
    lines = synth.report_lines(judged) if judged else []
    for line in lines + ([plots.attention_line(attention)] if attention else []):
        log(line)


# -----------------------------------------------------------------------------
# reading checkpoints: settings' read_ckpt_info, evaluate.py's load_captioner


def load_captioner(path, device="cpu", n_inter=None):
    """A captioner file, ours or the authors' released one (8 heads; n_inter: its inter blocks, default their 3 of
    9 + 3) -> PairCaptioner."""
    sd, extra = clip_load.read_state_dict(path := clip_load.resolve(path))
    if extra.get("stage") == "caption" and extra.get("format") != FORMAT:
        raise SystemExit(f"{path} is a captioner.pt of an earlier layout: evaluate it after `git checkout "
                         f"{'7670427' if extra.get('format') == 3 else '7dea046'}`")
    if extra.get("stage") != "caption" and not extra.get("decoder"):
        what = "an adapted encoder" if extra.get("stage") or "decoder" in extra else "a CLIP"
        raise SystemExit(f"{path} is not a captioner but {what}: train one with `python caption.py --ckpt {path}`")
    clip = clip_load.build_clip(sd, extra, path, n_inter)
    if "decoder" in extra:  # the authors'
        state, enc, dec = clip_load.authors_captioner(extra["decoder"], sd, path)
        width = clip.cfg.transformer_width
        cfg = CaptionerConfig(clip.cfg.vocab_size, 2 * clip.visual.positional_embedding.shape[0], width,
                              heads_for(width), enc, dec, MAX_LEN)
    else:
        state, cfg = extra["captioner"], CaptionerConfig(**extra["captioner_config"])
    captioner = Captioner(cfg, clip)
    try:
        captioner.load_state_dict(state)
    except RuntimeError as e:
        why = " ".join(str(e).split())[:400]
        raise SystemExit(f"{path}: its captioner does not fit model.Captioner: {why}") from None
    return PairCaptioner(clip, captioner).to(device).eval()


def read_ckpt_info(path):
    """Our checkpoints' entries but the weights; the authors': their stage; {} for any other."""
    path = clip_load.resolve(path)
    try:  # mapped: the weights are not read
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception:  # TorchScript: clip_load reads it, or says why not
        return {}
    keys = [str(k).removeprefix("module.") for k in obj] if isinstance(obj, dict) and "model" not in obj else []
    if any(k.startswith(("decoder.", "clip.")) for k in keys):
        return {"stage": "caption" if any(k.startswith("decoder.") for k in keys) else "adapt", "authors": True}
    return {k: v for k, v in obj.items() if k != "model"} if isinstance(obj, dict) and "model" in obj else {}


# -----------------------------------------------------------------------------
# training: the pieces of main(), in the order it uses them


def load_data(args):
    """The "total" splits (distractors too), the training captions' ids."""
    splits = {s: data.load_items(args.data, args.data_root, s, "total", args.skip_missing)
              for s in ("train", "val", "test")}
    caption_ids = encode_captions(splits["train"], MAX_LEN)
    log(f"data: {args.data} at {args.data_root} | pairs train {len(splits['train'])} val {len(splits['val'])} test "
        f"{len(splits['test'])} | {len(caption_ids)} training captions in CLIP's BPE words")
    return splits, caption_ids


def new_model(args, clip):
    cfg = CaptionerConfig(clip.cfg.vocab_size, 2 * clip.visual.positional_embedding.shape[0], args.width, args.heads,
                          args.enc_layers, args.dec_layers, MAX_LEN, args.dropout)
    return PairCaptioner(clip, Captioner(cfg, clip))


def describe(model, rule, params, args):
    clip, cfg = model.clip.cfg, model.captioner.cfg
    log("what trains:\n" + policy_table(model.named_parameters(), rule))
    log(f"model: pair encoder {clip.vision_layers - clip.n_inter} + {clip.n_inter} "
        f"({'frozen' if args.freeze_encoder else f'lr {args.encoder_lr:g}'}), memory {cfg.memory_len} tokens | "
        f"captioner {cfg.enc_layers}+{cfg.dec_layers} layers, {cfg.width} wide | "
        f"{sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters")


def loader_for(dataset, args, ctx, shuffle=False, batch=None):
    """Evaluation's loader, or training's without distractors: a ragged last batch dropped unless it is the only one."""
    return data.make_loader(dataset, batch or args.eval_batch_size, shuffle, args.workers, ctx.device,
                            drop_last=shuffle and len(dataset) > (batch or 1), seed=args.seed)


def loaders(model, splits, caption_ids, args, ctx):
    """Training, val and test loaders; a frozen encoder runs here, once per pair."""
    size = model.clip.cfg.image_resolution
    cache = data.open_image_cache([it for v in splits.values() for it in v], size, args.image_cache)
    feats = {}
    if args.freeze_encoder:
        t0 = time.time()
        for s, items in splits.items():
            feats[s] = encode_all(model, loader_for(data.ImageDataset(items, size, cache), args, ctx), ctx)
        log(f"encoded {sum(map(len, feats.values()))} pairs once (frozen encoder) in {time.time() - t0:.0f}s")
    # a caption drawn per pair and epoch, no image swapped: the authors' stage 2
    train_set = data.CaptionDataset(splits["train"], size, cache=cache, seed=args.seed, ids=caption_ids, draw=True,
                                    features=feats.get("train"))
    train = (data.make_loader(train_set, args.batch_size, True, args.workers, ctx.device, seed=args.seed,
                              pairs=data.distractor_partners(splits["train"])) if args.pair_distractors else
             loader_for(train_set, args, ctx, shuffle=True, batch=args.batch_size))
    return train, *(loader_for(data.ImageDataset(splits[s], size, cache, feats.get(s)), args, ctx)
                    for s in ("val", "test"))


def validate(model, loader, items, scenes, ctx):
    preds = predict(model, loader, items, ctx)
    val = {"CIDEr-D": cider(items, preds)}
    if scenes:
        judged = synth.report(preds, scenes)
        val.update({k: judged[k + " %"] for k in ("right type", "right object")})
    return val


def checkpoint(model, args, figures):
    """What load_captioner rebuilds the captioner from, and what produced it."""
    return {"model": model.clip.state_dict(), "captioner": model.captioner.state_dict(),
            "config": asdict(model.clip.cfg), "captioner_config": asdict(model.captioner.cfg),
            "data": {"name": args.data, "root": args.data_root, "image_size": model.clip.cfg.image_resolution},
            "args": vars(args), "metrics": figures, "stage": "caption", "format": FORMAT}


def test_best(model, loader, splits, history, args, ctx):
    """The model chosen on val (--out) tested once; its figures added to --out."""
    chosen = torch.load(args.out, map_location=ctx.device, weights_only=True)
    model.clip.load_state_dict(chosen["model"])
    model.captioner.load_state_dict(chosen["captioner"])
    results = final_test(model, loader, splits["train"], splits["test"], ctx, args.data, args.data_root,
                         args.results)
    figures = {**chosen["metrics"], "test": results["scores"], "test_by_type": results["scores_by_type"],
               "baseline": results["baseline"], "history": history}
    save_atomic(checkpoint(model, args, figures), args.out)
    return results


def main(argv=None):
    args = settings(argv)
    ctx = setup(args.seed, args.device, args.amp)
    log(f"caption.py: preset {args.preset} on {where(ctx)} | {args.line()}")
    state = load_resume(args.out) if args.resume else None
    clip = clip_load.load_clip(args.ckpt, ctx.device, args.n_inter, args.activation)
    if not args.adapted:
        log(f"{args.ckpt} is not an adapted encoder: the no-adaptation ablation (paper Table 5)")
    if args.authors_numerics:
        authors_fp16_(clip)
    splits, caption_ids = load_data(args)
    scenes = synth.read_scenes(args.data_root) if args.data == "clevr" else None

    model = new_model(args, clip).to(ctx.device)
    rule = lr_rule(args)
    freeze(model.named_parameters(), rule)
    groups = param_groups(model.named_parameters(), rule, args.weight_decay, authors_decays(model, bert="captioner"))
    params = [p for g in groups for p in g["params"]]
    optimizer = BertAdam(groups, lr=args.lr, betas=args.betas, eps=args.eps)  # each group has lr_rule's rate
    describe(model, rule, params, args)
    train_loader, val_loader, test_loader = loaders(model, splits, caption_ids, args, ctx)
    total_steps = args.epochs * len(train_loader)
    scheduler = authors_schedule(optimizer, total_steps, args.warmup, "linear")
    run = resume_run(state, model, optimizer, scheduler, args) if state else new_run()
    stop = args.epochs
    if run["epochs_without_gain"] >= args.patience:  # it stays stopped
        stop = run["epoch"]
        log(f"the run had stopped early after epoch {stop}: the test of epoch {run['best_epoch']}")

    def step(batch):
        optimizer.zero_grad(set_to_none=True)
        with ctx.amp:
            loss = batch_loss(model, batch, ctx.device, args.freeze_encoder, args.pair_distractors)
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        optimizer.step()
        scheduler.step()
        return loss.detach()

    # select on val CIDEr-D, stop after --patience epochs without gain
    t_start = time.time()
    try:
        for epoch in range(run["epoch"], stop):
            data.set_epoch(train_loader, epoch)
            t0 = time.time()
            model.train()
            loss = train_epoch(ctx, train_loader, step, optimizer, run, Progress(epoch, args.epochs, total_steps,
                                                                                args.log_every))
            val = validate(model, val_loader, splits["val"], scenes, ctx)
            if end_epoch(run, loss, {f"val {k}": v for k, v in val.items()}, val["CIDEr-D"]):  # a tie: the later
                save_atomic(checkpoint(model, args, {"val": val, "epoch": epoch + 1}), args.out)
            right = "".join(f", {k} {val[k]:.0f}%" for k in ("right type", "right object") if k in val)
            log(f"epoch {epoch + 1}/{args.epochs} | loss {loss:.3f} | val {summary(val)}{right} | best CIDEr-D "
                f"{run['best']:.1f} (epoch {run['best_epoch']}) | {time.time() - t0:.0f}s")
            save_state(args.out, model, optimizer, scheduler, run, args)
            plots.curves(os.path.splitext(args.out)[0] + ".curves.png", run["history"], "val CIDEr-D")
            if run["epochs_without_gain"] >= args.patience:
                log(f"early stop: no val CIDEr-D gain for {run['epochs_without_gain']} epochs")
                break
    except KeyboardInterrupt:
        interrupted(args.out)
    log(f"training done in {fmt_time(time.time() - t_start)} ({where(ctx, speed=True)}): best val CIDEr-D "
        f"{run['best']:.1f} at epoch {run['best_epoch']}")
    return test_best(model, test_loader, splits, run["history"], args, ctx)


if __name__ == "__main__":
    data.run(main)
