"""CLIP's weights, BPE tokenizer and preprocessing.

- `load_clip`: OpenAI's TorchScript archive, a state dict, Hugging Face's CLIP folder, the authors' checkpoints
  (`clip.*`) or our adapted.pt -> model.CLIP in fp32; OpenAI's ViTs by name are downloaded to ~/.cache/clip.
  `authors_captioner`: the authors' `decoder.*`.
- `tokenize` / `decode`: OpenAI's byte-level BPE, the ids of `clip.tokenize`.
- `preprocess`: a bicubic squash (the authors'; a change at the border survives), CLIP's mean/std.
"""
import argparse
import gzip
import hashlib
import html
import json
import os
import urllib.request
import zipfile
from functools import lru_cache
from pathlib import Path

import ftfy
import numpy as np
import regex as re
import torch
from PIL import Image

from model import ACTIVATIONS, N_INTER, build_model, config_of, heads_for

# -----------------------------------------------------------------------------
# weights

MODELS = {name: f"https://openaipublic.azureedge.net/clip/models/{sha}/{file}" for name, sha, file in [  # clip.py's
    ("ViT-B/32", "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af", "ViT-B-32.pt"),  # the paper's
    ("ViT-B/16", "5806e77cd80f8b59890b7e101eabd078d9fb84e6937f9e85e4ecb61988df416f", "ViT-B-16.pt"),
    ("ViT-L/14", "b8cca3fd41ae0c99ba7e8951adf17d267cdb84cd88be6f7c2e0eca1737a03836", "ViT-L-14.pt"),
    ("ViT-L/14@336px", "3035c92b350959924f9f00213499208652fc7ea050643e8b385c2dac08641f02", "ViT-L-14-336px.pt")]}
CACHE = Path(os.environ.get("CLIP_CACHE", Path.home() / ".cache" / "clip"))
WEIGHTS = "README 'Real data and OpenAI's weights'"  # where to get OpenAI's weights
# the small CLIPs pretrain.py pretrained on synthetic scenes, shipped
ASSETS = Path(__file__).resolve().parent / "assets"
SHIPPED = {  # 12x12 patches of 8 px, words and tokens 64 wide: the quickstart's (pretrain.py's defaults)
    "mini64-synth": ("clip_mini64_synth.pt", "b1b6b7d2107905a1f7c463085e49f59f4b9d5ca63e8b1c029b5b8acceff2428a")}
NON_PARAMETERS = ("input_resolution", "context_length", "vocab_size")  # scalars in OpenAI's state dict


def sha256(path, chunk=1 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def resolve(name_or_path):
    """A released name -> its cached file (downloaded if absent); a shipped one -> its file in assets/; else a path."""
    if name_or_path in SHIPPED:
        file, expected = SHIPPED[name_or_path]
        path = ASSETS / file
        if not path.is_file():
            raise SystemExit(f"{path} is missing: restore it with `git checkout -- {Path('assets') / file}`")
        if (got := sha256(path)) != expected:
            raise SystemExit(f"{path} has SHA256 {got}, expected {expected}: restore it with `git checkout -- "
                             f"{Path('assets') / file}` (or put a new one's in clip_load.SHIPPED)")
        return path
    if name_or_path not in MODELS:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise SystemExit(f"CLIP weights: {no_weights(path)}")
        return path
    url = MODELS[name_or_path]
    path, expected = CACHE / Path(url).name, url.split("/")[-2]
    if path.is_file():
        if sha256(path) == expected:
            return path
        print(f"{path} has the wrong SHA256: downloading it again")
    return download(url, path, expected)


def no_weights(path):
    return (f"nothing at {path}: give a file, a Hugging Face folder, one of {list(MODELS)} (downloaded) or "
            f"{list(SHIPPED)}; see {WEIGHTS}")


def weights_arg(text):
    if text in MODELS or text in SHIPPED or Path(text).expanduser().exists():
        return text
    raise argparse.ArgumentTypeError(no_weights(text))


def activation_flag(p):
    p.add_argument("--activation", choices=list(ACTIVATIONS), default=None, help="CLIP's MLP activation (default: "
                   "the weights' origin's; a bare state dict: quick_gelu, said)")


def download(url, path, expected):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    print(f"downloading {url} -> {path}")
    try:
        with urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f:
            total, done = int(r.headers.get("Content-Length", 0)), 0
            while block := r.read(1 << 20):
                f.write(block)
                done += len(block)
                print(f"\r  {done / 2**20:.0f}/{total / 2**20:.0f} MiB", end="", flush=True)
        print()
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"could not download {url} ({e}). Offline? Copy {path.name} to {path}, or pass --preset "
                         f"mini for the shipped small CLIP; see {WEIGHTS}.") from None
    if (got := sha256(tmp)) != expected:
        tmp.unlink()
        raise SystemExit(f"downloaded {url} but its SHA256 is {got}, expected {expected}: try again")
    tmp.rename(path)
    return path


