"""Stage 2 of CLIP4IDC: a Transformer captioner on the adapted pair encoder (paper Sec. 3.3).

    python caption.py --ckpt adapted.pt      # train; select on val CIDEr-D; test -> captioner.pt, captions.json
    python caption.py --ckpt captioner.pt    # evaluate a trained captioner on test (--beam 3, --gallery out.png)
    python caption.py --ckpt pytorch_model.bin.clevr --amp off   # evaluate the authors' released captioner
    python caption.py --ckpt captioner.pt --before a.png --after b.png   # caption your own two images

The pair encoder's 2(n+1) output tokens are the memory of model.Captioner (the paper preset's: the authors' model;
the mini preset's: a small pre-LN decoder, README "Where the quickstart differs from the paper"), trained with
word-level cross entropy, the pair encoder fine-tuned at its own tiny rate or kept frozen (--freeze-encoder: its
tokens computed once per pair, the big saving on a CPU). CLEVR-Change in the "total" setting: change pairs and
distractor pairs (no-change captions), each with one of its captions drawn per epoch. The paper preset trains as the
authors' main_task_caption.py: 16 change pairs a step, each with its own distractor, two losses summed; BertAdam,
warmup then linear decay, their decay sets; stopping after 11 epochs without gain. It selects on val CIDEr-D (theirs:
on test). The test scores (metrics.py), CIDEr-D per change type (paper Table 2) and the best constant caption go
to --results.
"""
import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.nn as nn
import torch.nn.functional as F

import clip_load
import data
import metrics
import plots
import synth
from model import INPUT_EMBEDDINGS, Captioner, CaptionerConfig, authors_fp16_
from train_utils import (HelpFormatter, Progress, at_least, authors_decays, authors_schedule, check_resume,
                         flag_error, fmt_time, freeze, improved, interrupted, last_path, load_resume, log,
                         make_optimizer, param_groups, policy_table, restore, rng_state, run_flags, save_atomic, setup,
                         train_epoch, warmup_cosine, where)

PRESETS = {
    # CPU, adapt.py's small encoders, frozen (its tokens computed once per pair): a 2-layer pre-LN decoder with its
    # own words reads the memory (README "Where the quickstart differs from the paper")
    "mini": dict(width=128, heads=4, enc_layers=0, dec_layers=2, batch_size=32, lr=1e-3, encoder_lr=0.0,
                 freeze_encoder=True, epochs=15, reverse=None, mem_diff=True, mem_pool=None, vocab="words",
                 post_ln=False, mem_proj=True, mem_image=True, optimizer="adamw", patience=10, tie_is_gain=False,
                 pair_distractors=False),
    # the authors' (their code and scripts/caption_clevr.sh): their captioner, the pair encoder fine-tuned at 1e-4 x
    # 1e-3, 16 change pairs a step, each with its distractor; stop after 11 epochs without gain (743-750)
    "paper": dict(width=None, heads=None, enc_layers=3, dec_layers=3, batch_size=16, lr=1e-4, encoder_lr=1e-7,
                  freeze_encoder=False, epochs=50, reverse=False, mem_diff=False, mem_pool=1, vocab="clip",
                  post_ln=True, mem_proj=False, mem_image=False, optimizer="bertadam", patience=11, tie_is_gain=True,
                  pair_distractors=True),
}
# for adapt.py --preset compare, whose inter blocks learned to compare: mini without after minus before (it would do
# the comparing for them), longer
PRESETS["compare"] = dict(PRESETS["mini"], mem_diff=False, epochs=30, batch_size=64)
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD, BOS, EOS, UNK = range(4)
MAX_LEN = 32  # most tokens a caption gets, the end token included (the authors' --max_words)
CHANGE_TYPES = ("color", "material", "move", "add", "drop", "distractor")
FORMAT, FORMAT_COMMIT = 2, "aa7f13b"  # captioner.pt's layout, and the commit that made it (the authors' captioner)


# -----------------------------------------------------------------------------
# the words: CLIP's BPE tokens (the authors'), or a word-level vocabulary built from the training captions (mini)


def words(sentence):
    return metrics.tokenize(sentence).split()  # PTB-style, as the evaluation sees it


def build_vocab(captions, kind="words"):
    return clip_load.bpe_tokens() if kind == "clip" else SPECIALS + sorted({w for c in captions for w in words(c)})


def is_bpe(vocab):
    return vocab[-1] == "<|endoftext|>"  # CLIP's last token


def encode_captions(items, vocab, max_len):
    """All captions of all items, in order -> ids (N_captions, max_len + 1) = start, words (at most max_len - 1),
    end, padding 0 (the authors' dataloader_clevr_caption.py 152-172, there with CLIP's BPE)."""
    index = {w: i for i, w in enumerate(vocab)}
    start, end = (clip_load.SOT, clip_load.EOT) if is_bpe(vocab) else (BOS, EOS)
    ids = [clip_load.encode(c) if is_bpe(vocab) else [index.get(w, UNK) for w in words(c)]
           for it in items for c in it.captions]
    rows = [[start] + r[:max_len - 1] + [end] for r in ids]
    return torch.tensor([r + [PAD] * (max_len + 1 - len(r)) for r in rows])


def to_text(ids, vocab):
    """Generated ids (no start token) -> the caption. BPE: decoded, then cut at the end token and at the first "!"
    (the pad, id 0), as the authors cut it (main_task_caption.py 589-596)."""
    if is_bpe(vocab):
        return clip_load.decode(ids).split("<|endoftext|>")[0].split("!")[0].strip()
    ids = ids[:ids.index(EOS)] if EOS in ids else ids
    return " ".join(vocab[i] for i in ids if i not in (PAD, BOS))


