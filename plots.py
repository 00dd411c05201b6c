"""Every picture, drawn with PIL and numpy: test pairs with their captions, where the pair encoder looked (attention
maps), training curves (`<checkpoint>.curves.png`, after every epoch).

    python evaluate.py --ckpt captioner.pt --gallery gallery.png          # test pairs, captions, heat maps
    python evaluate.py --ckpt captioner.pt --before a.png --after b.png --explain why.png
"""
import math
import textwrap

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

import clip_load
import synth

# -----------------------------------------------------------------------------
# heat maps

# a perceptually ordered dark-to-bright ramp (black, purple, red, orange, yellow, white), interpolated linearly
RAMP = np.array([[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164], [255, 255, 255]], float)


def colormap(x):
    """Values in [0, 1], any shape -> RGB uint8, shape + (3,), along RAMP."""
    t = np.clip(x, 0, 1) * (len(RAMP) - 1)
    lo = np.minimum(t.astype(int), len(RAMP) - 2)
    f = (t - lo)[..., None]
    return ((1 - f) * RAMP[lo] + f * RAMP[lo + 1]).round().astype(np.uint8)


def pair_maps(weights, grid):
    """The last inter block's attention (heads, 2(n+1), 2(n+1)) -> {"before": (grid, grid), "after": (grid,
    grid)}: where the two [CLS] tokens (the pair vector's, eq. 5) look among each image's patches, averaged over
    heads and both [CLS], summing to 1 over the image."""
    w = np.asarray(weights, dtype=np.float64).mean(0)  # (T, T), averaged over heads
    n = grid * grid
    cls = w[[0, n + 1]]  # the two [CLS] rows
    maps = {"before": cls[:, 1:n + 1].mean(0), "after": cls[:, n + 2:].mean(0)}
    return {k: (m / max(m.sum(), 1e-12)).reshape(grid, grid) for k, m in maps.items()}


def overlay(image, heat, alpha=0.55):
    """A PIL image with a (grid, grid) map blended over it, scaled to its maximum, coloured along RAMP."""
    h = np.asarray(heat, dtype=np.float64)
    up = Image.fromarray((h / max(h.max(), 1e-12) * 255).astype(np.uint8), "L").resize(image.size, Image.BILINEAR)
    return Image.blend(image.convert("RGB"), Image.fromarray(colormap(np.asarray(up) / 255.0)), alpha)


try:  # Pillow 10.1+'s default font at its size 10 drops spaces; its bitmap font has no letter beyond Latin-1
    FONT = ImageFont.load_default(11)
except TypeError:  # an older Pillow's: the bitmap font, takes no size
    FONT = ImageFont.load_default()


def _fit(image, height):
    return image.convert("RGB").resize((max(1, round(image.width * height / image.height)), height), Image.BICUBIC)


def _text_block(lines, chars=70):
    return [w for line in lines for w in (textwrap.wrap(line, chars) or [""])]


