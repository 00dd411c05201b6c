"""The networks of CLIP4IDC: CLIP ViT (image + text towers), the intra/inter pair encoder, the captioner.

Parameter names are the keys of OpenAI's `ViT-B-32.pt` (it loads with `strict=True`), sizes read off its shapes.

Pair encoder (paper Sec. 3.1, eq. 2-5): the first N_intra vision blocks see each image alone; the two token
sequences then get a per-image embedding (e1, e2), a joint positional embedding p and a LayerNorm, and the last
N_inter blocks attend across both images. Its tokens (B, 2(n+1), embed), each image's n patches and [CLS], feed the
captioner; the mean of its two [CLS] tokens is the pair vector v used for retrieval.
"""
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# building blocks (OpenAI's names: ln_1, attn.in_proj_weight, mlp.c_fc, ...)

USE_SDPA = True  # False: the plain softmax below (tests, FLOP counts)
MAX_LEN = 32  # the captioner's positions: start + 31 words in, the words + end out (the authors' --max_words)
N_INTER = 3  # inter blocks where the weights do not say (OpenAI's): the paper's 9 + 3, ViT-L/14's 21 + 3


class LayerNorm(nn.LayerNorm):
    """LayerNorm in fp32 whatever the input dtype, as CLIP's."""

    def forward(self, x):
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).type(x.dtype)


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


def heads_for(width):
    """OpenAI's CLIPs' (and so the authors' captioner's) heads: 64 wide."""
    return max(1, width // 64)


ACTIVATIONS = {"quick_gelu": QuickGELU, "gelu": nn.GELU}  # OpenAI's CLIPs; open_clip's LAION-trained ViTs


def attention(q, k, v, causal=False, dropout=0.0):
    """(B, heads, Tq, hs), (B, heads, Tk, hs) x2 -> (B, heads, Tq, hs); causal: the queries are the last Tq
    of the Tk positions."""
    Tq, Tk = q.shape[2], k.shape[2]
    assert not causal or Tq <= Tk, f"causal attention needs the {Tq} queries among the {Tk} key positions"
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq) if causal and Tq > 1 else None
    if USE_SDPA:
        if mask is not None and Tq == Tk:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)  # fused kernels
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, heads, Tq, Tk)
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf"))
    return F.dropout(att.softmax(dim=-1), dropout) @ v


class MultiheadAttention(nn.Module):
    """Self-attention under nn.MultiheadAttention's parameter names, so OpenAI's weights load."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, x, causal=False):
        B, T, C = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, h, T, hs)
        return self.out_proj(attention(q, k, v, causal).transpose(1, 2).reshape(B, T, C))


class ResidualAttentionBlock(nn.Module):
    """Pre-LN Transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, width, heads, activation):
        super().__init__()
        self.ln_1 = LayerNorm(width)
        self.attn = MultiheadAttention(width, heads)
        self.ln_2 = LayerNorm(width)
        self.mlp = nn.Sequential(OrderedDict([("c_fc", nn.Linear(width, 4 * width)),
                                              ("gelu", ACTIVATIONS[activation]()),
                                              ("c_proj", nn.Linear(4 * width, width))]))

    def forward(self, x, causal=False):
        x = x + self.attn(self.ln_1(x), causal)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, width, layers, heads, activation):
        super().__init__()
        self.width, self.layers = width, layers
        self.resblocks = nn.ModuleList([ResidualAttentionBlock(width, heads, activation) for _ in range(layers)])

    def forward(self, x, causal=False):
        for block in self.resblocks:
            x = block(x, causal)
        return x


# -----------------------------------------------------------------------------
# CLIP's vision tower, extended into the pair encoder


class PairEncoding(NamedTuple):
    """The pair encoder's 2(n+1) tokens (the captioner's memory) and the pair vector v (retrieval)."""
    tokens: torch.Tensor
    vector: torch.Tensor