def caption_loss(logits, targets):
    """Word-level cross entropy (paper Sec. 3.3): -(1/N) sum_t log p(w_t | w_<t, pair), over the N words
    (<eos> included, padding not) of the batch. logits (B, T, vocab), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=PAD)


def batch_loss(model, batch, device, frozen=False, paired=False):
    """caption_loss -> (loss, pairs); paired (DistractorBatches: change pairs, then their distractors): the
    authors' loss1 + loss2 (main_task_caption.py 307-341)."""
    ids = batch["ids"][:, :int((batch["ids"] != PAD).sum(1).max())].to(device)  # the shared padding cut
    logits = model(ids[:, :-1], **model_inputs(batch, device, frozen))
    if paired:
        h = len(ids) // 2
        return caption_loss(logits[:h], ids[:h, 1:]) + caption_loss(logits[h:], ids[h:, 1:]), len(ids)
    return caption_loss(logits, ids[:, 1:]), len(ids)


# -----------------------------------------------------------------------------
# the model: pair encoder + captioner in one module (one optimizer, one state dict)


class PairCaptioner(nn.Module):
    def __init__(self, clip, captioner):
        super().__init__()
        self.clip, self.captioner = clip, captioner

    def memory(self, before=None, after=None, tokens=None, both_ways=False):
        """What the captioner reads (B, 2(m+1), embed_dim): the pair encoder's tokens of the two images, each image's
        patch grid pooled (--mem-pool: m = n / k^2), or `tokens`, those computed already (a frozen encoder runs once
        per pair, before training: encode_all). both_ways: (after, before) too, as rows B..2B-1 (--reverse)."""
        if tokens is not None:
            return tokens
        return self.captioner.pool(self.clip.visual.forward_pair(before, after, both_ways).tokens.float())

    def forward(self, ids, **inputs):
        return self.captioner(self.memory(**inputs), ids)  # (B, T, vocab)

    @torch.no_grad()
    def caption(self, beam=1, **inputs):
        mem = self.memory(**inputs)
        start, end = (clip_load.SOT, clip_load.EOT) if self.captioner.cfg.clip_words else (BOS, EOS)
        if beam > 1:
            return self.captioner.beam_search(mem, start, end, beam)
        return self.captioner.generate(mem, start, end)


def model_inputs(batch, device, frozen):
    """PairCaptioner's inputs on the device from a batch: a frozen encoder's tokens (the datasets' "features"),
    else the two uint8 images, normalized here."""
    if frozen:
        return {"tokens": batch["features"].to(device, non_blocking=True)}
    return {k: clip_load.normalize(batch[k].to(device, non_blocking=True)) for k in ("before", "after")}


@torch.no_grad()
def encode_all(model, loader, ctx, both_ways=False):
    """Images -> the captioner's memory for every item (PairCaptioner.memory, pooled once here), in fp16 (half the
    memory, below the noise). both_ways: then every item as (after, before), --reverse's pairs."""
    out, back = [], []
    for batch in loader:
        with ctx.amp:
            tokens = model.memory(**model_inputs(batch, ctx.device, False), both_ways=both_ways).half().cpu()
        out.append(tokens[:len(batch["index"])])
        back.append(tokens[len(batch["index"]):])  # empty unless both_ways
    return torch.cat(out + back)


