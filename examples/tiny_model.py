"""A user's own model, traced by Echo: a small pre-norm decoder (causal self-attention with a fused
QKV projection, a GELU MLP, LayerNorm), written as plain PyTorch with no Echo imports.

A workload names the builder and its arguments (config/workloads/example-module.yaml):

    model:
      module: examples/tiny_model.py:build     # a file (relative to the repository root) and a function
      module_args: {layers: 4, hidden: 256, heads: 8, vocab: 1024}
      layers: 4
      hidden: 256
      heads: 8
      vocab: 1024
      seq_len: 128

What Echo needs of the returned module (echo/training/custom.py): ``tok_emb`` (the token embedding),
``blocks`` (an nn.ModuleList of layers, each ``block(x) -> x`` on [batch, seq, hidden]), ``ln_f``
and ``head`` (final norm and LM head), and optionally ``tp_plan``: linear name inside a block ->
"colwise" | "rowwise", for tensor parallelism. Code that reshapes heads must use -1 for the head
count, so that it works on the heads a tensor-parallel rank holds.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the heads this rank holds once qkv is column-parallel
        q, k, v = self.qkv(self.norm1(x)).view(b, s, -1, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyDecoder(nn.Module):
    # Megatron's split: the input projections column-parallel, the output projections row-parallel
    tp_plan = {"qkv": "colwise", "proj": "rowwise", "up": "colwise", "down": "rowwise"}

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)


def build(layers: int = 4, hidden: int = 256, heads: int = 8, vocab: int = 1024) -> nn.Module:
    return TinyDecoder(layers, hidden, heads, vocab)
