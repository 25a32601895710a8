"""The reference models, built one pipeline chunk at a time: ``gpt`` (learned positions, GELU MLP,
LayerNorm) and ``llama`` (RoPE, SwiGLU, RMSNorm, grouped-query attention; see llama.py).

Plain PyTorch modules; tensor parallelism is applied afterwards with PyTorch's own DTensor
plans (tensor_parallel.py), so the attention code works on whatever heads are local. Each
attention and MLP module names its column- and row-parallel linears (COLWISE, ROWWISE) for it.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from echo.config.workload import ModelConfig, Workload
from echo.training import fused, llama, moe
from echo.training.layers import RecomputeHook, attention_core, dropout_add, recomputed
from echo.training.layout import chunk_slots

# fp8: the linears of the blocks run in FP8 (fp8.py), everything else in bf16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16}

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


def _parts(cfg: ModelConfig, recompute: str, hook: RecomputeHook, ep: int, rope=None):
    """(norm class, attention, MLP) of one layer of ``cfg.arch``; a mixture of experts replaces
    the MLP when ``cfg.experts`` > 0. ``rope``: llama's RoPE tables, shared by the chunk's layers."""
    if cfg.arch == "llama":
        norm, attn, mlp = nn.RMSNorm, llama.Attention(cfg, recompute, hook, rope), llama.MLP
    else:
        norm, attn, mlp = nn.LayerNorm, Attention(cfg, recompute, hook), MLP
    return norm, attn, moe.MoE(cfg, ep) if cfg.experts else mlp(cfg)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, recompute: str = "none", hook: RecomputeHook = nullcontext, ep: int = 1,
                 rope=None):
        super().__init__()
        norm, self.attn, self.mlp = _parts(cfg, recompute, hook, ep, rope)
        self.ln1, self.ln2 = norm(cfg.hidden), norm(cfg.hidden)
        self.full = recompute == "full"  # full recompute: only the layer input is kept
        self.hook, self.dropout = hook, cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recomputed(self._layer, self.hook)(x) if self.full else self._layer(x)

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        x = dropout_add(self.attn(self.ln1(x)), x, self.dropout)
        return dropout_add(self.mlp(self.ln2(x)), x, self.dropout)


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
        rope = llama.rope_tables(cfg.seq_len, cfg.head_dim) if cfg.arch == "llama" and n_layers else None
        self.blocks = nn.ModuleList(Block(cfg, recompute, hook, ep, rope) for _ in range(n_layers))
        # (shard index, shards) of the sequence this rank holds; set by sequence parallelism
        self.seq_shard = (0, 1)
        if last:
            self.ln_f = (nn.RMSNorm if cfg.arch == "llama" else nn.LayerNorm)(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def set_groups(self, groups: dict) -> None:
        """Hand the attention its context-parallel group and the experts their expert-parallel one."""
        for block in self.blocks:
            block.attn.cp_group = groups["cp"]
            if hasattr(block.mlp, "ep_group"):
                block.mlp.ep_group = groups["ep"]

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



def chunk_buffer_bytes(w: Workload, pp_rank: int) -> int:
    """What the buffers of ``build_chunks(w, pp_rank)`` hold, without building them (a rank
    composed from layer templates, echo.trace.compose): a llama chunk with layers keeps one pair of
    RoPE tables, cos and sin, fp32 [seq_len, head_dim] each (``ModelChunk``); Hugging Face and
    custom modules are not composed (echo.trace.template refuses them)."""
    if w.model.arch != "llama":
        return 0
    slots = chunk_slots(w.parallel, w.model.layers, pp_rank)
    return sum(2 * w.model.seq_len * w.model.head_dim * 4 for slot in slots if slot.layers)


def build_chunks(w: Workload, pp_rank: int, hook: RecomputeHook = nullcontext) -> list[nn.Module]:
    """The model chunks of pipeline rank ``pp_rank`` (one per virtual stage, interleaved layout:
    chunk c holds virtual stage c * pp + pp_rank), as the tracer and the real runs build them;
    ``hook`` labels recomputed ops (the tracer's recorder). A Hugging Face config is built by
    transformers (hf.py)."""
    if w.model.arch == "hf":
        from echo.training.hf import build_hf_chunks  # transformers is imported only for such models

        return build_hf_chunks(w, pp_rank, hook)
    if w.model.arch == "module":
        from echo.training.custom import build_module_chunks

        return build_module_chunks(w, pp_rank, hook)
    chunks = [ModelChunk(w.model, len(slot.layers), first=slot.first, last=slot.last,
                         recompute=w.training.recompute, hook=hook, ep=w.parallel.ep)
              for slot in chunk_slots(w.parallel, w.model.layers, pp_rank)]
    for chunk in chunks:  # Llama's RMSNorms as the one fused kernel a GPU runs (fused.py)
        fused.fuse_rms_norms(chunk)
    return chunks