def load_captioner(path, device="cpu"):
    """A captioner file -> (PairCaptioner in eval mode, vocab): ours (caption.py's captioner.pt) or the authors'
    released one (their `clip.*` / `decoder.*` state dict, e.g. pytorch_model.bin.clevr: their captioner is
    model.Captioner's defaults with CLIP's words, heads = width / 64 as their 8 at 512, n_inter 3 as their 9 + 3)."""
    sd, extra = clip_load.read_state_dict(path := clip_load.resolve(path))
    if extra.get("stage") == "caption" and extra.get("format") != FORMAT:
        raise SystemExit(f"{path} is a captioner.pt from before commit {FORMAT_COMMIT} changed its layout: evaluate "
                         f"it after `git checkout fe39aa0`, or train a captioner again")
    if extra.get("stage") != "caption" and not extra.get("decoder"):
        what = "an adapted encoder" if extra.get("stage") or "decoder" in extra else "a CLIP"
        raise SystemExit(f"{path} is not a captioner but {what} (no decoder in it): train one on it with `python "
                         f"caption.py --ckpt {path}`")
    clip = clip_load.build_clip(sd, extra, path)
    if "decoder" in extra:  # the authors'
        state, enc, dec = clip_load.authors_captioner(extra["decoder"], sd, path)
        c = clip.cfg
        cfg = CaptionerConfig(c.vocab_size, c.embed_dim, 2 * clip.visual.positional_embedding.shape[0],
                              c.transformer_width, max(1, c.transformer_width // 64), enc, dec, clip_words=True)
        vocab = clip_load.bpe_tokens()
    else:
        state, cfg, vocab = extra["captioner"], CaptionerConfig(**extra["captioner_config"]), extra["vocab"]
    captioner = Captioner(cfg, clip)
    try:
        captioner.load_state_dict(state)
    except RuntimeError as e:  # the keys missing, unexpected or of another shape, in one line
        why = " ".join(str(e).split())[:400]
        raise SystemExit(f"{path}: its captioner does not fit model.Captioner: {why}") from None
    return PairCaptioner(clip, captioner).to(device).eval(), vocab


def read_ckpt_info(path):
    """The non-model entries of our own checkpoints; {"stage": "caption" or "adapt", "authors": True} for the
    authors' captioners (a state dict with decoder.* keys) and encoders (clip.* alone); {} for OpenAI's archive or
    another bare state dict. mmap: reading the small entries of a big file costs nothing."""
    path = clip_load.resolve(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # TorchScript archives and legacy files: clip_load.load_clip reads them (or explains why not)
        return {}
    keys = [str(k).removeprefix("module.") for k in obj] if isinstance(obj, dict) and "model" not in obj else []
    if any(k.startswith(("decoder.", "clip.")) for k in keys):  # the authors' captioner, or their stage-1 encoder
        return {"stage": "caption" if any(k.startswith("decoder.") for k in keys) else "adapt", "authors": True}
    return {k: v for k, v in obj.items() if k != "model"} if isinstance(obj, dict) and "model" in obj else {}


def lr_rule(args):
    """Parameter name -> learning rate (None: frozen), the authors' (main_task_caption.py 640-667): the captioner at
    --lr; the pair encoder at --encoder-lr (unless --freeze-encoder) but its input embeddings; the text tower never
    (theirs gets no gradient); CLIP's word embeddings, tied into the decoder, on Spot-the-Diff only."""
    def lr(name):
        if name.startswith("captioner."):
            return args.lr
        if args.freeze_encoder:
            return None
        if name == "clip.token_embedding.weight" and args.vocab == "clip" and args.data == "spot":
            return args.encoder_lr
        inside = name[len("clip."):]
        trained = name.startswith("clip.visual.") and not inside.startswith(INPUT_EMBEDDINGS)
        return args.encoder_lr if trained else None
    return lr


# -----------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def predict(model, loader, items, vocab, ctx, beam=1):
    """Captions of every item the loader yields -> {item id: caption}."""
    model, frozen = model.eval(), loader.dataset.features is not None
    out = {}
    for batch in loader:
        with ctx.amp:
            ids = model.caption(beam, **model_inputs(batch, ctx.device, frozen))
        for i, row in zip(batch["index"].tolist(), ids.tolist()):
            out[items[i].id] = to_text(row, vocab)
    return out


def cider(items, preds):
    """CIDEr-D (x100) of these items alone: the per-epoch model selection (all four metrics cost far more,
    METEOR most of it)."""
    refs_tok = {it.id: [metrics.tokenize(r) for r in it.captions] for it in items}
    return 100 * metrics.cider_d(refs_tok, {i: metrics.tokenize(preds[i]) for i in refs_tok})[0]


def score(items, preds, by_type=False):
    """metrics.evaluate on these items (x100); by_type: CIDEr-D per CLEVR-Change type, each type's subset scored
    on its own (as Park et al.'s per-type evaluation, the paper's Table 2)."""
    scores = {k: 100 * v for k, v in metrics.evaluate({it.id: it.captions for it in items}, preds).items()}
    subsets = {t: [it for it in items if it.change_type == t] for t in (CHANGE_TYPES if by_type else ())}
    return scores, {t: cider(subset, preds) for t, subset in subsets.items() if subset}


def summary(scores):
    return " ".join(f"{k} {scores[k]:.1f}" for k in metrics.METRICS if k in scores)


# -----------------------------------------------------------------------------
# the test, once: scores, the read-back and attention figures (final_test), the log lines (report), the gallery


def final_test(model, loader, train_items, items, vocab, args, ctx, name, root):
    """The chosen captioner on test, once -> results: scores (per change type on CLEVR), the constant-caption
    baseline, every prediction, with scene records the read-back, on a synthetic set the attention figure; to
    --results, the log (report) and --gallery."""
    t0 = time.time()
    preds = predict(model, loader, items, vocab, ctx, args.beam)
    scores, by_type = score(items, preds, by_type=name == "clevr")
    seconds = time.time() - t0
    scenes = synth.read_scenes(root) if name == "clevr" else None  # the renderer's record: what really changed
    # the attention figure needs the changed object's place (a synthetic set); N + 0 has no inter block to look at
    explained = bool(scenes) and synth.is_synthetic(root) and model.clip.cfg.n_inter > 0
    results = {"scores": scores, "scores_by_type": by_type,
               "baseline": metrics.constant_baseline([c for it in train_items for c in it.captions],
                                                     {it.id: it.captions for it in items}, synth.NO_CHANGE),
               "read_back": synth.report(preds, scenes) if scenes else None,
               "attention": plots.attention_on_change(model, items, root, ctx.device) if explained else None,
               "predictions": [{"id": it.id, "before": it.before, "after": it.after, "caption": preds[it.id],
                                "references": it.captions} for it in items]}
    with open(args.results + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(args.results + ".tmp", args.results)
    report(results, args, len(items), seconds)
    if args.gallery:
        plots.draw_gallery(args.gallery, items, preds, model, model.clip.cfg.image_resolution, ctx.device)
    return results


def report(results, args, n, seconds):
    """The test results in a few lines: scores, the baseline, and where there are scene records the read-back
    (by change type too) and the attention figure."""
    scores, baseline, judged, attention = (results[k] for k in ("scores", "baseline", "read_back", "attention"))
    types = " ".join(f"{t} {v:.1f}" for t, v in results["scores_by_type"].items())
    log(f"test ({n} pairs, {'beam ' + str(args.beam) if args.beam > 1 else 'greedy'}, {seconds:.0f}s): "
        f"{summary(scores)}" + (f" | CIDEr-D by type: {types}" if types else ""))
    fixed = "" if baseline["candidates"] == "training captions" else f" (best of the {baseline['candidates']})"
    log(f"constant-caption baseline {baseline['caption']!r}{fixed}: CIDEr-D {baseline['scores']['CIDEr-D']:.1f} (model "
        f"/ baseline = {scores['CIDEr-D'] / max(baseline['scores']['CIDEr-D'], 1e-9):.1f}x) -> {args.results}")
    if judged:
        log(f"read back against the scenes: {judged['change caption %']:.0f}% of {judged['change pairs']} change pairs "
            f"get a change caption, {judged['right type %']:.0f}% the right change type, "
            f"{judged['right object %']:.0f}% the right object; {judged['no change on distractors %']:.0f}% of "
            f"{judged['distractor pairs']} distractors get \"no change\"")
        types = ", ".join(f"{t} {judged[t]['right type %']:.0f}/{judged[t]['right object %']:.0f}%"
                          for t in synth.CHANGES if t in judged)
        log(f"   by change type, right type/object: {types}")
    if attention:
        log(f"attention: the strongest patch of the last inter block's [CLS] map falls on the changed object in "
            f"{attention['map on the change %']:.0f}% of change pairs (a random patch: "
            f"{attention['random patch %']:.0f}%)")


# -----------------------------------------------------------------------------
# arguments


def get_args(argv=None):
    pre = lambda k: "[" + ", ".join(f"{n}: {v[k]}" for n, v in PRESETS.items()) + "]"  # the presets' values
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    # input, output
    p.add_argument("--ckpt", default="adapted.pt", help="adapted.pt (train a captioner on it); a raw CLIP file or "
                   "'ViT-B/32' (the no-adaptation ablation); or a captioner, ours (captioner.pt) or the authors' "
                   "released one (pytorch_model.bin.clevr): evaluate it, caption images")
    p.add_argument("--out", default="captioner.pt", help="where the best captioner goes (+ .last.pt to resume)")
    p.add_argument("--results", default="captions.json", help="test scores, baseline and predictions (JSON)")
    p.add_argument("--preset", choices=["auto", "mini", "compare", "paper"], default="auto", help="defaults for the "
                   "flags left unset: auto = compare after adapt.py --preset compare, mini for its other small "
                   "encoders, paper for ViT-B/32")
    # data
    p.add_argument("--data", choices=["clevr", "spot", "ier", "levir"], default=None,
                   help="dataset (default: the one the checkpoint was adapted on, else clevr)")
    p.add_argument("--data-root", default=None, help="dataset directory (default: the checkpoint's, else data/...)")
    p.add_argument("--skip-missing", action="store_true", help="drop pairs whose images are missing")
    p.add_argument("--reverse", action=argparse.BooleanOptionalAction, default=None, help="also train on every pair "
                   "backwards (an addition becomes a removal; a synthetic set's: on in the mini presets)")
    p.add_argument("--workers", type=at_least(0), default=2, help="image-loading processes")
    p.add_argument("--image-cache", action=argparse.BooleanOptionalAction, default=None, help="decode every image "
                   "once into a uint8 file ($CLIP4IDC_IMAGE_CACHE, else ~/.cache/clip4idc/images); default: if it fits")
    # model
    p.add_argument("--n-inter", type=at_least(0), default=None, help="inter blocks of the pair encoder (default: the "
                   "checkpoint's, 3 for a raw CLIP)")
    p.add_argument("--width", type=at_least(1), default=None, help="captioner width [mini, compare: 128; paper: the "
                   "CLIP's word embeddings', 512 in ViT-B/32]")
    p.add_argument("--heads", type=at_least(1), default=None, help="captioner attention heads [mini, compare: 4; "
                   "paper: width / 64, the authors' 8 at 512]")
    p.add_argument("--enc-layers", type=at_least(0), default=None, help=f"captioner encoder layers {pre('enc_layers')}")
    p.add_argument("--dec-layers", type=at_least(1), default=None, help=f"captioner decoder layers {pre('dec_layers')}")
    p.add_argument("--vocab", choices=["clip", "words"], default=None, help="clip: CLIP's BPE tokens, its embeddings "
                   f"tied in (the authors'); words: the training captions' own {pre('vocab')}")
    p.add_argument("--post-ln", action=argparse.BooleanOptionalAction, default=None, help="BERT's post-LN layers, "
                   f"decoder layer i reading encoder layer i (the authors'); else pre-LN {pre('post_ln')}")
    p.add_argument("--mem-proj", action=argparse.BooleanOptionalAction, default=None, help="not the authors': a "
                   f"learned projection and position per memory token (for a --width not its own) {pre('mem_proj')}")
    p.add_argument("--mem-image", action=argparse.BooleanOptionalAction, default=None,
                   help=f"not the authors': a learned vector per image added to its memory tokens {pre('mem_image')}")
    p.add_argument("--mem-diff", action=argparse.BooleanOptionalAction, default=None,
                   help=f"not the authors': each memory token also gets after minus before {pre('mem_diff')}")
    p.add_argument("--mem-pool", type=at_least(1), default=None, help="not the authors': the captioner reads each "
                   "image's patch tokens averaged over k x k cells (the grid must divide by k) [mini, compare: 2 on an "
                   "even grid of 12x12 or more, else 1; paper: 1]")
    p.add_argument("--dropout", type=at_least(0.0, float, below=1.0), default=0.1, help="captioner dropout (paper 0.1)")
    # optimization
    p.add_argument("--epochs", type=at_least(1), default=None, help=f"most epochs {pre('epochs')}")
    p.add_argument("--batch-size", type=at_least(1), default=None, help=f"pairs per step {pre('batch_size')}")
    p.add_argument("--lr", type=at_least(0.0, float), default=None, help=f"captioner learning rate {pre('lr')}")
    p.add_argument("--encoder-lr", type=at_least(0.0, float), default=None,
                   help=f"pair-encoder learning rate, with --no-freeze-encoder {pre('encoder_lr')}")
    p.add_argument("--freeze-encoder", action=argparse.BooleanOptionalAction, default=None,
                   help=f"keep the pair encoder fixed, its tokens computed once {pre('freeze_encoder')}")
    p.add_argument("--weight-decay", type=at_least(0.0, float), default=0.01, help="weight decay")
    p.add_argument("--optimizer", choices=["bertadam", "adamw"], default=None, help="bertadam: the authors' (b2 0.999, "
                   f"warmup then linear decay, their decay sets); adamw: b2 0.98, cosine, no decay on 1-D tensors "
                   f"{pre('optimizer')}")
    p.add_argument("--pair-distractors", action=argparse.BooleanOptionalAction, default=None, help="CLEVR: each "
                   f"change pair with its own distractor, two losses summed (the authors') {pre('pair_distractors')}")
    p.add_argument("--authors-numerics", action="store_true", help="the authors' fp16 (model.authors_fp16_); with "
                   "bertadam")
    run_flags(p, log_every=50)
    p.add_argument("--patience", type=at_least(1), default=None, help="stop after this many epochs without val "
                   f"CIDEr-D gain (paper: a tie is a gain) {pre('patience')}")
    # decoding, output figures
    p.add_argument("--beam", type=at_least(1), default=1, help="beam size (1: greedy, as the paper)")
    p.add_argument("--eval-batch-size", type=at_least(1), default=64, help="pairs per decoding batch")
    p.add_argument("--gallery", default=None, help="also draw test pairs with their captions into this PNG")
    # your own two images
    p.add_argument("--before", default=None, help="caption this image pair (needs a captioner --ckpt)")
    p.add_argument("--after", default=None, help="the 'after' image of --before")
    p.add_argument("--explain", default=None, help="with --before/--after: also draw the caption, the two images "
                                                   "and where the encoder looked into this PNG")
    args = p.parse_args(argv)
    if bool(args.before) != bool(args.after):
        p.error("--before and --after go together")
    if args.explain and not args.before:
        p.error("--explain draws one pair: give --before and --after too")
    if not os.path.isfile(args.ckpt) and args.ckpt not in clip_load.MODELS and args.ckpt not in clip_load.SHIPPED:
        p.error(f"argument --ckpt: no file at {args.ckpt}. Run `python adapt.py` first (it writes adapted.pt), or "
                f"pass a CLIP file / 'ViT-B/32' / 'mini12-synth' for the no-adaptation ablation, or a captioner")
    for flag, path in (("--before", args.before), ("--after", args.after)):
        if path and not os.path.isfile(path):
            p.error(f"argument {flag}: no image at {path}")
    check_resume(p, args)
    return args


def apply_preset(args, ckpt_info):
    """auto: compare after adapt.py --preset compare, mini for the other small encoders (the shipped mini CLIP,
    adapted or raw, and the from-scratch one), paper for a ViT-B/32 (OpenAI's, adapted or raw)."""
    small = args.ckpt in clip_load.SHIPPED or ckpt_info.get("config", {}).get("vision_width", 768) < 768  # raw mini
    compare = ckpt_info.get("args", {}).get("preset") == "compare"  # adapted with adapt.py --preset compare
    name = args.preset if args.preset != "auto" else ("compare" if compare else "mini" if small else "paper")
    vars(args).update({k: v for k, v in PRESETS[name].items() if getattr(args, k, None) is None})  # a flag given wins
    if args.authors_numerics and args.optimizer != "bertadam":
        flag_error("--authors-numerics", f"their fp16 state is BertAdam's: give --optimizer bertadam (preset {name} "
                                         f"has {args.optimizer})")
    if not args.freeze_encoder and args.encoder_lr <= 0:
        flag_error("--encoder-lr", f"--no-freeze-encoder needs --encoder-lr > 0 (preset {name} has "
                                   f"{args.encoder_lr:g})")
    return name


# -----------------------------------------------------------------------------
# without training: caption two images, or evaluate a trained captioner (main, at the end, picks one or train)


def caption_images(args, ckpt_info):
    if ckpt_info.get("stage") != "caption":
        raise SystemExit(f"--before/--after need a trained captioner: {args.ckpt} is not one (train it with "
                         f"`python caption.py --ckpt adapted.pt`, then pass --ckpt captioner.pt)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, vocab = load_captioner(args.ckpt, device)
    size = model.clip.cfg.image_resolution  # any size and mode: squashed to the encoder's input, RGB
    before, after = (clip_load.load_image(p, size)[None].to(device) for p in (args.before, args.after))  # normalized
    text = to_text(model.caption(args.beam, before=before, after=after)[0].tolist(), vocab)
    print(text)
    if args.explain:
        if model.clip.cfg.n_inter == 0:
            raise SystemExit(f"--explain draws the last inter block's attention: this encoder "
                             f"({model.clip.cfg.vision_layers} + 0) has none")
        maps = plots.encoder_maps(model, [(args.before, args.after)], size, device)[0]
        plots.explain(args.explain, plots.rgb(args.before), plots.rgb(args.after), text, maps)
        print(f"caption, images and attention maps -> {args.explain}")
    return text


def evaluate_captioner(args, ckpt_info):
    """--ckpt captioner.pt (or the authors' released captioner) without --before: test scores, baseline,
    predictions (and --gallery) of that model. Under bf16 the authors' weights are also decoded in fp32, their
    reference (--amp off), and the captions that differ counted."""
    ctx = setup(args.seed, args.device, args.amp)
    name, root = data_source(args, ckpt_info)  # a missing dataset says so before the weights are read
    model, vocab = load_captioner(args.ckpt, ctx.device)
    train_items = data.load_items(name, root, "train", "total", images=False)  # the baseline's captions only
    test_items = data.load_items(name, root, "test", "total", args.skip_missing)
    loader = loader_for(data.ImageDataset(test_items, model.clip.cfg.image_resolution), args, ctx)
    results = final_test(model, loader, train_items, test_items, vocab, args, ctx, name, root)
    if ckpt_info.get("authors") and isinstance(ctx.amp, torch.autocast):
        fp32 = predict(model, loader, test_items, vocab, setup(args.seed, ctx.device, "off"), args.beam)
        differ = sum(p["caption"] != fp32[p["id"]] for p in results["predictions"])
        log(f"bf16 against fp32 (--amp off, the reference for their weights): {differ} of {len(fp32)} captions differ")
    return results


# -----------------------------------------------------------------------------
# training: the pieces of train(), in the order it uses them


def data_source(args, ckpt_info):
    """Dataset name and directory: the flags, else what the encoder was adapted on. The authors' weights are for
    real data: no synthetic set stands in for a missing one."""
    info = ckpt_info.get("data") or {}
    name = args.data or info.get("name", "clevr")
    root = args.data_root or (info.get("root") if info.get("name") == name else None)
    if ckpt_info.get("authors") and root is None and not os.path.exists(data.ROOTS[name]):
        flag_error("--data-root", f"no {name} dataset at {data.ROOTS[name]} for the authors' weights: give its folder")
    return name, data.resolve_root(name, root)


def load_data(args, ckpt_info, resume, ctx):
    """The dataset in the "total" setting (CLEVR-Change: change pairs + distractor pairs) -> (name, root, splits,
    vocabulary (a resumed run's own), every training caption's word ids)."""
    name, root = data_source(args, ckpt_info)
    splits = {s: data.load_items(name, root, s, "total", args.skip_missing) for s in ("train", "val", "test")}
    if args.reverse is None:  # the mini preset: on where the renderer's scene records allow it
        args.reverse = synth.is_synthetic(root)
    if args.reverse:
        splits["train"] = splits["train"] + data.reversed_pairs(splits["train"], root)
    vocab = resume["vocab"] if resume else build_vocab([c for it in splits["train"] for c in it.captions], args.vocab)
    caption_ids = encode_captions(splits["train"], vocab, MAX_LEN)
    log(f"data: {name} at {root} | pairs train {len(splits['train'])}"
        f"{' (half of them reversed, --reverse)' if args.reverse else ''} val {len(splits['val'])} test "
        f"{len(splits['test'])} | vocabulary {len(vocab)} {'CLIP BPE tokens' if is_bpe(vocab) else 'words'}"
        f" | {len(caption_ids)} training captions")
    return name, root, splits, vocab, caption_ids


def resolve_mem_pool(args, clip):
    """--mem-pool for this CLIP's patch grid: the mini preset's None is 2 (2x2 cells) on a grid of 12x12 or more
    that 2 divides, else 1 (every patch); the grid must divide by it."""
    grid = clip.cfg.image_resolution // clip.cfg.vision_patch_size
    if args.mem_pool is None:
        args.mem_pool = 2 if grid >= 12 and grid % 2 == 0 else 1
    if grid % args.mem_pool:
        flag_error("--mem-pool", f"{args.mem_pool} does not divide {args.ckpt}'s {grid}x{grid} patch grid")
    return args.mem_pool


def resolve_sizes(args, clip):
    """--mem-pool (resolve_mem_pool), --width and --heads for this CLIP, checked before any data is made: the paper
    preset's width is the CLIP's word embeddings' (the authors'), its heads width / 64."""
    resolve_mem_pool(args, clip)
    args.width = args.width or clip.cfg.transformer_width
    args.heads = args.heads or max(1, args.width // 64)
    if args.vocab == "clip" and args.width != clip.cfg.transformer_width:
        flag_error("--width", f"--vocab clip: the CLIP's word embeddings are {clip.cfg.transformer_width} wide")
    if not args.mem_proj and args.width != clip.cfg.embed_dim:
        flag_error("--mem-proj", f"{args.ckpt}'s tokens are {clip.cfg.embed_dim} wide, the captioner {args.width}")
    if args.width % args.heads:
        flag_error("--heads", f"{args.heads} heads do not divide the width {args.width} (--width)")


def new_model(args, ckpt_info, vocab, ctx, clip):
    """The pair encoder `clip` (train() loads it from --ckpt before the data: a bad --n-inter says so at once) and
    a fresh captioner over its 2(m+1) pooled tokens, in one module."""
    if ckpt_info.get("stage") != "adapt":
        log(f"{args.ckpt} is not an adapted encoder: the no-adaptation ablation (paper Table 5), its pair "
            f"parameters e1, e2, p, ln_mid as the file has them or freshly initialized")
    m = (clip.cfg.image_resolution // clip.cfg.vision_patch_size // resolve_mem_pool(args, clip)) ** 2
    flags = ("width", "heads", "enc_layers", "dec_layers", "dropout", "post_ln", "mem_proj", "mem_image", "mem_diff",
             "mem_pool")  # the flags of the same names
    cfg = CaptionerConfig(vocab_size=len(vocab), memory_dim=clip.cfg.embed_dim, memory_len=2 * (m + 1), max_len=MAX_LEN,
                          clip_words=args.vocab == "clip", **{k: getattr(args, k) for k in flags})
    return PairCaptioner(clip, Captioner(cfg, clip)).to(ctx.device)


def describe(ctx, model, rule, optimizer, args):
    """What trains at which rate (the rule, as a table) and the model in one line."""
    clip, cfg = model.clip.cfg, model.captioner.cfg
    log("what trains:\n" + policy_table(model.named_parameters(), rule))
    n_train = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    log(f"model: pair encoder {clip.vision_layers - clip.n_inter} + {clip.n_inter} "
        f"({'frozen' if args.freeze_encoder else f'lr {args.encoder_lr:g}'}), memory {cfg.memory_len} tokens x "
        f"{cfg.memory_dim} | captioner {cfg.enc_layers}+{cfg.dec_layers} {'post' if cfg.post_ln else 'pre'}-LN layers, "
        f"{cfg.width} wide, {'the CLIP word embeddings' if cfg.clip_words else 'its own words'} | "
        f"{n_train / 1e6:.2f}M trainable parameters")


def loader_for(dataset, args, ctx, shuffle=False, batch=None):
    """Batches of `dataset` in order, or (for training) shuffled by (seed, epoch) (data.EpochSampler: call
    data.set_epoch(loader, e) before each epoch). Image-loading processes only when there are images to load."""
    workers = 0 if dataset.features is not None else args.workers
    return data.make_loader(dataset, batch or args.eval_batch_size, shuffle, workers, ctx.device,
                            drop_last=shuffle and len(dataset) > (batch or 1), seed=args.seed)


def loaders(model, splits, caption_ids, args, ctx):
    """Training (a caption drawn per pair and epoch; --pair-distractors: DistractorBatches), val and test loaders,
    the images decoded once (the image cache); a frozen encoder runs once per pair, here, the loaders give its
    tokens."""
    size = model.clip.cfg.image_resolution
    cache = data.open_image_cache([it for v in splits.values() for it in v], size, args.image_cache)
    feats = {}
    if args.freeze_encoder:
        t0 = time.time()
        for s, items in splits.items():
            n = len(items) // 2 if s == "train" and args.reverse else len(items)  # then the same pairs reversed
            assert all(b.id == a.id + "_r" for a, b in zip(items[:n], items[n:])), "reversed pairs out of order"
            loader = loader_for(data.ImageDataset(items[:n], size, cache), args, ctx)
            feats[s] = encode_all(model, loader, ctx, both_ways=n < len(items))
        log(f"encoded {sum(map(len, feats.values()))} pairs once (frozen encoder) in {time.time() - t0:.0f}s")
    train_set = data.CaptionDataset(splits["train"], size, cache=cache, seed=args.seed, ids=caption_ids, draw=True,
                                    features=feats.get("train"))
    pairs = data.distractor_partners(splits["train"]) if args.pair_distractors else []  # none: Spot-the-Diff's
    workers = 0 if train_set.features is not None else args.workers
    return (data.make_loader(train_set, args.batch_size, True, workers, ctx.device, seed=args.seed, pairs=pairs) if
            pairs else loader_for(train_set, args, ctx, shuffle=True, batch=args.batch_size),
            *(loader_for(data.ImageDataset(splits[s], size, cache, feats.get(s)), args, ctx) for s in ("val", "test")))


def validate(model, loader, items, vocab, scenes, ctx):
    """Val CIDEr-D, which selects the model; with scene records also what the captions get right."""
    preds = predict(model, loader, items, vocab, ctx)
    val = {"CIDEr-D": cider(items, preds)}
    if scenes:
        judged = synth.report(preds, scenes)
        val.update({k: judged[k + " %"] for k in ("right type", "right object")})
    return val


def checkpoint(model, vocab, source, args, figures):
    """What `--ckpt captioner.pt` needs to rebuild the captioner (build), plus what produced it."""
    return {"model": model.clip.state_dict(), "captioner": model.captioner.state_dict(),
            "config": asdict(model.clip.cfg), "captioner_config": asdict(model.captioner.cfg), "vocab": vocab,
            "data": source, "args": vars(args), "metrics": figures, "stage": "caption", "format": FORMAT}


def resume_from(state, model, optimizer, scheduler, args):
    """Where the run stands (epochs done, steps done, best val CIDEr-D, its epoch, epochs without gain, history),
    and the epoch to stop at; with --resume from --out's resumable file (model, optimizer, schedule, RNG put back).
    A run that had stopped early stays stopped."""
    run = dict(epoch=0, step=0, best=-1.0, best_epoch=-1, epochs_without_gain=0, history=[])
    if state is None:
        return run, args.epochs
    restore(state, model, optimizer, scheduler)
    run = {k: state[k] for k in run}
    log(f"resumed from {last_path(args.out)} at epoch {run['epoch'] + 1} (best val CIDEr-D {run['best']:.1f})")
    if run["epochs_without_gain"] < args.patience or run["epoch"] >= args.epochs:
        return run, args.epochs
    log(f"the run had stopped early after epoch {run['epoch']} (no val CIDEr-D gain for "
        f"{run['epochs_without_gain']} epochs): no more training, the test of epoch {run['best_epoch']}'s model")
    return run, run["epoch"]


def test_best(model, loader, splits, vocab, source, history, args, ctx):
    """The model chosen on val, from --out, tested once; the test figures are added to --out."""
    chosen = torch.load(args.out, map_location=ctx.device, weights_only=True)
    model.clip.load_state_dict(chosen["model"])
    model.captioner.load_state_dict(chosen["captioner"])
    results = final_test(model, loader, splits["train"], splits["test"], vocab, args, ctx, source["name"],
                         source["root"])
    figures = {**chosen["metrics"], "test": results["scores"], "test_by_type": results["scores_by_type"],
               "baseline": results["baseline"], "history": history}
    save_atomic(checkpoint(model, vocab, source, args, figures), args.out)
    return results


def train(args, ckpt_info):
    """Train a captioner on the pair encoder of --ckpt, select it on val CIDEr-D, test it once."""
    ctx = setup(args.seed, args.device, "off" if args.authors_numerics else args.amp)  # their fp16: no autocast
    preset = apply_preset(args, ckpt_info)
    resume = load_resume(args.out, "cpu") if args.resume else None
    clip = clip_load.load_clip(args.ckpt, ctx.device, args.n_inter)
    if args.authors_numerics:
        authors_fp16_(clip)
    resolve_sizes(args, clip)  # a bad --mem-pool, --width or --heads stops here, before any data is made
    log(f"caption.py: preset {preset} on {where(ctx)} | " + " ".join(f"{k}={v}" for k, v in vars(args).items()))
    name, root, splits, vocab, caption_ids = load_data(args, ckpt_info, resume, ctx)
    args.data = name  # lr_rule reads it
    scenes = synth.read_scenes(root) if name == "clevr" else None  # the synthetic set's record of each change

    model = new_model(args, ckpt_info, vocab, ctx, clip)
    source = {"name": name, "root": str(root), "image_size": model.clip.cfg.image_resolution}  # saved with it
    rule = lr_rule(args)
    freeze(model.named_parameters(), rule)
    theirs = args.optimizer == "bertadam"
    decays = authors_decays(model, bert="captioner") if theirs else None
    groups = param_groups(model.named_parameters(), rule, args.weight_decay, decays)
    optimizer = make_optimizer(groups, ctx.device, rule=args.optimizer, betas=(0.9, 0.999 if theirs else 0.98))
    describe(ctx, model, rule, optimizer, args)
    train_loader, val_loader, test_loader = loaders(model, splits, caption_ids, args, ctx)
    paired = isinstance(train_loader.batch_sampler, data.DistractorBatches)
    total_steps = args.epochs * len(train_loader)
    scheduler = (authors_schedule(optimizer, total_steps, args.warmup, "linear") if theirs else
                 warmup_cosine(optimizer, total_steps, args.warmup))
    run, stop = resume_from(resume, model, optimizer, scheduler, args)

    loss_fn = lambda batch: batch_loss(model, batch, ctx.device, args.freeze_encoder, paired)

    # training, each step loss_fn then train_utils.update (backward, clip, step): select on val CIDEr-D, stop
    # after --patience epochs without gain (the paper preset: a tie is a gain, the later epoch kept)
    t_start = time.time()
    try:
        for epoch in range(run["epoch"], stop):
            data.set_epoch(train_loader, epoch)
            t0 = time.time()
            progress = Progress(epoch, args.epochs, run["step"], total_steps, args.log_every)
            loss = train_epoch(ctx, model, train_loader, loss_fn, optimizer, scheduler, progress, args.grad_clip)
            val = validate(model, val_loader, splits["val"], vocab, scenes, ctx)
            run["history"].append({"epoch": epoch + 1, "loss": loss, **{f"val {k}": v for k, v in val.items()}})
            run.update(epoch=epoch + 1, step=progress.step, epochs_without_gain=run["epochs_without_gain"] + 1)
            if improved(val["CIDEr-D"], run["best"], args.tie_is_gain):
                run.update(best=val["CIDEr-D"], best_epoch=epoch + 1, epochs_without_gain=0)
                save_atomic(checkpoint(model, vocab, source, args, {"val": val, "epoch": epoch + 1}), args.out)
            right = "".join(f", {k} {val[k]:.0f}%" for k in ("right type", "right object") if k in val)
            log(f"epoch {epoch + 1}/{args.epochs} | loss {loss:.3f} | val {summary(val)}{right} | best CIDEr-D "
                f"{run['best']:.1f} (epoch {run['best_epoch']}) | {time.time() - t0:.0f}s")
            plots.curves(os.path.splitext(args.out)[0] + ".curves.png", run["history"], "val CIDEr-D")
            save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "vocab": vocab,
                         "scheduler": scheduler.state_dict(), "rng": rng_state(), **run}, last_path(args.out))
            if run["epochs_without_gain"] >= args.patience:
                log(f"early stop: no val CIDEr-D gain for {run['epochs_without_gain']} epochs")
                break
    except KeyboardInterrupt:
        interrupted(args.out)
    log(f"training done in {fmt_time(time.time() - t_start)} ({where(ctx)}): best val CIDEr-D {run['best']:.1f} at "
        f"epoch {run['best_epoch']}")
    return test_best(model, test_loader, splits, vocab, source, run["history"], args, ctx)


def main(argv=None):
    args = get_args(argv)
    ckpt_info = read_ckpt_info(args.ckpt)
    whose = "the authors' CLIP4IDC" if ckpt_info.get("authors") else "caption.py's"
    found = (f"{whose} captioner: evaluated, never trained" if ckpt_info.get("stage") == "caption" else
             "an encoder, no captioner in it: a captioner is trained on it")
    print(f"--ckpt {args.ckpt}: {found}", file=sys.stderr if args.before else sys.stdout, flush=True)  # --before:
    # stdout holds the caption alone
    if args.before:
        return caption_images(args, ckpt_info)
    return evaluate_captioner(args, ckpt_info) if ckpt_info.get("stage") == "caption" else train(args, ckpt_info)


if __name__ == "__main__":
    try:
        main()
    except data.BadImage as e:  # an undecodable image met while training: its name and what to do, no traceback
        raise SystemExit(data.exit_message(e)) from None
