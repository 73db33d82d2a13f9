"""Llama-family decoder (llama, mistral, qwen2, qwen3) over a ragged batch and paged KV.

Prefill, chunked prefill and decode are one code path: every sequence brings new tokens,
their K/V are written into pages through the slot mapping, and attention reads the pages.
q/k/v and gate/up projections are fused into one matmul each at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch
from engine.cache.kv_cache import KVPages
from engine.config import ModelConfig
from engine.model.rotary import cos_sin, inverse_frequencies
from engine.model.weights import WeightTarget
from engine.ops import OpSet


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.sliding_window = cfg.sliding_windows[layer]
        self.scale = cfg.head_dim**-0.5
        qkv_rows = cfg.q_size + 2 * cfg.kv_size
        self.qkv_weight = _param(qkv_rows, cfg.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv_rows, dtype=dtype, device=device) if cfg.attention_bias else None
        self.o_weight = _param(cfg.hidden_size, cfg.q_size, dtype=dtype, device=device)
        self.o_bias = None
        if cfg.o_proj_bias:
            self.o_bias = _param(cfg.hidden_size, dtype=dtype, device=device)
        if cfg.qk_norm:
            self.q_norm = _param(cfg.head_dim, dtype=dtype, device=device)
            self.k_norm = _param(cfg.head_dim, dtype=dtype, device=device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        cfg = self.cfg
        offsets = {"q_proj": 0, "k_proj": cfg.q_size, "v_proj": cfg.q_size + cfg.kv_size}
        targets = {}
        for name, offset in offsets.items():
            targets[f"{prefix}{name}.weight"] = WeightTarget(self.qkv_weight, offset)
            if self.qkv_bias is not None:
                targets[f"{prefix}{name}.bias"] = WeightTarget(self.qkv_bias, offset)
        targets[f"{prefix}o_proj.weight"] = WeightTarget(self.o_weight)
        if self.o_bias is not None:
            targets[f"{prefix}o_proj.bias"] = WeightTarget(self.o_bias)
        if cfg.qk_norm:
            targets[f"{prefix}q_norm.weight"] = WeightTarget(self.q_norm)
            targets[f"{prefix}k_norm.weight"] = WeightTarget(self.k_norm)
        return targets

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: tuple[torch.Tensor, torch.Tensor],
        ops: OpSet,
    ) -> torch.Tensor:
        cfg = self.cfg
        num_tokens = h.shape[0]
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = ops.rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = ops.rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        k_pages, v_pages = kv
        q = ops.rotary_cache_write(q, k, v, *rope, k_pages, v_pages, batch.slot_mapping)
        out = ops.paged_attention(q, k_pages, v_pages, batch, self.scale, self.sliding_window)
        return F.linear(out.reshape(num_tokens, cfg.q_size), self.o_weight, self.o_bias)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        inter, hidden = cfg.intermediate_size, cfg.hidden_size
        self.inter = inter
        self.gate_up_weight = _param(2 * inter, hidden, dtype=dtype, device=device)
        self.down_weight = _param(hidden, inter, dtype=dtype, device=device)
        self.gate_up_bias = self.down_bias = None
        if cfg.mlp_bias:
            self.gate_up_bias = _param(2 * inter, dtype=dtype, device=device)
            self.down_bias = _param(hidden, dtype=dtype, device=device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = {
            f"{prefix}gate_proj.weight": WeightTarget(self.gate_up_weight, 0),
            f"{prefix}up_proj.weight": WeightTarget(self.gate_up_weight, self.inter),
            f"{prefix}down_proj.weight": WeightTarget(self.down_weight),
        }
        if self.gate_up_bias is not None:
            targets[f"{prefix}gate_proj.bias"] = WeightTarget(self.gate_up_bias, 0)
            targets[f"{prefix}up_proj.bias"] = WeightTarget(self.gate_up_bias, self.inter)
            targets[f"{prefix}down_proj.bias"] = WeightTarget(self.down_bias)
        return targets

    def forward(self, h: torch.Tensor, ops: OpSet) -> torch.Tensor:
        gate_up = F.linear(h, self.gate_up_weight, self.gate_up_bias)
        return F.linear(ops.silu_mul(gate_up), self.down_weight, self.down_bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.post_attention_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.attn = Attention(cfg, layer, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {
            f"{prefix}input_layernorm.weight": WeightTarget(self.input_norm),
            f"{prefix}post_attention_layernorm.weight": WeightTarget(self.post_attention_norm),
            **self.attn.weight_targets(f"{prefix}self_attn."),
            **self.mlp.weight_targets(f"{prefix}mlp."),
        }

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: tuple[torch.Tensor, torch.Tensor],
        ops: OpSet,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each add fuses into the next norm.
        if residual is None:
            residual = h
            h = ops.rms_norm(h, self.input_norm, self.eps)
        else:
            h, residual = ops.add_rms_norm(h, residual, self.input_norm, self.eps)
        h = self.attn(h, rope, batch, kv, ops)
        h, residual = ops.add_rms_norm(h, residual, self.post_attention_norm, self.eps)
        return self.mlp(h, ops), residual


class LlamaForCausalLM(nn.Module):
    """The network; ``engine.model.Model`` wraps it with loading and the public API."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers)
        )
        self.final_norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            self.embed
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.register_buffer(
            "inv_freq", inverse_frequencies(cfg.rope, cfg.head_dim).to(device), persistent=False
        )

    def weight_targets(self) -> dict[str, WeightTarget]:
        targets = {
            "model.embed_tokens.weight": WeightTarget(self.embed),
            "model.norm.weight": WeightTarget(self.final_norm),
        }
        if not self.cfg.tie_word_embeddings:
            targets["lm_head.weight"] = WeightTarget(self.lm_head)
        for i, layer in enumerate(self.layers):
            targets.update(layer.weight_targets(f"model.layers.{i}."))
        return targets

    def forward(self, batch: ForwardBatch, kv_pages: KVPages, ops: OpSet) -> torch.Tensor:
        """Logits (float32) of the rows in ``batch.logits_indices``: [N, vocab]."""
        return self.logits(self.hidden_states(batch, kv_pages, ops))

    def hidden_states(self, batch: ForwardBatch, kv_pages: KVPages, ops: OpSet) -> torch.Tensor:
        """Final-normed hidden states [N, hidden] of the rows in ``batch.logits_indices``."""
        h = self.embed_tokens(batch)
        rope = cos_sin(self.inv_freq, batch.positions, h.dtype)
        residual = None
        for layer, kv in zip(self.layers, kv_pages, strict=True):
            h, residual = layer(h, residual, rope, batch, kv, ops)
        # Only the rows whose logits are wanted need the final norm and the vocab matmul.
        rows = batch.logits_indices
        return ops.rms_norm(h[rows] + residual[rows], self.final_norm, self.cfg.rms_norm_eps)

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """[T, hidden]: the token embeddings, with per-job embedding rows written over the
        placeholder positions (one index_copy for the whole batch)."""
        table = batch.embeddings
        if table is None:
            return F.embedding(batch.input_ids, self.embed)
        ids = batch.input_ids.index_fill(0, table.positions, 0)  # placeholders: any valid id
        return F.embedding(ids, self.embed).index_copy_(0, table.positions, table.rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] of final-normed hidden states."""
        return F.linear(hidden, self.lm_head).float()
