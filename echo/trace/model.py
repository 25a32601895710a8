"""The reference models, built one pipeline chunk at a time: ``gpt`` (learned positions, GELU MLP,
LayerNorm) and ``llama`` (RoPE, SwiGLU, RMSNorm, grouped-query attention; see llama.py).

Plain PyTorch modules; tensor parallelism is applied afterwards with PyTorch's own DTensor
plans (tensor_parallel.py), so the attention code works on whatever heads are local. Each
attention and MLP module names its column- and row-parallel linears (COLWISE, ROWWISE) for it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from echo.config.workload import ModelConfig

RecomputeHook = Callable[[], AbstractContextManager]


def recomputed(fn: Callable, hook: RecomputeHook) -> Callable:
    """Activation checkpointing of ``fn`` whose second run (the recompute inside backward) runs
    under ``hook()``, so that the tracer labels those ops as recompute."""
    calls = [0]

    def run(*args):
        calls[0] += 1
        with hook() if calls[0] > 1 else nullcontext():
            return fn(*args)

    def checkpointed(*args):
        # Megatron-LM recomputes the whole layer; PyTorch's early stop would skip its tail
        with set_checkpoint_early_stop(False):
            return checkpoint(run, *args, use_reentrant=False)

    return checkpointed


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout as GPUs run it: native_dropout keeps a 1-byte mask for backward (the CPU's
    F.dropout keeps a scaled noise tensor in the input's dtype instead)."""
    return torch.native_dropout(x, p, True)[0] if p else x


def math_attention(q, k, v, p_drop: float) -> torch.Tensor:
    """Unfused causal attention: scores, masked softmax, dropout, PV (each its own kernel, and
    the s x s probabilities kept for backward, as Korthikanti et al. count them)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    s_q, s_k = scores.shape[-2:]
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
    probs = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.matmul(dropout(probs, p_drop), v)


def attention_core(q, k, v, selective: bool, hook: RecomputeHook, cp_group=None,
                   kind: str = "flash", dropout: float = 0.0) -> torch.Tensor:
    """Causal attention; selective recompute (Korthikanti et al.) re-runs it inside backward.

    Context parallelism (``cp_group``): each rank holds 1/cp of the sequence and all-gathers the
    keys and values of the whole sequence (Llama 3's all-gather CP; backward reduce-scatters their
    gradients). Its queries then attend to all keys; with Megatron's load-balanced assignment
    (chunks i and 2cp-1-i per rank) the causal work per rank is half of that block, which is what
    ``is_causal`` tells the kernel and the cost model (the mask's alignment is not modelled)."""
    if cp_group is not None:
        k = funcol.all_gather_tensor_autograd(k.contiguous(), 2, cp_group)
        v = funcol.all_gather_tensor_autograd(v.contiguous(), 2, cp_group)
    if kind == "math":
        core = lambda q, k, v: math_attention(q, k, v, dropout)  # noqa: E731
    else:
        core = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)  # noqa: E731
    return recomputed(core, hook)(q, k, v) if selective else core(q, k, v)


class Attention(nn.Module):
    """GPT attention: fused QKV (per-head [q, k, v] layout, as Megatron-LM) and an output projection."""

    COLWISE, ROWWISE = ("qkv",), ("proj",)

    def __init__(self, cfg: ModelConfig, recompute: str, hook: RecomputeHook):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.selective, self.hook = recompute == "selective", hook
        self.cp_group = None  # set by the tracer under context parallelism
        self.kind, self.dropout = cfg.attention, cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s, _ = qkv.shape  # the whole sequence, also when x is a sequence-parallel shard
        # -1: the local head count, hidden/heads/tp once qkv is column-parallel
        q, k, v = qkv.view(b, s, -1, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        y = attention_core(q, k, v, self.selective, self.hook, self.cp_group, self.kind, self.dropout)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    COLWISE, ROWWISE = ("fc1",), ("fc2",)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _parts(cfg: ModelConfig, recompute: str, hook: RecomputeHook, ep: int):
    """(norm class, attention, MLP) of one layer of ``cfg.arch``; a mixture of experts replaces
    the MLP when ``cfg.experts`` > 0."""
    from echo.trace import llama, moe

    if cfg.arch == "llama":
        norm, attn, mlp = nn.RMSNorm, llama.Attention(cfg, recompute, hook), llama.MLP
    else:
        norm, attn, mlp = nn.LayerNorm, Attention(cfg, recompute, hook), MLP
    return norm, attn, moe.MoE(cfg, ep) if cfg.experts else mlp(cfg)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, recompute: str = "none", hook: RecomputeHook = nullcontext, ep: int = 1):
        super().__init__()
        norm, self.attn, self.mlp = _parts(cfg, recompute, hook, ep)
        self.ln1, self.ln2 = norm(cfg.hidden), norm(cfg.hidden)
        self.full = recompute == "full"  # full recompute: only the layer input is kept
        self.hook, self.dropout = hook, cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self._layer, self.hook)(x) if self.full else self._layer(x)

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.ln1(x)))
        return x + self._drop(self.mlp(self.ln2(x)))

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.dropout)


class ModelChunk(nn.Module):
    """A run of consecutive layers of the model, with the embedding on the first chunk and the
    final norm + LM head on the last. Input: token ids (first chunk) or the previous chunk's
    hidden states; output: hidden states, or logits on the last chunk."""

    def __init__(self, cfg: ModelConfig, n_layers: int, *, first: bool, last: bool,
                 recompute: str = "none", hook: RecomputeHook = nullcontext, ep: int = 1):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
            # llama encodes positions with RoPE inside attention instead
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.arch == "gpt" else None
        self.blocks = nn.ModuleList(Block(cfg, recompute, hook, ep) for _ in range(n_layers))
        # (shard index, shards) of the sequence this rank holds; set by sequence parallelism
        self.seq_shard = (0, 1)
        if last:
            self.ln_f = (nn.RMSNorm if cfg.arch == "llama" else nn.LayerNorm)(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x)
            if self.pos_emb is not None:
                # under sequence parallelism x holds one shard of the sequence: its own positions
                index, _ = self.seq_shard
                pos = torch.arange(x.shape[1], device=x.device) + index * x.shape[1]
                x = x + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


GPTChunk = ModelChunk  # the name other modules used before llama joined