def explain(path, before, after, caption, maps, height=192):
    """One PNG: the caption, the two images, and the same images under their heat maps (pair_maps)."""
    ims = [_fit(before, height), _fit(after, height)]
    heats = [overlay(im, maps[k]) for im, k in zip(ims, ("before", "after"))]
    w = ims[0].width + ims[1].width + 12
    lines = _text_block([f"caption: {caption}", "below: where the [CLS] tokens of the last inter block look "
                         "(attention, mean over heads; bright = more)"], max(40, w // 7))
    top = 14 * len(lines) + 10
    sheet = Image.new("RGB", (w, top + 2 * height + 12), "white")
    ImageDraw.Draw(sheet).multiline_text((4, 4), "\n".join(lines), fill="black", font=FONT, spacing=4)
    for row, pics in enumerate((ims, heats)):
        x = 4
        for im in pics:
            sheet.paste(im, (x, top + row * (height + 4)))
            x += im.width + 4
    sheet.save(path)
    return sheet


def gallery(path, rows, height=128, text_w=440):
    """Contact sheet, one pair per row: before | after [| before, after under their heat maps] | text lines.
    rows: [{"before": PIL, "after": PIL, "lines": [str], "maps": pair_maps or None}]."""
    out = []
    for r in rows:
        ims = [_fit(r["before"], height), _fit(r["after"], height)]
        if r.get("maps"):
            ims += [overlay(im, r["maps"][k]) for im, k in zip(ims[:2], ("before", "after"))]
        row = Image.new("RGB", (sum(im.width + 4 for im in ims) + text_w, height + 8), "white")
        x = 0
        for im in ims:
            row.paste(im, (x, 4))
            x += im.width + 4
        text = "\n".join(_text_block(r["lines"], text_w // 7))
        ImageDraw.Draw(row).multiline_text((x + 6, 6), text, fill="black", font=FONT, spacing=3)
        out.append(row)
    sheet = Image.new("RGB", (max(r.width for r in out), sum(r.height for r in out)), "white")
    y = 0
    for r in out:
        sheet.paste(r, (0, y))
        y += r.height
    sheet.save(path)
    return sheet


# -----------------------------------------------------------------------------
# training curves


def curves(path, history, metric, size=(640, 240)):
    """Loss and `metric` against the epoch, from the stages' history, the best epoch marked."""
    w, h = size
    sheet = Image.new("RGB", (2 * w, h), "white")
    draw = ImageDraw.Draw(sheet)
    epochs = [e["epoch"] for e in history]
    for panel, (name, best_is) in enumerate((("loss", min), (metric, max))):
        pts = [(e["epoch"], e[name]) for e in history if e.get(name) is not None]
        left, top, right, bottom = panel * w + 60, 28, panel * w + w - 20, h - 36
        draw.text((panel * w + 60, 6), f"{name} by epoch", fill="black", font=FONT)
        draw.line([(left, top), (left, bottom), (right, bottom)], fill="black")
        if not pts:
            continue
        lo, hi = min(v for _, v in pts), max(v for _, v in pts)
        lo, hi = (lo - 1, hi + 1) if hi == lo else (lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
        first, last = epochs[0], max(epochs[-1], epochs[0] + 1)
        at = lambda x, v: (left + (right - left) * (x - first) / (last - first),
                           bottom - (bottom - top) * (v - lo) / (hi - lo))
        for v in (lo, (lo + hi) / 2, hi):  # y ticks
            y = at(first, v)[1]
            draw.line([(left - 4, y), (left, y)], fill="black")
            draw.text((panel * w + 4, y - 6), f"{v:.3g}", fill="black", font=FONT)
        for x in sorted({first, last, *epochs[::max(1, len(epochs) // 6)]}):  # x ticks
            draw.text((at(x, lo)[0] - 4, bottom + 4), str(x), fill="black", font=FONT)
        draw.text(((left + right) / 2 - 14, h - 16), "epoch", fill="black", font=FONT)
        xy = [at(x, v) for x, v in pts]
        if len(xy) > 1:
            draw.line(xy, fill=(31, 119, 180), width=2)
        best = best_is(pts, key=lambda p: p[1])
        for (x, v), p in zip(pts, xy):
            mark = (214, 39, 40) if (x, v) == best else (31, 119, 180)
            draw.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=mark)
            if len(pts) <= 12 or (x, v) == best:
                draw.text((p[0] + 4, p[1] - 14), f"{v:.3g}", fill=mark, font=FONT)
    sheet.save(path)
    return sheet


# -----------------------------------------------------------------------------
# where the encoder looks: the last inter block's attention (pair_maps says which map is which)


def attention_weights(attn, x):
    """softmax(Q K^T / sqrt(head size)) of `attn` (a model.MultiheadAttention) on x (B, T, width):
    (B, heads, T, T)."""
    B, T, C = x.shape
    q, k, _ = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).split(C, dim=2)
    q, k = (t.view(B, T, attn.heads, C // attn.heads).transpose(1, 2) for t in (q, k))
    return ((q @ k.transpose(-2, -1)) / math.sqrt(C // attn.heads)).float().softmax(dim=-1)


def inter_attention(visual, before, after):
    """The last inter block's attention weights on these pairs (B, heads, 2(n+1), 2(n+1))."""
    assert visual.n_inter > 0, "the attention maps are the inter blocks': an N + 0 encoder has none"
    weights = []
    keep = lambda attn, inputs: weights.append(attention_weights(attn, inputs[0]))  # inputs[0]: ln_1(x)
    hook = visual.transformer.resblocks[-1].attn.register_forward_pre_hook(keep)
    try:
        visual.forward_pair(before, after)
    finally:
        hook.remove()
    return weights[0]


@torch.no_grad()
def encoder_maps(model, pairs, size, device, batch=64):
    """[(before path, after path)] -> their pair_maps, `batch` pairs at a time."""
    grid = size // model.clip.cfg.vision_patch_size
    out = []
    for i in range(0, len(pairs), batch):
        b, a = (torch.stack([clip_load.load_image(p, size) for p in paths]).to(device)
                for paths in zip(*pairs[i:i + batch]))
        out += [pair_maps(w, grid) for w in inter_attention(model.clip.visual, b, a).float().cpu()]
    return out


def maps_on_change(maps, items, root):
    """% of change pairs whose map's strongest patch overlaps the changed object, and a random patch's %."""
    hits, chance = [], []
    for m, it in zip(maps, items):
        region = synth.changed_region(root, it.id)
        side = "after" if region["before"] is None else "before"
        (x0, y0, x1, y1), g = region[side], m[side].shape[0]
        on = lambda r, c: c / g < x1 and (c + 1) / g > x0 and r / g < y1 and (r + 1) / g > y0
        hits.append(on(*divmod(int(m[side].argmax()), g)))
        chance.append(sum(on(r, c) for r in range(g) for c in range(g)) / g ** 2)
    return 100 * sum(hits) / len(hits), 100 * sum(chance) / len(chance)


def rgb(path):
    """An image file as an RGB array, as the pictures show it."""
    return clip_load.to_rgb(clip_load.open_image(path))


def draw_gallery(path, items, preds, model=None, size=None, device="cpu", n=8):
    """Test pairs, one per row: before | after | (their heat maps) | the generated and a reference caption."""
    picks = items[:: max(1, len(items) // n)][:n]
    maps = (encoder_maps(model, [(it.before, it.after) for it in picks], size, device)
            if model is not None and model.clip.cfg.n_inter > 0 else [None] * len(picks))
    rows = [{"before": rgb(it.before), "after": rgb(it.after), "maps": m,
             "lines": [f"[{it.change_type or it.id}]", f"generated: {preds[it.id]}", f"reference: {it.captions[0]}"]}
            for it, m in zip(picks, maps)]
    gallery(path, rows)
    print(f"gallery of {len(rows)} test pairs -> {path}")


def attention_line(figures):
    return (f"attention: the strongest patch of the last inter block's [CLS] map falls on the changed object in "
            f"{figures['map on the change %']:.0f}% of change pairs (a random patch: {figures['random patch %']:.0f}%)")


def attention_on_change(model, items, root, device):
    """On the synthetic set: how often the last inter block's map peaks on the changed object, and a
    random patch's figure (maps_on_change)."""
    changes = [it for it in items if it.change_type != "distractor"]
    maps = encoder_maps(model, [(it.before, it.after) for it in changes], model.clip.cfg.image_resolution, device)
    return dict(zip(("map on the change %", "random patch %"), maps_on_change(maps, changes, root)))
