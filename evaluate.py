"""Evaluate a captioner (caption.py's, or the authors' released one), or caption two images.

    python evaluate.py --ckpt captioner.pt                        # test scores, baseline, predictions
    python evaluate.py --ckpt captioner.pt --gallery gallery.png  # and test pairs drawn with their captions
    python evaluate.py --ckpt pytorch_model.bin.clevr --amp off   # the authors' released captioner
    python evaluate.py --ckpt captioner.pt --before a.png --after b.png --explain why.png   # your own two images
"""
import argparse
import os
import sys

import caption
import clip_load
import data
import plots
from model import N_INTER
from train_utils import HelpFormatter, at_least, device_flags, given_flags, setup

PAIR_ONLY = {"explain"}  # with --before/--after
TEST_ONLY = {"data", "data_root", "skip_missing", "results", "gallery", "workers", "eval_batch_size"}


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--ckpt", default="captioner.pt", help="a captioner: caption.py's, or the authors'")
    caption.test_flags(p)
    p.add_argument("--n-inter", type=at_least(0), default=None, help="the authors' released captioner: the inter "
                   "blocks it was trained with (default: their 3, of 9 + 3); ours record their own")
    p.add_argument("--beam", type=at_least(1), default=1, help="beam size (1: greedy, as the paper)")
    p.add_argument("--gallery", default=None, help="also draw test pairs with their captions into this PNG")
    device_flags(p)
    p.add_argument("--before", default=None, help="caption this image pair instead of the test split")
    p.add_argument("--after", default=None, help="the 'after' image of --before")
    p.add_argument("--explain", default=None, help="with --before: also draw the caption, the images and where the "
                   "encoder looked into this PNG")
    return p


def get_args(argv=None):
    """-> the flags, and --ckpt's entries but its weights (caption.read_ckpt_info)."""
    p = parser()
    args, given = p.parse_args(argv), given_flags(p, argv)
    if bool(args.before) != bool(args.after):
        p.error("--before and --after go together")
    for flag in sorted(given & (TEST_ONLY if args.before else PAIR_ONLY)):
        p.error(f"argument --{flag.replace('_', '-')}: not used when "
                + ("captioning two images (--before/--after)" if args.before else "scoring the test split: give "
                   "--before and --after"))
    if not os.path.isfile(args.ckpt):
        p.error(f"argument --ckpt: no file at {args.ckpt}: train one with `python caption.py` first")
    info = caption.read_ckpt_info(args.ckpt)
    if args.n_inter is not None and info.get("stage") == "caption" and not info.get("authors"):
        p.error(f"argument --n-inter: {args.ckpt} records the split it was trained with: leave it out")
    for flag, path in (("--before", args.before), ("--after", args.after)):
        if path and not os.path.isfile(path):
            p.error(f"argument {flag}: no image at {path}")
    return args, info


def caption_images(args):
    """The caption of --before/--after, alone on stdout; --explain: the images and the encoder's maps too."""
    ctx = setup(0, args.device, args.amp)
    model = caption.load_captioner(args.ckpt, ctx.device, args.n_inter)
    size = model.clip.cfg.image_resolution
    before, after = (clip_load.load_image(p, size)[None].to(ctx.device) for p in (args.before, args.after))
    with ctx.amp:
        text = caption.to_text(model.caption(args.beam, before=before, after=after)[0].tolist())
    print(text)
    if args.explain:
        if model.clip.cfg.n_inter == 0:
            raise SystemExit(f"--explain draws the last inter block's attention: this encoder "
                             f"({model.clip.cfg.vision_layers} + 0) has none")
        maps = plots.encoder_maps(model, [(args.before, args.after)], size, ctx.device)[0]
        plots.explain(args.explain, plots.rgb(args.before), plots.rgb(args.after), text, maps)
        print(f"caption, images and attention maps -> {args.explain}")
    return text


def evaluate_captioner(args, info):
    """caption.final_test (and --gallery)."""
    ctx = setup(0, args.device, args.amp)
    name, root = caption.data_source(args.data, args.data_root, info)
    model = caption.load_captioner(args.ckpt, ctx.device, args.n_inter)
    train_items = data.load_items(name, root, "train", "total", args.skip_missing, images=False)  # the baseline's
    test_items = data.load_items(name, root, "test", "total", args.skip_missing)
    size = model.clip.cfg.image_resolution
    loader = data.make_loader(data.ImageDataset(test_items, size), args.eval_batch_size, workers=args.workers,
                              device=ctx.device)
    if info.get("args", {}).get("freeze_encoder"):  # caption.py's test: the frozen encoder's fp16 tokens
        tokens = caption.encode_all(model, loader, ctx)
        loader = data.make_loader(data.ImageDataset(test_items, size, features=tokens), args.eval_batch_size)
    results = caption.final_test(model, loader, train_items, test_items, ctx, name, root, args.results, args.beam)
    if args.gallery:
        preds = {p["id"]: p["caption"] for p in results["predictions"]}
        plots.draw_gallery(args.gallery, test_items, preds, model, size, ctx.device)
    return results


def main(argv=None):
    args, info = get_args(argv)
    if info.get("stage") != "caption":
        raise SystemExit(f"--ckpt {args.ckpt} is not a captioner but an encoder: train a captioner on it with "
                         f"`python caption.py --ckpt {args.ckpt}`")
    split = N_INTER if args.n_inter is None else args.n_inter
    how = "their default, 9 + 3 on ViT-B/32; another: --n-inter" if args.n_inter is None else "--n-inter"
    whose = (f"the authors' CLIP4IDC captioner, its last {split} vision blocks read as inter blocks ({how})"
             if info.get("authors") else "caption.py's captioner")
    print(f"--ckpt {args.ckpt}: {whose}", file=sys.stderr if args.before else sys.stdout, flush=True)
    return caption_images(args) if args.before else evaluate_captioner(args, info)


if __name__ == "__main__":
    data.run(main)