class VisionTransformer(nn.Module):
    def __init__(self, input_resolution, patch_size, width, layers, heads, output_dim, n_inter, activation):
        super().__init__()
        assert 0 <= n_inter <= layers, f"n_inter={n_inter} must be within 0..{layers} (the vision layers)"
        self.input_resolution, self.n_inter = input_resolution, n_inter
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        scale = width ** -0.5
        n_tokens = (input_resolution // patch_size) ** 2 + 1  # n patches + [CLS]
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        self.positional_embedding = nn.Parameter(scale * torch.randn(n_tokens, width))
        self.ln_pre = LayerNorm(width)
        self.transformer = Transformer(width, layers, heads, activation)
        self.ln_post = LayerNorm(width)
        self.proj = nn.Parameter(scale * torch.randn(width, output_dim))
        # CLIP4IDC's new parameters, under the authors' names: e1, e2 (eq. 3), p and the mid LayerNorm (eq. 4)
        self.bef_embedding = nn.Parameter(scale * torch.randn(width))
        self.aft_embedding = nn.Parameter(scale * torch.randn(width))
        self.joint_positional_embedding = nn.Parameter(scale * torch.randn(2 * n_tokens, width))
        self.ln_mid = LayerNorm(width)

    def patches(self, x):
        """(B, 3, H, W) -> (B, n, width): conv1 (kernel = stride) as one matmul."""
        B, C, H, W = x.shape
        P = self.conv1.kernel_size[0]
        x = x[:, :, :H // P * P, :W // P * P].reshape(B, C, H // P, P, W // P, P)  # a remainder dropped, as conv
        x = x.permute(0, 2, 4, 1, 3, 5).reshape(B, (H // P) * (W // P), C * P * P)  # (B, n, 3*P*P)
        return F.linear(x.to(self.conv1.weight.dtype), self.conv1.weight.flatten(1))

    def stem(self, x):
        """(B, 3, H, W) -> (B, n+1, width): patches, [CLS], positional embedding, ln_pre."""
        x = self.patches(x)  # (B, n, width)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        return self.ln_pre(torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype))  # (B, n+1, width)

    def forward(self, x):
        """Plain CLIP image features: (B, 3, H, W) -> (B, output_dim)."""
        return self.ln_post(self.transformer(self.stem(x))[:, 0]) @ self.proj

    def forward_pair(self, before, after):
        """The pair encoder, eq. (2)-(5): (B, 3, H, W) x2 -> PairEncoding."""
        x = self.intra(self.stem(torch.cat([before, after])))  # eq. (2): each image alone, both in one batch
        return self.inter(torch.cat(x.chunk(2), dim=1))  # eq. (3)-(5) on the joint sequence (B, 2(n+1), width)

    def intra(self, x):
        """eq. (2): the first N_intra blocks on each image's tokens (B, n+1, width) alone."""
        for block in self.transformer.resblocks[:len(self.transformer.resblocks) - self.n_inter]:
            x = block(x)
        return x

    def inter(self, x):
        """eq. (3)-(5) on the images' tokens side by side (B, 2(n+1), width) -> PairEncoding; with no inter blocks
        (N + 0, Table 7) e1, e2, p and ln_mid still apply, as in the authors' code (module_clip.py 341-361)."""
        n1 = x.shape[1] // 2
        e = torch.cat([self.bef_embedding.expand(n1, -1), self.aft_embedding.expand(n1, -1)])  # eq. (3)
        x = self.ln_mid(x + e.to(x.dtype) + self.joint_positional_embedding.to(x.dtype))  # eq. (4)
        for block in self.transformer.resblocks[len(self.transformer.resblocks) - self.n_inter:]:
            x = block(x)
        # every token projected, not only [CLS] as in CLIP: the captioner's memory, as wide as CLIP's words
        tokens = self.ln_post(x) @ self.proj  # (B, 2(n+1), output_dim)
        return PairEncoding(tokens, (tokens[:, 0] + tokens[:, tokens.shape[1] // 2]) / 2)  # eq. (5): the [CLS]s' mean


# -----------------------------------------------------------------------------
# CLIP: both towers


@dataclass
class CLIPConfig:
    """OpenAI's build arguments, read off a state dict (config_of) or chosen."""
    embed_dim: int = 512
    image_resolution: int = 224
    vision_layers: int = 12
    vision_width: int = 768
    vision_patch_size: int = 32
    context_length: int = 77
    vocab_size: int = 49408
    transformer_width: int = 512
    transformer_heads: int = 8
    transformer_layers: int = 12
    n_inter: int = N_INTER  # CLIP4IDC: the last vision blocks that are inter blocks
    activation: str = "quick_gelu"  # the MLPs': a key of ACTIVATIONS


class CLIP(nn.Module):
    def __init__(self, cfg: CLIPConfig):
        super().__init__()
        self.cfg = cfg
        self.visual = VisionTransformer(cfg.image_resolution, cfg.vision_patch_size, cfg.vision_width,
                                        cfg.vision_layers, heads_for(cfg.vision_width), cfg.embed_dim, cfg.n_inter,
                                        cfg.activation)
        self.transformer = Transformer(cfg.transformer_width, cfg.transformer_layers, cfg.transformer_heads,
                                       cfg.activation)
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.transformer_width)
        self.positional_embedding = nn.Parameter(torch.empty(cfg.context_length, cfg.transformer_width))
        self.ln_final = LayerNorm(cfg.transformer_width)
        self.text_projection = nn.Parameter(torch.empty(cfg.transformer_width, cfg.embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.initialize_parameters()

    def initialize_parameters(self):
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        for tower in (self.transformer, self.visual.transformer):
            proj_std = tower.width ** -0.5 * (2 * tower.layers) ** -0.5
            for block in tower.resblocks:
                nn.init.normal_(block.attn.in_proj_weight, std=tower.width ** -0.5)
                nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
                nn.init.normal_(block.mlp.c_fc.weight, std=(2 * tower.width) ** -0.5)
                nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
        nn.init.normal_(self.text_projection, std=self.transformer.width ** -0.5)

    def encode_image(self, image):
        return self.visual(image)

    def encode_text(self, text):
        """(B, L) token ids -> (B, embed_dim), the features at the end-of-text token."""
        dtype = self.text_projection.dtype  # fp16 under --authors-numerics, as theirs
        x = self.token_embedding(text).to(dtype) + self.positional_embedding[:text.shape[1]].to(dtype)
        x = self.ln_final(self.transformer(x, causal=True))
        eot = text.argmax(dim=-1)  # the end-of-text id is the largest
        return x[torch.arange(x.shape[0], device=x.device), eot] @ self.text_projection

    def forward(self, image, text):
        """OpenAI's logits_per_image, logits_per_text."""
        img, txt = F.normalize(self.encode_image(image), dim=-1), F.normalize(self.encode_text(text), dim=-1)
        logits = self.logit_scale.exp() * img @ txt.t()
        return logits, logits.t()

    def encode_pair(self, before, after):
        return self.visual.forward_pair(before, after)


# CLIP's input embeddings, fixed by the authors (main_task_retrieval.py 176-205, main_task_caption.py 640-667); stage 2
# gives CLIP's words, which the captioner ties to its input and output, their own rate
INPUT_EMBEDDINGS = ("token_embedding.", "positional_embedding", "visual.conv1.", "visual.class_embedding",
                    "visual.positional_embedding", "visual.ln_pre.")
PAIR_KEYS = ("visual.bef_embedding", "visual.aft_embedding", "visual.joint_positional_embedding",
             "visual.ln_mid.weight", "visual.ln_mid.bias")


def share_joint_positions_(visual, norm):
    """Not the paper's (--shared-p): p (eq. 4) alike in both images, random codes of this norm, [CLS]'s zero: a patch
    and the same place in the other image start with one code, so the inter blocks can compare them from step 1."""
    p = visual.joint_positional_embedding
    half = torch.randn(p.shape[0] // 2, p.shape[1], device=p.device)
    half = norm * half / half.norm(dim=1, keepdim=True)
    half[0] = 0
    with torch.no_grad():
        p.copy_(torch.cat([half, half]))


def authors_fp16_(clip):
    """The authors' fp16, in place (their convert_weights, module_clip.py 541-562): conv1, the attention and
    MLP Linears, visual.proj and text_projection."""
    for m in clip.modules():
        names = ("in_proj_weight", "in_proj_bias") if isinstance(m, MultiheadAttention) else \
            ("weight", "bias") if isinstance(m, (nn.Conv2d, nn.Linear)) else ()
        for p in (getattr(m, n) for n in names):
            if p is not None:
                p.data = p.data.half()
    for p in (clip.visual.proj, clip.text_projection):
        p.data = p.data.half()
    return clip


def config_of(sd, n_inter=N_INTER, activation="quick_gelu"):
    """The CLIPConfig of a state dict, read off its shapes (as openai/CLIP's `build_model`)."""
    vision_width, patch = sd["visual.conv1.weight"].shape[0], sd["visual.conv1.weight"].shape[-1]
    vision_layers = len({k.split(".")[3] for k in sd if k.startswith("visual.transformer.resblocks.")})
    grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    width = sd["ln_final.weight"].shape[0]
    layers = len({k.split(".")[2] for k in sd if k.startswith("transformer.resblocks.")})
    return CLIPConfig(sd["text_projection"].shape[1], patch * grid, vision_layers, vision_width, patch,
                      sd["positional_embedding"].shape[0], sd["token_embedding.weight"].shape[0], width,
                      heads_for(width), layers, n_inter, activation)


def build_model(sd, n_inter=N_INTER, activation="quick_gelu"):
    """A CLIP of `sd`'s sizes; the pair parameters `sd` lacks added to it fresh, so a strict load checks the rest."""
    model = CLIP(config_of(sd, n_inter, activation))
    sd.update({k: v for k, v in model.state_dict().items() if k in PAIR_KEYS and k not in sd})
    return model


# -----------------------------------------------------------------------------
# The captioner (paper Sec. 3.3): the words cross-attend to the pair encoder's tokens (the memory).


class Attention(nn.Module):
    """Self-attention (source=None) or cross-attention to `source`; kv_cache: a dict per layer and kind."""

    def __init__(self, width, heads, dropout=0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.q_proj = nn.Linear(width, width)
        self.kv_proj = nn.Linear(width, 2 * width)
        self.out_proj = nn.Linear(width, width)

    def split(self, x):
        B, T, C = x.shape
        return x.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, heads, T, hs)

    def forward(self, x, source=None, causal=False, kv_cache=None):
        q = self.split(self.q_proj(x))
        if source is not None and kv_cache:  # the memory, projected at the first step
            k, v = kv_cache["k"], kv_cache["v"]
        else:
            k, v = map(self.split, self.kv_proj(x if source is None else source).chunk(2, dim=-1))
            if source is None and kv_cache:  # the cached prefix's, then this call's
                k, v = torch.cat([kv_cache["k"], k], dim=2), torch.cat([kv_cache["v"], v], dim=2)
            if kv_cache is not None:  # kept: the prefix so far, or the memory's projection for later steps
                kv_cache["k"], kv_cache["v"] = k, v
        y = attention(q, k, v, causal, self.dropout if self.training else 0.0)
        return self.out_proj(y.transpose(1, 2).flatten(2))  # (B, T, width)


def feed_forward(width):
    return nn.Sequential(OrderedDict([  # erf GELU, as BERT's
        ("c_fc", nn.Linear(width, 4 * width)), ("gelu", nn.GELU()), ("c_proj", nn.Linear(4 * width, width))]))


def caches(kv_cache):
    return (None, None) if kv_cache is None else (kv_cache.setdefault("self", {}), kv_cache.setdefault("cross", {}))


def init_weights_(module):
    """normal(0, 0.02), biases 0: BERT's (until_module.py 70-85) and GPT-2's."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)


# The authors' captioner as their code built it (modules/module_decoder.py): BERT's post-LN layers, 3 encoder layers
# over the pair encoder's tokens, 3 decoder layers, decoder layer i reading encoder layer i; CLIP's words and
# positions tied in, and BERT's prediction head.


@dataclass
class CaptionerConfig:
    vocab_size: int = 49408  # CLIP's BPE tokens
    memory_len: int = 100  # the pair encoder's 2(n+1) tokens (recorded; the layers take any length)
    width: int = 512
    heads: int = 8
    enc_layers: int = 3
    dec_layers: int = 3
    max_len: int = MAX_LEN
    dropout: float = 0.1


class BertLayer(nn.Module):
    """BERT's post-LN LN(x + dropout(f(x))): self-attention, MLP; cross: causal self-attention, cross-attention, MLP."""

    def __init__(self, width, heads, dropout, cross=False):
        super().__init__()
        self.ln_1 = LayerNorm(width, eps=1e-12)
        self.attn = Attention(width, heads, dropout)
        if cross:
            self.ln_x = LayerNorm(width, eps=1e-12)
            self.cross_attn = Attention(width, heads, dropout)
        self.ln_2 = LayerNorm(width, eps=1e-12)
        self.mlp = feed_forward(width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, memory=None, kv_cache=None):
        c_self, c_cross = caches(kv_cache)
        x = self.ln_1(x + self.drop(self.attn(x, causal=memory is not None, kv_cache=c_self)))
        if memory is not None:
            x = self.ln_x(x + self.drop(self.cross_attn(x, memory, kv_cache=c_cross)))
        return self.ln_2(x + self.drop(self.mlp(x)))


class Captioner(nn.Module):
    def __init__(self, cfg: CaptionerConfig, clip):
        super().__init__()
        if cfg.enc_layers < cfg.dec_layers:
            raise ValueError(f"decoder layer i reads encoder layer i: {cfg.enc_layers} encoder layers for "
                             f"{cfg.dec_layers} decoder layers")
        self.cfg = cfg
        self.encoder = nn.ModuleList([BertLayer(cfg.width, cfg.heads, cfg.dropout) for _ in range(cfg.enc_layers)])
        self.decoder = nn.ModuleList([BertLayer(cfg.width, cfg.heads, cfg.dropout, cross=True)
                                      for _ in range(cfg.dec_layers)])
        # BERT's prediction head, then the word embeddings transposed, plus a bias
        self.head = nn.Sequential(OrderedDict([("dense", nn.Linear(cfg.width, cfg.width)), ("gelu", nn.GELU()),
                                               ("ln", LayerNorm(cfg.width, eps=1e-12))]))
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.ln_emb = LayerNorm(cfg.width, eps=1e-12)
        self.drop = nn.Dropout(cfg.dropout)
        init_weights_(self)
        # tied, after init_weights_ (which would redraw them): CLIP's own words and positions (modeling.py 182-195)
        self.token_embedding, self.positional_embedding = clip.token_embedding, clip.positional_embedding

    def encode(self, memory):
        """Pair-encoder tokens (B, 2(n+1), width) -> each encoder layer's output."""
        x, outs = memory.to(self.head.dense.weight.dtype), []  # the captioner's dtype
        for block in self.encoder:
            x = block(x)
            outs.append(x)
        return outs

    def decode(self, tokens, mems, kv_caches=None, start=0, words=None):
        """Token ids (B, T) from position `start`, encode's list -> logits (B, T, vocab); layer i reads mems[i].
        words (B, T) bool: the logits of those positions only, (N, vocab) in batch order: a vocabulary-wide row per
        padding position would cost as much as a word's."""
        # sparse: the lookup's gradient is the batch's rows, added to the tied head's dense one (no second dense table)
        x = F.embedding(tokens, self.token_embedding.weight, sparse=True)
        x = self.drop(self.ln_emb(x + self.positional_embedding[start:start + tokens.shape[1]]))
        for i, block in enumerate(self.decoder):
            x = block(x, mems[i], None if kv_caches is None else kv_caches[i])
        if words is not None:
            x = x[words]
        return self.head(x) @ self.token_embedding.weight.t() + self.head_bias

    def forward(self, memory, tokens, words=None):
        return self.decode(tokens, self.encode(memory), words=words)


# decoding, through the captioner's encode and decode


@torch.no_grad()
def generate(captioner, memory, bos, eos, max_len=None, use_kv_cache=True):
    """Greedy decoding -> ids (B, <= max_len), 0 after <eos>; without the cache, the whole prefix each step."""
    max_len = min(max_len or captioner.cfg.max_len, captioner.cfg.max_len)
    mem = captioner.encode(memory)
    out = torch.full((len(memory), 1), bos, dtype=torch.long, device=memory.device)
    kv_caches = [{} for _ in captioner.decoder] if use_kv_cache else None
    done = torch.zeros(len(memory), dtype=torch.bool, device=memory.device)
    for t in range(max_len):
        step, start = (out[:, -1:], t) if use_kv_cache else (out, 0)
        nxt = captioner.decode(step, mem, kv_caches, start)[:, -1].argmax(-1).masked_fill(done, 0)  # (B,)
        out = torch.cat([out, nxt[:, None]], dim=1)
        done |= nxt == eos
        if done.all():
            break
    return out[:, 1:]


@torch.no_grad()
def beam_search(captioner, memory, bos, eos, beam=3, max_len=None):
    """Beam search; the best beam by log-probability per token."""
    max_len = min(max_len or captioner.cfg.max_len, captioner.cfg.max_len)
    mem = [m.repeat_interleave(beam, dim=0) for m in captioner.encode(memory)]  # each (B*K, M, width)
    B, K, dev = memory.shape[0], beam, memory.device
    out = torch.full((B * K, 1), bos, dtype=torch.long, device=dev)
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0  # one beam at first, so the first step gives K different words
    done, lengths = torch.zeros(B * K, dtype=torch.bool, device=dev), torch.zeros(B * K, device=dev)
    kv_caches = [{} for _ in captioner.decoder]
    for t in range(max_len):
        logp = captioner.decode(out[:, -1:], mem, kv_caches, start=t)[:, -1].float().log_softmax(-1)  # (B*K, V)
        V = logp.shape[-1]
        logp[done] = float("-inf")
        logp[done, 0] = 0  # a finished beam continues with padding at no cost
        scores, idx = (scores.view(-1, 1) + logp).view(B, K * V).topk(K, dim=-1)  # (B, K)
        src = (idx // V + torch.arange(B, device=dev)[:, None] * K).view(-1)  # the beam each came from
        nxt = (idx % V).view(-1)
        out = torch.cat([out[src], nxt[:, None]], dim=1)
        lengths = lengths[src] + (~done[src]).float()
        done = done[src] | (nxt == eos)
        for c in kv_caches:  # the prefix's keys/values follow their beam
            c["self"]["k"], c["self"]["v"] = c["self"]["k"][src], c["self"]["v"][src]
        if done.all():
            break
    best = (scores.view(-1) / lengths.clamp(min=1)).view(B, K).argmax(-1)  # length-normalized
    return out.view(B, K, -1)[torch.arange(B, device=dev), best, 1:]