def read_state_dict(path):
    """A checkpoint -> (CLIP state dict in OpenAI's names, the file's other entries and the origin's activation)."""
    path, origin = Path(path), None
    if path.is_dir():  # Hugging Face's folder
        if not (file := next((path / n for n in HF_FILES if (path / n).is_file()), None)):
            raise SystemExit(f"{path} holds none of {', '.join(HF_FILES)}: not a Hugging Face CLIP folder")
        path = file
    what = f"{path} ({path.stat().st_size / 2**20:.1f} MiB)"
    try:
        if path.suffix == ".safetensors":
            sd = read_safetensors(path)
        elif zipfile.is_zipfile(path) and any(n.endswith("constants.pkl") for n in zipfile.ZipFile(path).namelist()):
            sd, origin = torch.jit.load(str(path), map_location="cpu").state_dict(), "quick_gelu"  # OpenAI's archive
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # zip, pickle and jit errors alike
        why = (str(e).splitlines() or [""])[0][:200]
        raise SystemExit(f"could not read {what}: {type(e).__name__}: {why}. Truncated, corrupt, or not a PyTorch "
                         f"checkpoint ({WEIGHTS}).") from None
    extra = {}
    if isinstance(sd, dict) and isinstance(sd.get("model"), dict):  # our adapted.pt / captioner.pt
        extra = {k: v for k, v in sd.items() if k != "model"}
        sd = sd["model"]
        if "n_inter" in extra.get("config", {}) or "pretrain" in extra:  # ours: QuickGELU before they said
            origin = (extra.get("config") or extra["pretrain"]).get("activation", "quick_gelu")
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise SystemExit(f"{what} holds a {type(sd).__name__}, not a state dict of tensors")
    sd = {k.removeprefix("module."): v for k, v in sd.items()}  # saved from DDP
    if any(k.startswith("clip.") for k in sd):  # the authors'
        if other := [k for k in sd if not k.startswith(("clip.", "decoder."))]:
            raise SystemExit(f"{what} holds keys neither clip.* nor decoder.* ({', '.join(other[:3])}): not the "
                             f"authors' CLIP4IDC checkpoint")
        extra = {"decoder": {k[len("decoder."):]: v for k, v in sd.items() if k.startswith("decoder.")}}
        sd, origin = {k[len("clip."):]: v for k, v in sd.items() if k.startswith("clip.")}, "quick_gelu"
    if hf := any(k.startswith("vision_model.") for k in sd):
        sd, extra["hf"] = from_hf(sd, path), True
    sd = {k: v for k, v in sd.items() if k not in NON_PARAMETERS}
    if not {"visual.conv1.weight", "visual.proj", "token_embedding.weight", "ln_final.weight"} <= sd.keys():
        found = ", ".join(list(sd)[:5])
        raise SystemExit(f"{what} is not a CLIP ViT checkpoint with both towers (keys {found}, ...; no "
                         f"visual.conv1.weight, visual.proj, token_embedding.weight or ln_final.weight)")
    return sd, {**extra, "activation": hf_activation(path.parent / "config.json", sd) if hf else origin}


def read_safetensors(path):
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise SystemExit(f"{path} is a safetensors file: reading it needs `pip install safetensors`") from None
    return load_file(path)


