"""The built-in synthetic CLEVR-Change-style set: scenes, a small ray caster, captions, and a parser of them.

    python synth.py make --out data/clevr_synth --pairs 3000   # render a set in CLEVR-Change's layout

Without CLEVR-Change on disk, `data.resolve_root("clevr")` renders this set once: a few CLEVR objects on a floor,
ray-cast with numpy; one object changes (colour, material, position, added, dropped) in the "semantic" image, the
"non-semantic" distractor moves the camera. `scenes.json` records the objects; `judge` reads a generated caption back
against them, `probe` a pair encoder's vectors. Nothing here imports the rest of clip4idc.
"""
import argparse
import json
import os
import random
import re
import time
from functools import partial
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

SYNTH_ROOT = "data/clevr_synth"
IMAGE_SIZE = (180, 120)  # W, H on disk: the small model squashes it to 96 x 96
VERSION = 2  # in synth.json: bump when the same arguments would render a different set (2: scenes.json)

# -----------------------------------------------------------------------------
# scenes: CLEVR's objects on a floor, a pinhole camera, a key light

SHAPES = ("cube", "sphere", "cylinder")
COLORS = {"gray": (87, 87, 87), "red": (173, 35, 35), "blue": (42, 75, 215), "green": (29, 105, 20),
          "brown": (129, 74, 25), "purple": (129, 38, 192), "cyan": (41, 208, 208), "yellow": (255, 238, 51)}  # CLEVR's
MATERIALS = ("rubber", "metal")
CHANGES = ("color", "material", "move", "add", "drop")
ATTRS = ("size", "color", "material", "shape")

# objects larger than CLEVR's (a 96-px input shows them), one key light, CLEVR's colours at full strength
WORLD = {"sizes": {"small": 0.6, "large": 0.95}, "cube": 0.8, "cylinder": (0.8, 1.6),
         "bound": {"cube": 1.39, "sphere": 1.0, "cylinder": 1.13},  # bounding sphere radius / r
         "extent": 2.7,  # objects stand in [-extent, extent]^2 on the ground plane z = 0
         "camera": (-10.5, 7.0, 0.5), "zoom": 2.25, "floor": (0.62, 0.25, 0.95, 0.5, 0.45)}
SIZES = WORLD["sizes"]  # radius by size


