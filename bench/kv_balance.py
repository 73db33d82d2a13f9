"""EXPERIMENTS (bench only, not engine options): K/V transforms around the quantized cache that
attention undoes exactly. Three:

1. ``+bal``: per-channel K/V rebalancing derived from the weights (no data).
2. ``+cal``: per-channel key equalization calibrated on activations (see below).
3. ``+ctr``: key centering: a fixed per-layer, KV-head vector m is subtracted from every
   post-RoPE key before it is quantized. Exact without any correction: q . (k_j - m) differs
   from q . k_j by q . m, the same for every key a query reads, and softmax ignores a shift.
   SmolLM2's post-RoPE keys carry a large common component (30-70% of their energy per
   layer), which a per-token group scale otherwise has to span. m is the mean post-RoPE key
   of one forward over ``CENTER_TOKENS`` uniformly random token ids (seeded): the model
   alone, no text.

Rebalancing:

q . k is unchanged when k is stored as k / s and q is multiplied by s per channel; the
attention output sum_j p_j v_j is multiplied by W_o next, so storing v / t and multiplying the
output by t is exact too. Quantizing the stored k / s (one scale per group of 32 channels)
then spends its step where q's weight is small. Per layer, KV head and channel:

    s_c = (|k_c| / |q_c|) ** alpha       t_c = (|v_c| / |W_o[:, c]|) ** alpha

with |k_c|, |q_c|, |v_c| estimated from the projection rows (times the input RMSNorm weight,
which the normed hidden state is multiplied by; plus the bias when the model has one) and
|W_o[:, c]| from W_o's columns; the q heads (and W_o columns) that share a KV head are
combined by RMS. RoPE rotates the channel pairs (c, c + D/2) by one angle, so both channels of
a pair get one s (from the pair's combined norms) and the scaling commutes with RoPE: dividing
k before the rotary is the same as after. With qk-norm (qwen3) the norm weights stand for the
magnitudes.

Calibrated key equalization (``+cal``):

The same k / s, q * s as the rebalancing above, but s is measured on the post-RoPE q and k of
one calibration forward (``record_qk``: a text other than the scored one, or seeded random
ids), per layer, KV head and channel (``calibrated_scales``):

    s_c = (|k_c| / |q_c|) ** alpha      (query_alpha = alpha)
    s_c = |k_c| ** alpha                 (query_alpha = 0)

with |x_c| a statistic over the calibration tokens (``STATS``: RMS, absmax or the 99th
percentile of |x_c|; with centering, of the centered keys) and the q heads sharing a KV head
combined by RMS. Why these two: with a rotated group the quantization error is spread evenly
over the group's channels with a variance that follows the group's mean square, so the score
error's variance goes as sum_c q_c^2 s_c^2 * sum_c k_c^2 / s_c^2, least (Cauchy-Schwarz) at
s_c = sqrt(|k_c| / |q_c|); with plain absmax groups a step follows the group's largest
|k_c / s_c|, and sum_c q_c^2 s_c^2 under max_c |k_c| / s_c <= 1 is least at s_c = |k_c|, q
plays no part. Applied after RoPE, the scaling does not have to commute with the rotary, so
the channels of a RoPE pair (c, c + D/2) need not share a scale (the rotary mixes their
magnitudes, so measured scales of a pair come out close anyway).

``adjusted_ops(ops, layers)`` wraps an op set: the cache write rotates q and k itself (and
hands the op an identity rotary), subtracts m from k, divides k and v by s and t, and writes;
the attention multiplies q by s and its output by t. The layer is the write's call index
modulo the number of layers (every forward runs every layer in order); the attention checks
that it reads the pages the last write wrote.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.batch import SequenceInput, build_forward_batch
from engine.cache.key_centers import CENTER_SEED, CENTER_TOKENS, calibration_ids, key_centers
from engine.cuda.rotary import rotary_reference
from engine.ops import OpSet

STATS = ("rms", "absmax", "p99")
PAGE_SIZE = 16


@dataclass(frozen=True)
class LayerScales:
    """One layer's divisors of the stored K (``s``) and V (``t``): float32 [KV, D], and the
    post-RoPE vector subtracted from every key (None: none)."""

    s: torch.Tensor
    t: torch.Tensor
    key_mean: torch.Tensor | None = None


def _rows(weight: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Row norms of a [heads * D, hidden] block: [heads, D] (float32)."""
    return weight.float().norm(dim=-1).reshape(heads, head_dim)