def decide_activation(extra, given, path):
    """--activation (`given`), else the origin's; a bare state dict's origin cannot be told: QuickGELU, said."""
    known = extra["activation"]
    if given and known and given != known:
        raise SystemExit(f"--activation {given}: {path} is {known} by its origin: leave the flag out")
    if extra.get("hf") and known and not given:
        print(f"   {path}: Hugging Face's layout (clip_load.HF_NAMES), {known} as its config.json says", flush=True)
    if not (given or known):
        print(f"*** {path}: of unknown origin, read with QuickGELU and width / 64 heads, as OpenAI's CLIPs; "
              "open_clip's LAION ViTs use GELU (give --activation gelu), its ViT-H and larger other heads (not "
              "supported) ***", flush=True)
    return given or known or "quick_gelu"


# Hugging Face's CLIPModel layout -> OpenAI's names, replaced in order (q, k, v joined after)
HF_FILES = ("pytorch_model.bin", "model.safetensors")  # the first there: the second needs the safetensors package
HF_NAMES = (
    ("text_model.embeddings.token_embedding.", "token_embedding."),
    ("text_model.embeddings.position_embedding.weight", "positional_embedding"),
    ("text_model.encoder.layers.", "transformer.resblocks."), ("text_model.final_layer_norm.", "ln_final."),
    ("vision_model.embeddings.class_embedding", "visual.class_embedding"),
    ("vision_model.embeddings.patch_embedding.", "visual.conv1."),
    ("vision_model.embeddings.position_embedding.weight", "visual.positional_embedding"),
    ("vision_model.pre_layrnorm.", "visual.ln_pre."), ("vision_model.post_layernorm.", "visual.ln_post."),
    ("vision_model.encoder.layers.", "visual.transformer.resblocks."), (".self_attn.out_proj.", ".attn.out_proj."),
    (".layer_norm1.", ".ln_1."), (".layer_norm2.", ".ln_2."), (".mlp.fc1.", ".mlp.c_fc."),
    (".mlp.fc2.", ".mlp.c_proj."))
HF_TRANSPOSED = {"visual_projection.weight": "visual.proj", "text_projection.weight": "text_projection"}  # x @ W


def from_hf(sd, path):
    ours = {}
    for k, v in sd.items():
        if not k.endswith("position_ids"):  # older files' buffer
            for theirs, mine in HF_NAMES:
                k = k.replace(theirs, mine)
            ours[HF_TRANSPOSED.get(k, k)] = v.t() if k in HF_TRANSPOSED else v
    for k in [k for k in ours if ".self_attn.q_proj." in k]:
        block, kind = k.split(".self_attn.q_proj.")
        q, k_, v = (ours.pop(f"{block}.self_attn.{x}_proj.{kind}") for x in "qkv")
        assert q.shape == k_.shape == v.shape, f"{path}: {block}'s q, k, v differ in shape"
        ours[f"{block}.attn.in_proj_{kind}"] = torch.cat([q, k_, v])
    return ours


def hf_activation(config_file, sd):
    """config.json's hidden_act (None without the file); its heads must be model.CLIP's, width / 64."""
    if not config_file.is_file():
        return None
    try:
        cfg = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise SystemExit(f"{config_file} is not valid JSON ({e}): Hugging Face's config.json, or none") from None
    # as transformers: an older file's *_config_dict over its *_config
    towers = {t: (cfg.get(f"{t}_config_dict") or cfg.get(f"{t}_config") or {}, heads_for(sd[w].shape[0])) for t, w in
              (("vision", "visual.ln_pre.weight"), ("text", "ln_final.weight"))}
    if bad := [t for t, (c, heads) in towers.items() if c.get("num_attention_heads", heads) != heads]:
        raise SystemExit(f"{config_file}: the {bad[0]} tower's heads are not its width / 64, as model.CLIP splits it")
    if len(acts := {c.get("hidden_act", "quick_gelu") for c, _ in towers.values()}) > 1 or acts - ACTIVATIONS.keys():
        raise SystemExit(f"{config_file}: hidden_act {sorted(acts)}: expected one of {list(ACTIVATIONS)} in both")
    return acts.pop()


def load_clip(path_or_name="ViT-B/32", device="cpu", n_inter=None, activation=None):
    """CLIP in fp32, eval mode. n_inter None: the file's, else N_INTER; activation None: by origin."""
    path = resolve(path_or_name)
    return build_clip(*read_state_dict(path), path, n_inter, activation).to(device).eval()


