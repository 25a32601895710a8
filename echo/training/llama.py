"""Llama layers: rotary position embeddings, grouped-query attention and a SwiGLU MLP, without
biases (Touvron et al. 2023; Llama 3). The block structure and norms live in model.py."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from echo.config.workload import ModelConfig
from echo.training import fused
from echo.training.layers import RecomputeHook, attention_core

ROPE_THETA = 500_000.0  # Llama 3's base frequency


def rope_tables(seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency), each [seq_len, head_dim]."""
    inv_freq = 1.0 / ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x [b, heads, s, d] by their position's angle, in one fused
    kernel as Megatron's apply_rope_fusion (fused.py)."""
    return fused.fused_rope(x, cos, sin)


class Attention(nn.Module):
    """Grouped-query attention: kv_heads key/value heads shared by heads/kv_heads query heads.

    Q, K and V come from one fused projection laid out per key/value group ([its query heads,
    its key, its value], as Megatron-Core's linear_qkv), so that column-parallel sharding keeps
    whole groups together and backward needs one tensor-parallel reduction, not three."""

    COLWISE, ROWWISE = ("wqkv",), ("wo",)

    def __init__(self, cfg: ModelConfig, recompute: str, hook: RecomputeHook,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        d = self.head_dim = cfg.head_dim
        self.group = cfg.heads // cfg.kv  # query heads per key/value head
        self.selective, self.hook = recompute == "selective", hook
        self.cp_group = None  # set by the tracer under context parallelism
        self.kind, self.dropout = cfg.attention, cfg.dropout
        self.wqkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv) * d, bias=False)
        self.wo = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)
        # ``rope``: the tables shared by every layer of the model chunk (one buffer, as torchtitan's
        # freqs_cis and Megatron-Core's RotaryEmbedding: not one copy a layer)
        cos, sin = rope if rope is not None else rope_tables(cfg.seq_len, d)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.wqkv(x)
        b, s, _ = qkv.shape  # the whole sequence, also when x is a sequence-parallel shard
        # -1: the local key/value groups once wqkv is column-parallel
        qkv = qkv.view(b, s, -1, self.group + 2, self.head_dim)
        q, k, v = qkv.split([self.group, 1, 1], dim=3)
        heads = lambda t: t.reshape(b, s, -1, self.head_dim).transpose(1, 2)  # noqa: E731
        cos, sin = self.cos[:s], self.sin[:s]
        q, k, v = apply_rope(heads(q), cos, sin), apply_rope(heads(k), cos, sin), heads(v)
        # each key/value head serves `group` query heads (torchtitan's repeat_kv materializes it)
        k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        y = attention_core(q, k, v, self.selective, self.hook, self.cp_group, self.kind, self.dropout)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: w2(silu(gate x) * up x), gate and up fused in one projection laid out per shard
    (as Megatron-Core's fc1), so each tensor-parallel rank holds matching slices of both."""

    COLWISE, ROWWISE = ("w13",), ("w2",)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