def camera(j):
    """Pinhole camera above and in front of the scene, looking along +y; j: 6 jitters in about [-1, 1]
    (position, look-at, zoom), 0 the base view."""
    back, up, ahead = WORLD["camera"]
    pos = np.array([0.8 * j[0], back + 0.8 * j[1], up + 0.6 * j[2]])
    at, zoom = np.array([0.4 * j[3], ahead + 0.4 * j[4], 0.0]), WORLD["zoom"] * (1 + 0.07 * j[5])
    fwd = (at - pos) / np.linalg.norm(at - pos)
    right = np.cross(fwd, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    return {"pos": pos, "fwd": fwd, "right": right, "up": np.cross(right, fwd), "zoom": zoom}


def _towards(az, el):
    az, el = np.radians(az), np.radians(el)
    return np.array([np.cos(az) * np.cos(el), np.sin(az) * np.cos(el), np.sin(el)])


def light(j):
    """The key light, front left: {"dir" (it casts the shadows), "power"}; j: 3 jitters (azimuth, elevation,
    power)."""
    return {"dir": _towards(-125 + 35 * j[0], 50 + 12 * j[1]), "power": 1 + 0.2 * j[2]}


def project(cam, p, w, h):
    d = np.asarray(p) - cam["pos"]
    z, f = d @ cam["fwd"], cam["zoom"] * w / 2
    return w / 2 + f * (d @ cam["right"]) / z, h / 2 - f * (d @ cam["up"]) / z, f / z  # u, v, pixels per unit


def dims(o):
    """(radius, a cube's half side, a cylinder's radius and height) of an object."""
    r = SIZES[o["size"]]
    return r, WORLD["cube"] * r, WORLD["cylinder"][0] * r, WORLD["cylinder"][1] * r


def geometry(o):
    """(centre of the bounding sphere, its radius) for an object dict."""
    r, s, _, hgt = dims(o)
    hz = {"cube": s, "sphere": r, "cylinder": hgt / 2}[o["shape"]]
    return np.array([o["x"], o["y"], hz]), r * WORLD["bound"][o["shape"]]


def visibility(objs, cam, w=60, h=40):
    """Fraction of each object's disc not hidden by nearer ones (CLEVR rejects mostly hidden objects)."""
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    owner, area = np.full((h, w), -1), []
    depth = [(np.asarray(geometry(o)[0]) - cam["pos"]) @ cam["fwd"] for o in objs]
    for k in np.argsort(depth)[::-1]:  # far to near: nearer discs overwrite
        c, r = geometry(objs[k])
        u, v, s = project(cam, c, w, h)
        disc = (xs - u) ** 2 + (ys - v) ** 2 < (0.9 * r * s) ** 2
        owner[disc] = k
        area.append((k, disc.sum()))
    return {k: (owner == k).sum() / max(a, 1) for k, a in area}


# -----------------------------------------------------------------------------
# a small ray caster: spheres, rotated cubes and cylinders over a shaded floor


def intersect(o, org, d):
    """Ray-object hits: (t [n], normal [n, 3], edge [n]); t = inf on a miss; edge = 1 on a cube's edges and a
    cylinder's rim, drawn so shapes and materials read at low resolution."""
    (r, s, a, hgt), c = dims(o), np.array([o["x"], o["y"], 0.0])
    t, edge = np.full(len(d), np.inf), np.zeros(len(d))
    n = np.zeros_like(d)
    if o["shape"] == "sphere":
        oc = org - c - [0, 0, r]
        b = d @ oc
        disc = b * b - oc @ oc + r * r
        hit = disc > 0
        t[hit] = -b[hit] - np.sqrt(disc[hit])
        n = (org + t[:, None] * d - c - [0, 0, r]) / r
    elif o["shape"] == "cube":  # slabs in the cube's own frame (rotated about z)
        turn = np.radians(o["rot"])
        rot = np.array([[np.cos(turn), np.sin(turn), 0], [-np.sin(turn), np.cos(turn), 0], [0, 0, 1]])
        lo, ld = rot @ (org - c - [0, 0, s]), d @ rot.T
        ld = np.where(np.abs(ld) < 1e-9, 1e-9, ld)
        t1, t2 = (-s - lo) / ld, (s - lo) / ld
        near, far = np.minimum(t1, t2), np.maximum(t1, t2)
        tn, axis = near.max(1), near.argmax(1)
        hit = (tn < far.min(1)) & (tn > 0)
        t[hit] = tn[hit]
        nl = np.zeros_like(d)
        nl[np.arange(len(d)), axis] = -np.sign(ld[np.arange(len(d)), axis])
        n = nl @ rot
        q = lo + tn[:, None] * ld  # the hit in the cube's frame
        edge = np.clip((np.sort(np.abs(q), axis=1)[:, 1] / s - 0.9) / 0.1, 0, 1)  # 2nd largest coordinate: 1 on an edge
    else:  # vertical cylinder: side, then the top cap
        oc = org[:2] - c[:2]
        qa, qb, qc = (d[:, :2] ** 2).sum(1), 2 * d[:, :2] @ oc, oc @ oc - a * a
        disc = qb * qb - 4 * qa * qc
        ts = (-qb - np.sqrt(np.maximum(disc, 0))) / (2 * qa + 1e-12)
        zs = org[2] + ts * d[:, 2]
        side = (disc > 0) & (zs > 0) & (zs < hgt)
        t[side] = ts[side]
        n[:, :2] = ((org + ts[:, None] * d)[:, :2] - c[:2]) / a
        tt = (hgt - org[2]) / np.minimum(d[:, 2], -1e-9)
        pt = org[:2] + tt[:, None] * d[:, :2]
        top = ~side & (((pt - c[:2]) ** 2).sum(1) < a * a)
        t[top], n[top] = tt[top], [0, 0, 1]
        rim = np.sqrt(((pt - c[:2]) ** 2).sum(1)) / a
        edge[top] = np.clip((rim[top] - 0.92) / 0.08, 0, 1)
    return t, n, edge


def shade(o, p, n, d, lt):
    """Rubber: diffuse under the light with a faint sheen. Metal: a mirror tinted by its colour (sky above the
    horizon, floor below), and the light's highlight."""
    albedo = np.array(COLORS[o["color"]]) / 255
    ndl = np.clip(n @ lt["dir"], 0, 1)[:, None]
    half = lt["dir"] - d
    half /= np.linalg.norm(half, axis=1, keepdims=True)
    ndh = np.clip((n * half).sum(1), 0, 1)[:, None]
    if o["material"] == "rubber":
        return albedo * (0.3 + 0.75 * ndl * lt["power"]) + 0.04 * ndh ** 4
    refl = d - 2 * (d * n).sum(1, keepdims=True) * n
    rz = refl[:, 2:]
    reach = p[:, 2:] / np.maximum(-rz, 1e-3)  # the mirrored ray's run to the floor
    env = np.where(rz > 0, 0.5 + np.clip(1.5 * rz, 0, 0.6), 0.6 * (1 - np.exp(-reach / 0.6)))
    hxy = half[:, :2] / (np.linalg.norm(half[:, :2], axis=1, keepdims=True) + 1e-9)
    streak = np.clip((n[:, :2] * hxy).sum(1), 0, 1)[:, None] ** 30 * (o["shape"] == "cylinder") * (n[:, 2:] < 0.1)
    return albedo * (0.03 + 0.15 * ndl + 0.95 * env) + 0.06 * env + lt["power"] * (1.2 * ndh ** 60 + 0.5 * streak)


def _box(cam, points, w, h, pad=2):
    """Screen rectangle (as slices) around projected world points."""
    u, v, _ = zip(*(project(cam, q, w, h) for q in points))
    y0, y1, x0, x1 = int(min(v)) - pad, int(max(v)) + pad + 1, int(min(u)) - pad, int(max(u)) + pad + 1
    return np.s_[max(y0, 0):min(y1, h), max(x0, 0):min(x1, w)]


def rays(cam, w, h, box=np.s_[:, :]):
    """Unit ray directions (H, W, 3) through the pixel centres inside `box`."""
    f = cam["zoom"] * w / 2
    xs, ys = (np.arange(w, dtype=np.float32) + 0.5 - w / 2) / f, (np.arange(h, dtype=np.float32) + 0.5 - h / 2) / f
    fwd, right, up = (cam[k].astype(np.float32) for k in ("fwd", "right", "up"))
    d = fwd + xs[box[1]][None, :, None] * right - ys[box[0]][:, None, None] * up
    return d / np.sqrt(np.einsum("hwc,hwc->hw", d, d))[..., None]


def floor(objs, cam, lt, w, h):
    """Floor brightness (h, w): a broad light pool, soft shadows, fading far away; computed at half resolution."""
    w2, h2 = (w + 1) // 2, (h + 1) // 2
    d, org = rays(cam, w2, h2), cam["pos"].astype(np.float32)
    t = np.where(d[..., 2] < 0, -org[2] / np.minimum(d[..., 2], -1e-9), np.float32(1e9))  # ray meets z = 0
    p = org[:2] + np.minimum(t, 60)[..., None] * d[..., :2]  # (h2, w2, 2) floor point
    base, pool, power, horizon, shadow = WORLD["floor"]  # brightness, light pool, gain, far grey, shadow depth
    g = base + pool * np.exp(-((p[..., 0] + 2) ** 2 + (p[..., 1] + 1) ** 2) / np.float32(40))
    for o in objs:  # soft shadow: a disc on the floor between the object's foot and its cast point
        c, r = geometry(o)
        tip = c[:2] - c[2] * lt["dir"][:2] / lt["dir"][2]
        mid, reach = (c[:2] + tip) / 2, r + 0.5 * np.linalg.norm(tip - c[:2])
        box = _box(cam, [(mid[0] + a * (reach + r), mid[1] + b * (reach + r), 0) for a in (-1, 1) for b in (-1, 1)],
                   w2, h2)
        g[box] *= 1 - shadow * np.clip((reach - np.sqrt(((p[box] - mid) ** 2).sum(-1))) / (0.5 * r), 0, 1)
    fog = np.exp(-np.maximum(t - 12, 0) / np.float32(10))
    g = g * lt["power"] * power * fog + horizon * (1 - fog)
    return np.asarray(Image.fromarray(g.astype(np.float32), "F").resize((w, h), Image.BILINEAR))


def render(objs, cam, lt, w, h):
    """Ray-cast objects over the floor -> uint8 [h, w, 3]. Only rays near an object are tested against it."""
    img = np.repeat(floor(objs, cam, lt, w, h)[..., None], 3, axis=-1)
    depth, org = np.full((h, w), np.inf, dtype=np.float32), cam["pos"].astype(np.float32)
    for o in objs:  # nothing is below the floor, so only objects compete for depth
        c, rb = geometry(o)
        box = _box(cam, [c + [a * rb, 0, b * rb] for a in (-1.2, 1.2) for b in (-1.2, 1.2)], w, h)
        d = rays(cam, w, h, box).reshape(-1, 3)
        to, no, edge = intersect(o, org, d)
        front = to < depth[box].ravel()
        to, no, edge, d = to[front], no[front], edge[front], d[front]
        m = front.reshape(depth[box].shape)
        depth[box][m] = to  # depth[box] is a view: this writes through
        p = org + to[:, None] * d
        rgb = shade(o, p, no, d, lt)
        img[box][m] = rgb + 0.4 * edge[:, None] if o["material"] == "metal" else rgb * (1 - 0.35 * edge[:, None])
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


# -----------------------------------------------------------------------------
# scene generation: random objects, one change, everything visible


def new_object(rng, objs):
    """A random object on free floor whose (size, color, material, shape) no other has, so its full
    description names it alone; None when the floor is too crowded."""
    taken = {tuple(o[k] for k in ATTRS) for o in objs}
    for _ in range(50):
        o = {"size": rng.choice(list(SIZES)), "color": rng.choice(list(COLORS)), "material": rng.choice(MATERIALS),
             "shape": rng.choice(SHAPES), "x": rng.uniform(-WORLD["extent"], WORLD["extent"]),
             "y": rng.uniform(-WORLD["extent"], WORLD["extent"]), "rot": rng.uniform(0, 90)}
        if tuple(o[k] for k in ATTRS) not in taken and all(_apart(o, p) for p in objs):
            return o
    return None


def _apart(o, p, gap=0.25):
    return np.hypot(o["x"] - p["x"], o["y"] - p["y"]) > 1.15 * (SIZES[o["size"]] + SIZES[p["size"]]) + gap


def _in_frame(o, cam, margin=0.05):
    """The object's bounding circle lies inside the 3:2 frame, away from its border."""
    c, rad = geometry(o)
    u, v, s = project(cam, c, 1.5, 1.0)  # the frame: [0, 1.5] x [0, 1]
    r = rad * s
    return 1.5 * margin < u - r and u + r < 1.5 * (1 - margin) and margin < v - r and v + r < 1 - margin


def make_scene(rng, kind):
    """(before objects, after objects, index of the changed object in before -- in after for "add")."""
    lo, hi = {"add": (3, 6), "drop": (4, 7)}.get(kind, (3, 7))  # 3-7 objects
    cam, extent = camera(np.zeros(6)), WORLD["extent"]
    while True:
        before, n = [], rng.randint(lo, hi)
        while len(before) < n and (o := new_object(rng, before)):
            before.append(o)
        if len(before) < n:
            continue
        after, k = [dict(o) for o in before], rng.randrange(len(before))
        if kind == "add":
            after.append(new_object(rng, before))
            k = len(after) - 1
        elif kind == "drop":
            del after[k]
        elif kind == "color":
            after[k]["color"] = rng.choice([c for c in COLORS if c != before[k]["color"]])
        elif kind == "material":
            after[k]["material"] = "metal" if before[k]["material"] == "rubber" else "rubber"
        elif kind == "move":  # to free floor at least 2 units away
            after[k] = {**before[k], "x": rng.uniform(-extent, extent), "y": rng.uniform(-extent, extent)}
            if np.hypot(after[k]["x"] - before[k]["x"], after[k]["y"] - before[k]["y"]) < 2 or \
                    not all(_apart(after[k], p) for p in before if p is not before[k]):
                continue
        if None in after or len({tuple(o[a] for a in ATTRS) for o in after}) < len(after):
            continue
        if not all(_in_frame(o, cam) for o in before + after):
            continue
        vb, va = visibility(before, cam), visibility(after, cam)
        if min(vb.values()) < 0.4 or min(va.values()) < 0.4:  # every object seen, at least in part
            continue
        if (kind != "add" and vb[k] < 0.8) or (kind != "drop" and va[k] < 0.8):  # the changed one clearly
            continue
        return before, after, k


# -----------------------------------------------------------------------------
# captions in CLEVR-Change's style: synonyms, varied templates, referring expressions from visible attributes

SAY = {"small": ("small", "tiny"), "large": ("large", "big"), "rubber": ("rubber", "matte"),
       "metal": ("metal", "metallic", "shiny"), "cube": ("cube", "block"), "sphere": ("sphere", "ball"),
       "thing": ("thing", "object")}
RELATIONS = {  # in the base camera's frame, with a margin a viewer can tell
    "behind": lambda a, b: a["y"] - b["y"] > 0.8, "in front of": lambda a, b: b["y"] - a["y"] > 0.8,
    "to the left of": lambda a, b: b["x"] - a["x"] > 0.8, "to the right of": lambda a, b: a["x"] - b["x"] > 0.8}
TEMPLATES = {
    "color": ["the {o} changed its color", "the {o} changed to {new}", "the {o} became {new}", "the {o} turned {new}",
              "someone changed the color of the {o}", "the {o} was painted {new}", "the color of the {o} changed"],
    "material": ["the {o} changed its material", "the {o} became {new}", "the {o} turned {new}",
                 "the {o} is now {new}", "someone changed the material of the {o}", "the material of the {o} changed"],
    "move": ["the {o} has moved", "the {o} moved", "the {o} changed its location", "the {o} is in a different location",
             "someone moved the {o}", "the {o} has been moved", "the position of the {o} changed"],
    "add": ["someone added {a}", "{a} has been added", "{a} appeared", "there is a new {o}", "{a} was added",
            "a new {o} is in the scene"],
    "drop": ["the {o} has disappeared", "the {o} is missing", "someone removed the {o}", "the {o} is gone",
             "the {o} was removed", "the {o} is no longer there"],
}
# CLEVR-Change's own change phrases (its generator's templates) and relation words: `judge` reads them too
CLEVR_TEMPLATES = {"color": ["the {o} changed to {new}", "the {o} became {new}", "the {o} turned {new}"],
                   "material": ["the {o} changed to {new}", "the {o} became {new}", "the {o} turned {new}"],
                   "move": ["the {o} changed its location", "the {o} is in a different location"],
                   "add": ["the {o} has been newly placed", "the {o} has been added", "the {o} has appeared"],
                   "drop": ["the {o} is missing", "the {o} is gone", "the {o} has disappeared"]}
CLEVR_RELATIONS_SAID = {"behind": ("behind",), "in front of": ("in front of",),
                        "to the left of": ("left of", "to the left of", "on the left side of"),
                        "to the right of": ("right of", "to the right of", "on the right side of")}
NO_CHANGE = ["the scene is the same as before", "there is no difference", "the two scenes seem identical",
             "nothing has changed", "no change was made", "there is no change", "the scene remains the same",
             "nothing was modified", "no object has changed", "the two images show the same scene"]


def say(rng, word):
    return rng.choice(SAY.get(word, (word,)))


def refer(rng, o, scene, relate=0.15, was=False, nested=False):
    """A description that picks out o alone in `scene` ("small red metal cube", "red thing", "cylinder that
    was behind the cube")."""
    keys = ATTRS if rng.random() < 0.55 else [k for k in ATTRS if rng.random() < 0.5]  # mostly all four, as CLEVR
    alike = [p for p in scene if p is not o and all(p[k] == o[k] for k in keys)]
    if not nested and (alike or rng.random() < relate):
        for ref in rng.sample(scene, len(scene)):
            rels = [r for r, holds in RELATIONS.items() if holds(o, ref) and not any(holds(p, ref) for p in alike)]
            if ref is not o and ref not in alike and rels:
                that = "that was " if was else rng.choice(["that is ", ""])  # "moved the cube to the left of" misleads
                return f"{describe(rng, o, keys)} {that}{rng.choice(rels)} the {refer(rng, ref, scene, nested=True)}"
    return describe(rng, o, ATTRS if alike else keys)


def describe(rng, o, keys):
    words = [say(rng, o[k]) for k in ("size", "color", "material") if k in keys]
    return " ".join(words + [say(rng, o["shape"] if "shape" in keys else "thing")])


def captions(rng, kind, before, after, k, n=6):
    """About n distinct captions of the change (the object named as it was, the added one as it is)."""
    out = []
    for _ in range(10 * n):
        if kind == "add":
            o = refer(rng, after[k], after)
        else:
            o = refer(rng, before[k], before, was=kind in ("move", "drop"))
        new = say(rng, after[k][kind]) if kind in ("color", "material") else ""
        text = rng.choice(TEMPLATES[kind]).format(o=o, new=new, a=("an " if o[0] in "aeiou" else "a ") + o)
        if text not in out:
            out.append(text)
        if len(out) == n:
            break
    return out


# -----------------------------------------------------------------------------
# scene descriptions for CLIP pretraining in miniature (pretrain.py): every visible object, and hard negatives

FRAMES = ["{objs}", "there is {objs}", "a scene with {objs}", "the scene shows {objs}", "{objs} on the floor",
          "we see {objs}", "{n} objects: {objs}"]
NUMBERS = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}