def clip_config(path_or_name, given_activation=None):
    path = resolve(path_or_name)
    sd, extra = read_state_dict(path)
    n_inter = extra.get("config", {}).get("n_inter", N_INTER)
    return config_of(sd, n_inter, decide_activation(extra, given_activation, path))


def build_clip(sd, extra, path, n_inter=None, given_activation=None):
    n_inter = extra.get("config", {}).get("n_inter", N_INTER) if n_inter is None else n_inter
    layers = len({k.split(".")[3] for k in sd if k.startswith("visual.transformer.resblocks.")})
    if not 0 <= n_inter <= layers:
        raise SystemExit(f"--n-inter {n_inter}: {path} has {layers} vision blocks")
    try:
        model = build_model(sd, n_inter, decide_activation(extra, given_activation, path))
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    except (RuntimeError, KeyError, ValueError, AssertionError) as e:
        raise SystemExit(f"{path} does not fit the CLIP ViT architecture: {(str(e).splitlines() or [''])[0][:300]} "
                         f"({WEIGHTS})") from None
    return model


# the authors' captioner (module_decoder.py, BERT's names) -> model.Captioner, replaced in order
AUTHORS_NAMES = (
    ("decoder.layer.", "decoder."), ("encoder.layer.", "encoder."), ("slf_attn.att.query", "attn.q_proj"),
    ("slf_attn.output.dense", "attn.out_proj"), ("slf_attn.output.LayerNorm", "ln_1"),
    ("enc_attn.att.query", "cross_attn.q_proj"), ("enc_attn.output.dense", "cross_attn.out_proj"),
    ("enc_attn.output.LayerNorm", "ln_x"), ("slf_attn.att.", "attn."), ("enc_attn.att.", "cross_attn."),
    ("intermediate.dense", "mlp.c_fc"), ("output.dense", "mlp.c_proj"), ("output.LayerNorm", "ln_2"),
    ("embeddings.LayerNorm", "ln_emb"), ("classifier.cls.predictions.transform.dense", "head.dense"),
    ("classifier.cls.predictions.transform.LayerNorm", "head.ln"), ("classifier.cls.predictions.bias", "head_bias"))
AUTHORS_TIED = {"embeddings.word_embeddings.weight": "token_embedding.weight",  # CLIP's own
                "classifier.cls.predictions.decoder.weight": "token_embedding.weight",
                "embeddings.position_embeddings.weight": "positional_embedding"}


def authors_captioner(decoder, clip_sd, path):
    """Their `decoder.*` -> (model.Captioner's state dict, encoder layers, decoder layers); tied copies checked."""
    ours = {}
    for k, v in decoder.items():
        if k in AUTHORS_TIED:
            if not torch.equal(v.float(), clip_sd[AUTHORS_TIED[k]].float()):
                raise SystemExit(f"{path}: decoder.{k} differs from clip.{AUTHORS_TIED[k]}, its tied copy: not the "
                                 f"authors' captioner")
            k = AUTHORS_TIED[k]
        for theirs, mine in AUTHORS_NAMES:
            k = k.replace(theirs, mine)
        ours[k] = v.float()
    for k in [k for k in ours if ".key." in k]:  # key and value joined
        ours[k.replace(".key.", ".kv_proj.")] = torch.cat([ours.pop(k), ours.pop(k.replace(".key.", ".value."))])
    n = lambda stack: len({k.split(".")[1] for k in ours if k.startswith(stack + ".")})
    return ours, n("encoder"), n("decoder")


# -----------------------------------------------------------------------------
# tokenizer: OpenAI's byte-level BPE (clip/simple_tokenizer.py), same ids

BPE_PATH = Path(__file__).resolve().parent / "assets" / "bpe_simple_vocab_16e6.txt.gz"
BPE_SHA256 = "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"
SOT, EOT = 49406, 49407  # <|startoftext|>, <|endoftext|>; padding is 0
PAT = re.compile(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
                 re.IGNORECASE)


