"""Multi-head latent attention (DeepSeek-V3's MLA) with Megatron-Core's ``mla_up_proj`` recompute.

MLA compresses each token's queries and keys/values into small latents (``q_lora_rank`` 1536,
``kv_lora_rank`` 512) and expands them per head with two up-projections (``q_b_proj``,
``kv_b_proj``) before the attention kernel. Without recompute the kernel keeps the expanded
queries, keys and values for its backward: 128 heads x (192 + 192 + 128) values per token, far
more than the latents. Megatron-Core's ``--recompute-modules mla_up_proj`` keeps the latents only:
the up-projections and RoPE run again in backward, right before the attention kernel's backward
needs their outputs (CheckpointWithoutOutput, ``layers.RecomputedOutputs``).

``mla_forward`` is transformers' DeepseekV3Attention.forward (transformers 5.23, pinned) with the
up-projection part factored out so that it can run again; its ops in forward are transformers'
(tests/test_recompute_modules.py checks it), both down-projections first as in Megatron-Core, and the value heads are padded to the
query head size for the CPU's attention kernel here rather than in ``hf._echo_attention`` (marked
``echo_head_dim``, so the memory meter and the output cut know their own size).
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from echo.training.layers import RecomputedOutputs


def pad_value(value: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """(value heads padded to ``width``, their own size d_v). MLA's q/k heads are wider than its v
    heads (DeepSeek: 192 and 128) and the CPU's attention kernel takes one head size, so v is padded
    and the output cut back, as transformers' own flash-attention path does for MLA; the padded
    tensor carries ``echo_head_dim`` so the memory meter (meter.KERNELS) counts it at d_v, and a
    value padded already (by ``mla_forward``) is passed through."""
    d_v = getattr(value, "echo_head_dim", None) or value.shape[-1]
    if value.shape[-1] < width:
        value = F.pad(value, [0, width - value.shape[-1]])
        value.echo_head_dim = d_v
    return value, d_v


def is_mla(attn: nn.Module) -> bool:
    """A transformers MLA attention module (DeepSeek-V2 / V3 layout)."""
    return all(hasattr(attn, n) for n in ("kv_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "expand_kv"))


def recompute_up_projections(attn: nn.Module, outputs: RecomputedOutputs) -> None:
    """Give ``attn`` the forward whose expanded queries, keys and values are not kept."""
    attn.echo_outputs = outputs
    attn.forward = types.MethodType(mla_forward, attn)


def _rope(self):
    modeling = sys.modules[type(self).__module__]  # hf.py may have given it the fused RoPE
    return modeling.apply_rotary_pos_emb_interleave if self.config.rope_interleave else modeling.apply_rotary_pos_emb


def mla_forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, past_key_values=None, **kwargs):
    batch_size, seq_length = hidden_states.shape[:-1]
    query_shape = (batch_size, seq_length, -1, self.qk_head_dim)
    # the latents (kept: the up-projections' inputs)
    q_latent = hidden_states if self.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(hidden_states))
    q_up = self.q_proj if self.q_lora_rank is None else self.q_b_proj
    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope).view(batch_size, 1, seq_length, self.kv_lora_rank)
    k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)
    cos, sin = position_embeddings

    def up() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_states = q_up(q_latent).view(query_shape).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_rot, k_rope = _rope(self)(q_rot, k_rot, cos, sin)
        query = torch.cat((q_pass, q_rot), dim=-1)
        key, value = self.expand_kv(kv_nope, k_rope)
        return query, key, pad_value(value, query.shape[-1])[0]

    query, key, value = up()
    outputs = getattr(self, "echo_outputs", None)
    if outputs is not None:
        again: list = []  # one recompute serves the three (the first reader's backward runs it)

        def part(i: int):
            if not again:
                again.append(up())
            return again[0][i]
        query, key, value = (outputs.keep(t, lambda i=i: part(i)) for i, t in enumerate((query, key, value)))
    attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    attn_output, attn_weights = attention(self, query, key, value, attention_mask,
                                          dropout=0.0 if not self.training else self.attention_dropout,
                                          scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
    return self.o_proj(attn_output), attn_weights