def description(objs, seed):
    """Every object of a scene with its size, colour, material and shape, order and wording drawn from
    `seed`, a fixed number of draws per object: a hard negative gets the same sentence but for its one word."""
    r = random.Random(seed)
    frame, order = FRAMES[int(r.random() * len(FRAMES))], sorted(range(len(objs)), key=lambda _: r.random())
    pick = lambda word: SAY.get(word, (word,))[int(r.random() * len(SAY.get(word, (word,))))]
    phrases = [" ".join(pick(objs[k][a]) for a in ATTRS) for k in order]
    phrases = [("an " if p[0] in "aeiou" else "a ") + p for p in phrases]
    objs_text = ", ".join(phrases[:-1]) + " and " + phrases[-1] if len(phrases) > 1 else phrases[0]
    return frame.format(objs=objs_text, n=NUMBERS.get(len(objs), len(objs)))


VALUES = {"size": tuple(SIZES), "color": tuple(COLORS), "material": MATERIALS, "shape": SHAPES}


def hard_negative(rng, objs):
    """The scene with one attribute of one object changed, or swapped between two objects (binding), as
    NegCLIP's hard negatives; never the scene's own set of objects."""
    key = lambda os: sorted(tuple(o[a] for a in ATTRS) for o in os)
    while True:
        out, a = [dict(o) for o in objs], rng.choice(ATTRS)
        i = rng.randrange(len(out))
        others = [j for j in range(len(out)) if out[j][a] != out[i][a]]
        if others and rng.random() < 0.5:  # swap between two objects
            j = rng.choice(others)
            out[i][a], out[j][a] = out[j][a], out[i][a]
        else:
            out[i][a] = rng.choice([v for v in VALUES[a] if v != out[i][a]])
        if key(out) != key(objs):
            return out


