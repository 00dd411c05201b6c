"""Every picture of clip4idc, drawn with PIL and numpy: the gallery of test pairs with their captions, where the
pair encoder looked (attention heat maps), and training curves.

    python caption.py --ckpt captioner.pt --gallery gallery.png           # test pairs, captions, heat maps
    python caption.py --ckpt captioner.pt --before a.png --after b.png --explain why.png

The stages write their training curves (`<checkpoint>.curves.png`) after every epoch. Nothing here imports the
rest of clip4idc: callers hand in images, numbers and text.
"""
import textwrap

import numpy as np
from PIL import Image, ImageDraw

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
    """The last inter block's attention (heads, 2(n+1), 2(n+1)) over [CLS_before, before's n patches, CLS_after,
    after's n patches] -> {"before": (grid, grid), "after": (grid, grid)}. The map on an image is where the two
    [CLS] tokens, which become the pair vector (eq. 5) and lead the captioner's memory, look among that image's
    patches: their attention to those patches, averaged over heads and over the two [CLS] tokens (each looks at
    its own image and at the other), normalized to sum to 1 over the image."""
    w = np.asarray(weights, dtype=np.float64).mean(0)  # (T, T), averaged over heads
    n = grid * grid
    cls = w[[0, n + 1]]  # the two [CLS] rows
    maps = {"before": cls[:, 1:n + 1].mean(0), "after": cls[:, n + 2:].mean(0)}
    return {k: (m / max(m.sum(), 1e-12)).reshape(grid, grid) for k, m in maps.items()}


def overlay(image, heat, alpha=0.55):
    """A PIL image with a (grid, grid) map blended over it: the map scaled to its own maximum, upsampled to the
    image (bilinear), coloured along RAMP."""
    h = np.asarray(heat, dtype=np.float64)
    h = h / max(h.max(), 1e-12)
    up = Image.fromarray((h * 255).astype(np.uint8), "L").resize(image.size, Image.BILINEAR)
    colour = Image.fromarray(colormap(np.asarray(up) / 255.0))
    return Image.blend(image.convert("RGB"), colour, alpha)


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
    draw = ImageDraw.Draw(sheet)
    draw.multiline_text((4, 4), "\n".join(lines), fill="black", spacing=4)
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
        ImageDraw.Draw(row).multiline_text((x + 6, 6), text, fill="black", spacing=3)
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
    """Two panels side by side, loss and `metric` against the epoch, from the stages' history
    ([{"epoch": 1, "loss": ..., metric: ...}, ...]): axes, labels, each point's value, the best epoch marked."""
    w, h = size
    sheet = Image.new("RGB", (2 * w, h), "white")
    draw = ImageDraw.Draw(sheet)
    epochs = [e["epoch"] for e in history]
    for panel, (name, best_is) in enumerate((("loss", min), (metric, max))):
        values = [e.get(name) for e in history]
        pts = [(x, v) for x, v in zip(epochs, values) if v is not None]
        left, top, right, bottom = panel * w + 60, 28, panel * w + w - 20, h - 36
        draw.text((panel * w + 60, 6), f"{name} by epoch", fill="black")
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
            draw.text((panel * w + 4, y - 6), f"{v:.3g}", fill="black")
        for x in sorted({first, last, *epochs[::max(1, len(epochs) // 6)]}):  # x ticks
            draw.text((at(x, lo)[0] - 4, bottom + 4), str(x), fill="black")
        draw.text(((left + right) / 2 - 14, h - 16), "epoch", fill="black")
        xy = [at(x, v) for x, v in pts]
        if len(xy) > 1:
            draw.line(xy, fill=(31, 119, 180), width=2)
        best = best_is(pts, key=lambda p: p[1])
        for (x, v), p in zip(pts, xy):
            mark = (214, 39, 40) if (x, v) == best else (31, 119, 180)
            draw.ellipse([p[0] - 3, p[1] - 3, p[0] + 3, p[1] + 3], fill=mark)
            if len(pts) <= 12 or (x, v) == best:
                draw.text((p[0] + 4, p[1] - 14), f"{v:.3g}", fill=mark)
    sheet.save(path)
    return sheet