def bytes_to_unicode():
    """Every byte -> a printable character, so BPE works on bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in bs]  # to the characters from 256 on
    return dict(zip(bs + rest, map(chr, bs + [256 + n for n in range(len(rest))])))


@lru_cache(maxsize=1)
def vocab():
    if not BPE_PATH.is_file() or sha256(BPE_PATH) != BPE_SHA256:
        raise SystemExit(f"{BPE_PATH} is missing or corrupt (SHA256 must be {BPE_SHA256}): restore it from git")
    merges = [tuple(m.split()) for m in gzip.open(BPE_PATH).read().decode("utf-8").split("\n")[1:49152 - 256 - 2 + 1]]
    tokens = list(bytes_to_unicode().values())
    tokens = tokens + [t + "</w>" for t in tokens] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, {m: i for i, m in enumerate(merges)}


@lru_cache(maxsize=100_000)
def bpe(word):
    """A word -> its BPE pieces, the lowest-rank pair merged first."""
    ranks = vocab()[1]
    parts = list(word[:-1]) + [word[-1] + "</w>"]
    while len(parts) > 1:
        best = min(zip(parts, parts[1:]), key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(parts):
            n = 2 if tuple(parts[i:i + 2]) == best else 1
            merged.append("".join(parts[i:i + n]))
            i += n
        parts = merged
    return parts


def encode(text):
    """A string -> BPE ids without start/end tokens, cleaned as OpenAI's."""
    encoder, byte_encoder = vocab()[0], bytes_to_unicode()
    text = re.sub(r"\s+", " ", html.unescape(html.unescape(ftfy.fix_text(text))).strip()).strip().lower()
    ids = []
    for word in re.findall(PAT, text):
        if word in ("<|startoftext|>", "<|endoftext|>"):
            ids.append(encoder[word])
        else:
            ids.extend(encoder[piece] for piece in bpe("".join(byte_encoder[b] for b in word.encode("utf-8"))))
    return ids


def decode(ids):
    text = "".join(bpe_tokens()[i] for i in ids)
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    return bytearray(byte_decoder[c] for c in text).decode("utf-8", errors="replace").replace("</w>", " ")


@lru_cache(maxsize=1)
def bpe_tokens():
    return list(vocab()[0])


def tokenize(texts, context_length=77, truncate=False):
    """As `clip.tokenize`: [N, context_length] = SOT, ids, EOT, zero padding."""
    texts = [texts] if isinstance(texts, str) else texts
    out = torch.zeros(len(texts), context_length, dtype=torch.long)
    for i, text in enumerate(texts):
        ids = [SOT] + encode(text) + [EOT]
        if len(ids) > context_length:
            if not truncate:
                raise ValueError(f"text {i} is {len(ids)} tokens, longer than context length {context_length}: "
                                 f"{text[:80]!r} (pass truncate=True to cut it)")
            ids = ids[:context_length - 1] + [EOT]
        out[i, :len(ids)] = torch.tensor(ids)
    return out


def trim(ids, static=False):
    """Token ids (B, L) cut after the batch's last end token (the text tower is causal); static: uncut, one shape
    (a captured step's)."""
    return ids if static else ids[:, :int(ids.argmax(-1).max()) + 1]


# -----------------------------------------------------------------------------
# images

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def to_rgb(image):
    """Any PIL mode -> RGB; 16-bit and float greyscale scaled (PIL would clip at 255)."""
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        a = np.asarray(image, dtype=np.float64) * (255.0 if image.mode == "F" else 255.0 / 65535)
        image = Image.fromarray(np.clip(a + 0.5, 0, 255).astype(np.uint8), "L")
    return image if image.mode == "RGB" else image.convert("RGB")


def resize_uint8(image, size=224):
    """PIL image -> uint8 [3, size, size], squashed (the authors'; OpenAI's crops)."""
    image = to_rgb(image).resize((size, size), Image.BICUBIC)
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)


_MEAN_STD = {}  # device -> CLIP's mean and std there, made once (a CUDA graph copies nothing)


def normalize(x):
    if x.device not in _MEAN_STD:
        _MEAN_STD[x.device] = [torch.tensor(v, device=x.device).view(3, 1, 1) for v in (MEAN, STD)]
    mean, std = _MEAN_STD[x.device]
    return (x.float() / 255 - mean) / std


def preprocess(image, size=224):
    return normalize(resize_uint8(image, size))


def open_image(path):
    try:
        image = Image.open(path)
        image.load()
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot read image {path}: {e}") from None
    return image


def load_image(path, size=224):
    return preprocess(open_image(path), size)