def views(i, seed, size=IMAGE_SIZE):
    """Scene i of a set `make` wrote: {image name: [(object, (u, v))]}, (u, v) its centre as fractions of the
    width and height, or None for an image where an object is cut by the frame or hidden."""
    out = {}
    for name, (objs, jc, _) in _scene(i, seed)[5].items():
        cam = camera(jc)
        hidden = min(visibility(objs, cam).values()) < 0.4 or not all(_in_frame(o, cam) for o in objs)
        out[name] = None if hidden else [
            (o, tuple(float(t / s) for t, s in zip(project(cam, geometry(o)[0], *size)[:2], size))) for o in objs]
    return out


# -----------------------------------------------------------------------------
# the set on disk


def _scene(i, seed):
    """Scene i's random draws -> (its random stream, change type, objects before and after, the changed index,
    {image name: (objects, camera jitter, light jitter)})."""
    rng = random.Random(f"clevr-synth-{seed}-{i}")  # one stream per scene
    kind = rng.choice(CHANGES)
    before, after, k = make_scene(rng, kind)
    jc, jl = [rng.uniform(-0.5, 0.5) for _ in range(6)], [rng.uniform(-0.3, 0.3) for _ in range(3)]
    shift = lambda js, lo, hi: [a + rng.choice((-1, 1)) * rng.uniform(lo, hi) for a in js]
    return rng, kind, before, after, k, {"images/CLEVR_default": (before, jc, jl),
                                         "sc_images/CLEVR_semantic": (after, shift(jc, 0, 0.3), jl),
                                         "nsc_images/CLEVR_nonsemantic": (before, shift(jc, 0.5, 1), shift(jl, 0.5, 1))}