def _pairs(norms: torch.Tensor) -> torch.Tensor:
    """[..., D] channel norms -> the norm of each RoPE pair (c, c + D/2), on both channels."""
    half = norms.shape[-1] // 2
    pair = (norms[..., :half].square() + norms[..., half:].square()).sqrt()
    return torch.cat((pair, pair), dim=-1)


def _per_kv_head(norms: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[H, D] per q head -> [KV, D]: RMS over the q heads sharing each KV head."""
    h, d = norms.shape
    return norms.reshape(kv_heads, h // kv_heads, d).square().mean(dim=1).sqrt()


def _ratio(num: torch.Tensor, den: torch.Tensor, alpha: float) -> torch.Tensor:
    """(num / den) ** alpha, normalised to geometric mean 1 per head (only the ratios within a
    group of 32 change the quantization error; this keeps the values near their scale)."""
    tiny = torch.finfo(torch.float32).tiny
    log = alpha * (num.clamp_min(tiny).log() - den.clamp_min(tiny).log())
    return (log - log.mean(dim=-1, keepdim=True)).exp()


def layer_scales(attn, input_norm: torch.Tensor, alpha: float = 0.5) -> LayerScales:
    """The scales of one ``engine.model.llama.Attention`` whose input is normed by
    ``input_norm`` (the decoder layer's input RMSNorm weight)."""
    cfg = attn.cfg
    heads, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    w = attn.qkv_weight.float() * input_norm.float()[None, :]
    wq, wk, wv = w.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
    qn, kn, vn = _rows(wq, heads, d), _rows(wk, kv, d), _rows(wv, kv, d)
    if attn.qkv_bias is not None:
        bq, bk, bv = attn.qkv_bias.float().split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        qn = (qn.square() + bq.reshape(heads, d).square()).sqrt()
        kn = (kn.square() + bk.reshape(kv, d).square()).sqrt()
        vn = (vn.square() + bv.reshape(kv, d).square()).sqrt()
    if cfg.qk_norm:  # the normed q / k: the norm weights set the channel magnitudes
        qn = attn.q_norm.float().abs().expand(heads, d)
        kn = attn.k_norm.float().abs().expand(kv, d)
    qn = _per_kv_head(_pairs(qn), kv)
    kn = _pairs(kn)
    on = _per_kv_head(attn.o_weight.float().norm(dim=0).reshape(heads, d), kv)
    return LayerScales(s=_ratio(kn, qn, alpha), t=_ratio(vn, on, alpha))


def model_scales(model, alpha: float = 0.5, alpha_v: float | None = None) -> list[LayerScales]:
    """Every layer's scales (``alpha_v``: the values' exponent, default ``alpha``; 0 leaves
    that side alone)."""
    out = []
    for layer in model.network.layers:
        with torch.no_grad():
            s = layer_scales(layer.attn, layer.input_norm, alpha).s
            t = layer_scales(layer.attn, layer.input_norm, alpha if alpha_v is None else alpha_v).t
        out.append(LayerScales(s.to(model.device), t.to(model.device)))
    return out


def _per_q_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[KV, D] -> [H, D] (each KV head's row repeated for its q heads)."""
    return x.repeat_interleave(heads // x.shape[0], dim=0)


def random_ids(model, tokens: int, seed: int) -> list[int]:
    return calibration_ids(model.config.vocab_size, tokens, seed)


@dataclass(frozen=True)
class Activations:
    """One forward's post-RoPE queries [T, H, D] and keys [T, KV, D] per layer (float32)."""

    q: list[torch.Tensor]
    k: list[torch.Tensor]


def record_qk(model, ids: list[int]) -> Activations:
    """The post-RoPE q and k of every layer in one forward of ``ids`` through an unquantized
    cache."""
    if not ids:
        raise ValueError("record_qk needs at least one token id, got none")
    qs: list[torch.Tensor] = []
    ks: list[torch.Tensor] = []
    base = model.ops

    def record(q, k, v, cos, sin, k_pages, v_pages, slots):
        q_rot, k_rot = rotary_reference(q, k, cos, sin)
        qs.append(q_rot.float())
        ks.append(k_rot.float())
        return base.rotary_cache_write(q, k, v, cos, sin, k_pages, v_pages, slots)

    pages = -(-len(ids) // PAGE_SIZE)
    kv = model.allocate_kv(pages, PAGE_SIZE)
    batch = build_forward_batch([SequenceInput(ids, 0, range(pages))], PAGE_SIZE, model.device)
    with torch.inference_mode():
        model.network(batch, kv, dataclasses.replace(base, rotary_cache_write=record))
    return Activations(qs, ks)


def key_means(
    model, tokens: int = CENTER_TOKENS, seed: int = CENTER_SEED, ids: list[int] | None = None
) -> list[torch.Tensor]:
    """Per layer, the mean post-RoPE key [KV, D] (float32) over one forward of ``tokens``
    uniformly random token ids (``seed``), or of ``ids`` when given, through an unquantized
    cache."""
    return key_centers(model, random_ids(model, tokens, seed) if ids is None else ids)


def channel_stat(x: torch.Tensor, stat: str) -> torch.Tensor:
    """[T, n, D] -> [n, D]: per channel, over the tokens, the RMS, the largest |x| or the 99th
    percentile of |x|."""
    if stat == "rms":
        return x.square().mean(dim=0).sqrt()
    if stat == "absmax":
        return x.abs().amax(dim=0)
    if stat == "p99":
        return x.abs().quantile(0.99, dim=0)
    raise ValueError(f"unknown channel statistic {stat!r}; known: {', '.join(STATS)}")


def calibrated_scales(
    acts: Activations,
    stat: str = "rms",
    alpha: float = 0.5,
    query_alpha: float = 0.5,
    means: list[torch.Tensor] | None = None,
    pairs: bool = False,
) -> list[torch.Tensor]:
    """Per layer, the key divisors s [KV, D] = |k|^alpha / |q|^query_alpha (``stat`` over the
    recorded tokens; keys minus ``means[layer]`` when given), geometric mean 1 per head.
    ``pairs``: each RoPE pair (c, c + D/2) shares one scale from the pair's combined statistics
    (then s commutes with the rotary, so it does not depend on the positions calibrated at)."""
    out = []
    for layer, (q, k) in enumerate(zip(acts.q, acts.k, strict=True)):
        kv = k.shape[1]
        if means is not None:
            k = k - means[layer].to(k)
        kn = channel_stat(k, stat)
        qn = _per_kv_head(channel_stat(q, stat), kv)
        if pairs:
            kn, qn = _pairs(kn), _pairs(qn)
        tiny = torch.finfo(torch.float32).tiny
        log = alpha * kn.clamp_min(tiny).log() - query_alpha * qn.clamp_min(tiny).log()
        out.append((log - log.mean(dim=-1, keepdim=True)).exp())
    return out


def calibrated(layers: list[LayerScales], scales: list[torch.Tensor]) -> list[LayerScales]:
    """``layers`` with the key divisors replaced by ``scales`` (values, means unchanged)."""
    return [dataclasses.replace(x, s=s.to(x.s.device)) for x, s in zip(layers, scales, strict=True)]


def centered(layers: list[LayerScales], means: list[torch.Tensor]) -> list[LayerScales]:
    return [dataclasses.replace(x, key_mean=m) for x, m in zip(layers, means, strict=True)]


def identity_scales(model) -> list[LayerScales]:
    cfg = model.config
    one = torch.ones(cfg.num_kv_heads, cfg.head_dim, device=model.device)
    return [LayerScales(one, one) for _ in range(cfg.num_layers)]


def adjusted_ops(ops: OpSet, layers: list[LayerScales]) -> OpSet:
    """``ops`` with each layer's centering and rebalancing applied around the cache write and
    the attention."""
    state = {"calls": 0, "layer": 0, "pages": None}

    def write(q, k, v, cos, sin, k_pages, v_pages, slots):
        layer = state["calls"] % len(layers)
        state["calls"] += 1
        state["layer"], state["pages"] = layer, k_pages
        x = layers[layer]
        q, k = rotary_reference(q, k, cos, sin)
        if x.key_mean is not None:
            k = k - x.key_mean.to(k.dtype)
        k = k / x.s.to(k.dtype)
        v = v / x.t.to(v.dtype)
        one, zero = torch.ones_like(cos), torch.zeros_like(sin)  # q, k are rotated already
        return ops.rotary_cache_write(q, k, v, one, zero, k_pages, v_pages, slots)

    def attention(q, k_pages, v_pages, batch, scale, window=None):
        if k_pages is not state["pages"]:
            raise RuntimeError("adjusted attention reads pages the last write did not write")
        x = layers[state["layer"]]
        heads = q.shape[1]
        q = q * _per_q_head(x.s, heads).to(q.dtype)
        out = ops.paged_attention(q, k_pages, v_pages, batch, scale, window)
        return out * _per_q_head(x.t, heads).to(out.dtype)

    return dataclasses.replace(ops, rotary_cache_write=write, paged_attention=attention)