def _make_triple(i, out, seed, size):
    """Scene i -> its three images on disk; returns its type, change captions, no-change captions and
    scene record."""
    rng, kind, before, after, k, views = _scene(i, seed)
    for name, (objs, j1, j2) in views.items():
        Image.fromarray(render(objs, camera(j1), light(j2), *size)).save(f"{out}/{name}_{i:06d}.png", compress_level=1)
    scene = {"type": kind, "before": before, "after": after, "changed": k}
    return kind, captions(rng, kind, before, after, k), rng.sample(NO_CHANGE, 6), scene


def changed_region(root, scene_id):
    """Where the changed object is drawn in a change pair: {"before": box, "after": box}, each (left, top,
    right, bottom) as fractions of the image (its bounding disc), None where it is absent."""
    meta = json.loads((Path(root) / "synth.json").read_text())
    _, kind, before, after, k, views = _scene(int(scene_id), meta["seed"])
    w, h = meta["size"]

    def box(name):  # the changed object's bounding disc in that image
        objs, jc, _ = views[name]
        c, r = geometry(objs[k])
        u, v, s = project(camera(jc), c, w, h)
        return (u - r * s) / w, (v - r * s) / h, (u + r * s) / w, (v + r * s) / h
    return {"before": box("images/CLEVR_default") if kind != "add" else None,
            "after": box("sc_images/CLEVR_semantic") if kind != "drop" else None}


def set_meta(pairs, size, seed):
    """The synth.json of a set made with these arguments."""
    return {"pairs": pairs, "size": list(size), "seed": seed, "version": VERSION}


def resolve_set(out, pairs, seed, size=IMAGE_SIZE, workers=None):
    """A synthetic set at `out`, rendered unless its synth.json has these arguments."""
    out = Path(out)
    meta = out / "synth.json"
    if not meta.is_file() or json.loads(meta.read_text()) != set_meta(pairs, size, seed):
        make_synth(out, pairs, seed, size, workers)
    return out


def make_synth(out=SYNTH_ROOT, pairs=3000, seed=0, size=IMAGE_SIZE, workers=None):
    """Write a synthetic CLEVR-Change (its layout and files) and scenes.json ({"%06d": {"type", "before",
    "after", "changed"}})."""
    out = Path(out)
    for d in ("images", "sc_images", "nsc_images"):
        (out / d).mkdir(parents=True, exist_ok=True)
    (out / "synth.json").unlink(missing_ok=True)  # written last: marks a complete set
    t0 = time.time()
    with Pool(workers or os.cpu_count()) as pool:
        scene = partial(_make_triple, out=str(out), seed=seed, size=tuple(size))
        made = pool.map(scene, range(pairs), chunksize=8)
    name = lambda i: f"CLEVR_default_{i:06d}.png"
    types = {t: [f"{i:06d}.png" for i, m in enumerate(made) if m[0] == t] for t in CHANGES}
    order = random.Random(seed).sample(range(pairs), pairs)
    n_val, n_test = max(1, pairs // 20), max(1, pairs // 10)  # the real split is 85 / 5 / 10 %
    meta = set_meta(pairs, size, seed)
    files = {"change_captions.json": {name(i): m[1] for i, m in enumerate(made)},
             "no_change_captions.json": {name(i): m[2] for i, m in enumerate(made)}, "type_mapping.json": types,
             "splits.json": dict(train=order[n_val + n_test:], val=order[:n_val], test=order[n_val:n_val + n_test]),
             "scenes.json": {f"{i:06d}": m[3] for i, m in enumerate(made)}, "synth.json": meta}
    for f, obj in files.items():
        (out / f).write_text(json.dumps(obj))
    dt = time.time() - t0
    print(f"synthetic CLEVR-Change: {pairs} triples ({size[0]}x{size[1]}) in {out} in {dt:.1f}s, "
          f"{pairs / dt:.0f} triples/s")
    return out


# -----------------------------------------------------------------------------
# reading a caption back: what it says changed, and which object it names, in our grammar or CLEVR-Change's

WORD = {w: k for k, ws in SAY.items() for w in ws}  # a synonym -> its canonical word: "tiny" -> "small"
ATTR_OF = {**{v: "color" for v in COLORS}, **{v: "material" for v in MATERIALS}, **{v: "size" for v in SIZES},
           **{v: "shape" for v in SHAPES}}  # a canonical word -> the attribute it gives
SPATIAL = {said: rel for rel, words in CLEVR_RELATIONS_SAID.items() for said in words}  # words -> RELATIONS' key
_REL = "|".join(sorted(map(re.escape, SPATIAL), key=len, reverse=True))
RELATION = re.compile(rf"(?P<head>[a-z ]+?) (?:that (?:was|is) )?(?:both )?(?P<rel>{_REL}) the (?P<ref>[a-z ]+?)"
                      rf"(?: and (?P<rel2>{_REL}) the (?P<ref2>[a-z ]+))?$")
SAME = re.compile(r"(?P<head>[a-z ]+?) that (?:was |is |has )?(?:made of )?the same (?P<attr>size|color|colour|shape|"
                  r"material) as the (?P<ref>[a-z ]+)$")


def _pattern(template):
    """A caption template -> a regex: {o} a referring expression, {new} one word, {a} "a"/"an" and an expression."""
    rx = re.escape(template).replace(r"\{o\}", "(?P<o>[a-z ]+?)").replace(r"\{new\}", "(?P<new>[a-z]+)")
    return re.compile(rx.replace(r"\{a\}", "an? (?P<o>[a-z ]+?)") + "$")


PATTERNS = [(kind, _pattern(t)) for kind in CHANGES  # ours, then CLEVR-Change's that we do not share
            for t in dict.fromkeys(TEMPLATES[kind] + CLEVR_TEMPLATES[kind])]


def _attributes(phrase):
    """"small red thing" -> {"size": "small", "color": "red"}; None unless adjectives and a shape or thing (a
    leading "other" adds nothing)."""
    words = phrase.split()
    *adjectives, noun = [WORD.get(w, w) for w in (words[1:] if words[:1] == ["other"] else words)] or [""]
    if noun != "thing" and ATTR_OF.get(noun) != "shape":
        return None
    attrs = {} if noun == "thing" else {"shape": noun}
    for w in adjectives:
        if ATTR_OF.get(w) in (None, "shape") or ATTR_OF[w] in attrs:
            return None
        attrs[ATTR_OF[w]] = w
    return attrs


def _parse(phrase):
    """A referring expression -> (attributes, [(how, ref)]), how a key of RELATIONS or ("same", attribute)."""
    if m := SAME.match(phrase):
        head, links = m["head"], [(("same", {"colour": "color"}.get(m["attr"], m["attr"])), m["ref"])]
    elif m := RELATION.match(phrase):
        head = m["head"]
        links = [(SPATIAL[m["rel"]], m["ref"])] + ([(SPATIAL[m["rel2"]], m["ref2"])] if m["rel2"] else [])
    else:
        head, links = phrase, []
    attrs = _attributes(head)
    refs = [_attributes(ref) for _, ref in links]
    return None if attrs is None or None in refs else (attrs, [(how, a) for (how, _), a in zip(links, refs)])


def _holds(how, o, p):
    if isinstance(how, tuple):  # ("same", attribute)
        return o[how[1]] == p[how[1]]
    # a CLEVR scene record has its own relations, computed by CLEVR's generator
    return o["index"] in p["relations"][how] if "relations" in p else RELATIONS[how](o, p)


def resolve(phrase, scene):
    """The objects of `scene` that a referring expression can mean ([] when it is not one of ours)."""
    parsed = _parse(phrase)
    if parsed is None:
        return []
    attrs, links = parsed
    found = [o for o in scene if all(o[k] == v for k, v in attrs.items())]
    for how, ref in links:  # "... that was behind the red cube"
        refs = [p for p in scene if all(p[k] == v for k, v in ref.items())]
        found = [o for o in found if any(p is not o and _holds(how, o, p) for p in refs)]
    return found


def read(caption):
    """A caption -> (what it says, the referring expression): ("no change", None), (change type, expression), or
    (None, None) for none of our templates."""
    text = " ".join(caption.lower().split())
    if text in NO_CHANGE:
        return "no change", None
    parsed = []
    for kind, rx in PATTERNS:
        if m := rx.match(text):
            if "new" in rx.groupindex:
                kind = ATTR_OF.get(WORD.get(m["new"], m["new"]))
            if kind in CHANGES:
                parsed.append((kind, m["o"]))
    valid = [(kind, o) for kind, o in parsed if _parse(o) is not None]
    return (valid or parsed or [(None, None)])[0]  # a valid reading first


def changed(scene):
    """A change pair's record -> the objects where the changed one is (after an add, else before), its index."""
    return scene["after"] if scene["type"] == "add" else scene["before"], scene["changed"]


def judge(caption, scene):
    """One change pair's caption against its record: a change, of the right type, naming the changed object?"""
    kind, phrase = read(caption)
    where, k = changed(scene)
    found = resolve(phrase, where) if phrase else []
    return {"change": kind in CHANGES, "type": kind == scene["type"],
            "object": len(found) == 1 and found[0] is where[k]}


def named(caption, scene):
    """The attributes a change caption's object has ("the small red cube": size, color, shape) -> whether the changed
    object has each: which of them a captioner reads."""
    phrase = read(caption)[1]
    parsed = _parse(phrase) if phrase else None
    where, k = changed(scene)
    return {a: v == where[k][a] for a, v in parsed[0].items()} if parsed else {}


def probe(train_ids, x_train, test_ids, x_test, scenes):
    """What a pair encoder's vectors (N, D) of change pairs know of the change: a linear probe of the changed object's
    attributes and of the change type, trained on the training pairs' -> each one's accuracy % on the test pairs'."""
    def label(i):
        where, k = changed(scenes[i])
        return {**{a: where[k][a] for a in ATTRS}, "type": scenes[i]["type"]}
    ytr, yte = [label(i) for i in train_ids], [label(i) for i in test_ids]
    with torch.random.fork_rng():  # the probes' initializations fixed, the run's random stream untouched
        torch.manual_seed(0)
        return {k: linear_probe(x_train, [y[k] for y in ytr], x_test, [y[k] for y in yte]) for k in (*ATTRS, "type")}


def linear_probe(x_train, y_train, x_test, y_test, steps=300):
    """A softmax classifier on standardized features (full-batch Adam, a little weight decay) -> test accuracy %."""
    classes = sorted(set(y_train))
    ytr = torch.tensor([classes.index(y) for y in y_train])
    yte = torch.tensor([classes.index(y) if y in classes else -1 for y in y_test])
    xtr, xte = ((x - x_train.mean(0)) / (x_train.std(0) + 1e-6) for x in (x_train, x_test))
    with torch.enable_grad():
        head = torch.nn.Linear(xtr.shape[1], len(classes))
        opt = torch.optim.Adam(head.parameters(), lr=1e-2, weight_decay=1e-4)
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(head(xtr), ytr).backward()
            opt.step()
    return 100 * (head(xte).argmax(1) == yte).float().mean().item()


def report_lines(judged):
    """report's figures in three lines (two without the attributes named)."""
    types = ", ".join(f"{t} {judged[t]['right type %']:.0f}/{judged[t]['right object %']:.0f}%"
                      for t in CHANGES if t in judged)
    attrs = ", ".join(f"{a} {v:.0f}%" for a, v in judged.get("named attributes right %", {}).items())
    return [f"read back against the scenes: {judged['change caption %']:.0f}% of {judged['change pairs']} change "
            f"pairs get a change caption, {judged['right type %']:.0f}% the right change type, "
            f"{judged['right object %']:.0f}% the right object; {judged['no change on distractors %']:.0f}% of "
            f"{judged['distractor pairs']} distractors get \"no change\"",
            f"   by change type, right type/object: {types}"] + (
        [f"   of the attributes named, the changed object has: {attrs}"] if attrs else [])


def report(preds, scenes):
    """{item id: caption} -> the percentages: change pairs given a change caption, the right type, the right
    object (also per type), each attribute named right; distractors ("_n") given "no change"."""
    judged = {i: judge(c, scenes[i]) for i, c in preds.items() if not i.endswith("_n")}
    calm = [read(c)[0] == "no change" for i, c in preds.items() if i.endswith("_n")]
    pct = lambda flags: round(100 * sum(flags) / max(1, len(flags)), 1)
    of = lambda k: pct([j[k] for j in judged.values()])
    out = {"change pairs": len(judged), "change caption %": of("change"), "right type %": of("type"),
           "right object %": of("object"), "distractor pairs": len(calm), "no change on distractors %": pct(calm)}
    said = [named(c, scenes[i]) for i, c in preds.items() if not i.endswith("_n")]
    out["named attributes right %"] = {a: pct([n[a] for n in said if a in n]) for a in VALUES
                                       if any(a in n for n in said)}
    for t in CHANGES:
        js = [j for i, j in judged.items() if scenes[i]["type"] == t]
        if js:
            out[t] = {"right type %": pct([j["type"] for j in js]), "right object %": pct([j["object"] for j in js])}
    return out


CLEVR_RELATIONS = {"behind": "behind", "front": "in front of", "left": "to the left of", "right": "to the right of"}
_skipped = set()


def _clevr_objects(scene):
    """A CLEVR scene record's objects as judge reads them, with CLEVR's spatial relations."""
    rel = scene["relationships"]
    return [{**{a: o[a] for a in ATTRS}, "index": j,
             "relations": {ours: rel[theirs][j] for theirs, ours in CLEVR_RELATIONS.items()}}
            for j, o in enumerate(scene["objects"])]


def _clevr_record(s):
    """One triple of CLEVR-Change's own generator -> (pair id, our record of its change pair)."""
    change = s["change"]
    if change["type"] not in CHANGES:
        raise ValueError(f"change type {change['type']!r}")
    record = {"type": change["type"], "before": _clevr_objects(s["default_scene"]),
              "after": _clevr_objects(s["semantic_scene"]), "changed": change["object_index"]}
    return f"{int(s['image_index']):06d}", record


def read_scenes(root):
    """{pair id: {"type", "before", "after", "changed"}} from a synthetic set's scenes.json or CLEVR's
    own renderer's ({"scenes": [...]}); None without one, or for one of another format (said once)."""
    path = Path(root) / "scenes.json"
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text())
        if isinstance(obj, dict) and isinstance(obj.get("scenes"), list):
            return dict(_clevr_record(s) for s in obj["scenes"])
        if isinstance(obj, dict) and all(isinstance(r, dict) and {"type", "before", "after", "changed"} <= r.keys()
                                         for r in obj.values()):
            return obj
        why = "neither a synthetic set's records nor CLEVR's scenes"
    except (ValueError, KeyError, TypeError, IndexError) as e:
        why = f"{type(e).__name__}: {e}"
    if path not in _skipped:
        _skipped.add(path)
        print(f"{path}: a scenes.json of another format ({why}): captions are not read back against the scenes")
    return None


def is_synthetic(root):
    """A set `make` wrote (synth.json and scenes.json): the attention figure needs it."""
    return all((Path(root) / f).is_file() for f in ("synth.json", "scenes.json"))


def get_args(argv=None):
    from train_utils import HelpFormatter, at_least  # here: the renderer's processes need no torch
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    m = p.add_subparsers(dest="cmd", required=True).add_parser(
        "make", formatter_class=HelpFormatter, help="render a synthetic CLEVR-Change-style set")
    m.add_argument("--out", default=SYNTH_ROOT, help="directory to write (CLEVR-Change's layout)")
    m.add_argument("--pairs", type=at_least(3), default=3000,
                   help="number of scenes (default, semantic, non-semantic): at least a train, a val and a test one")
    m.add_argument("--seed", type=int, default=0, help="same seed, same set")
    m.add_argument("--size", type=at_least(8), nargs=2, default=list(IMAGE_SIZE), metavar=("W", "H"),
                   help="image size on disk (CLEVR-Change's is 480 320)")
    m.add_argument("--workers", type=at_least(1), default=None, help="processes (default: all cores)")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = get_args()
    make_synth(args.out, args.pairs, args.seed, args.size, args.workers)
