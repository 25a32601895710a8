"""Time of one flash-attention kernel (forward or backward) on a GPU.

A flash kernel (FlashAttention-2/3/4, cuDNN) gives each CTA one block of 128 queries (forward) or
128 keys (backward) of one (batch, head) and loops over the other side's blocks of 128. One loop
iteration runs the block's GEMMs (forward QK^T and PV: 4*128*128*d FLOPs; backward five GEMMs,
2.5x that) and the softmax on the 128 x 128 scores, whose exp/max/rescale work is counted as
``softmax_headdim`` extra head-dim columns of MMA work:

    iteration = mult * 4 * 128 * 128 * (d + softmax_headdim) / (peak/SMs * gemm.bf16.peak_fraction * vs_gemm)
    CTA       = cta_us + iterations * iteration
    non-causal: time = launch + ceil(CTAs / SMs) * CTA            (equal CTAs, in waves)
    window w:   as causal, the i-th CTA looping over min(i + 1, ceil(w / 128) + 1) blocks: the
                ones its band touches (echo::sliding_attention)
    causal:     time = launch + max(sum of CTAs / SMs, longest CTA)  (block i of a head loops over i+1
                blocks; the scheduler starts the longest first, so the SMs stay evenly loaded)

and a kernel is never faster than streaming its bytes at the achievable HBM bandwidth. The backward
adds its two side kernels (preprocess D = rowsum(dO * O); dQ from its fp32 accumulator): a launch
each and their bytes at the achievable bandwidth (aux_bytes). The
parameters (Hardware.compute_model.attention: vs_gemm, cta_us per direction, softmax_headdim) are
fitted on measured FlashAttention-3 (Hopper) / FlashAttention-4 (Blackwell) times (echo.fit.kernels).
An FP8 flash kernel runs ``fp8_speedup`` times the bf16 rate. Grouped-query attention costs what
the query heads cost (K/V heads only change the bytes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

BLOCK = 128          # queries (forward) / keys (backward) per CTA, and the inner loop's block
BWD_GEMM_RATIO = 2.5  # the backward's five GEMMs against the forward's two (FlashAttention's convention)


@dataclass(frozen=True)
class AttentionCall:
    """One flash-attention call: (batch, query heads, query and key lengths, head dim), its direction."""

    batch: int
    heads: int
    s_q: int
    s_k: int
    head_dim: int
    backward: bool
    causal: bool
    fp8: bool
    window: int = 0  # sliding window (keys a query sees, itself included); 0: the whole causal triangle


def attention_call(name: str, args_json: str, causal: bool) -> AttentionCall | None:
    """The AttentionCall of a traced call (q, k, v as 4-D (batch, heads, seq, dim); the backward
    takes grad_out first), None when its shapes are not those."""
    try:
        args = json.loads(args_json).get("args", [])
    except (TypeError, ValueError, AttributeError):
        return None
    backward = "backward" in name
    q_at = 1 if backward else 0
    tensors = [a for a in args[q_at:q_at + 2] if isinstance(a, dict) and "T" in a]
    if len(tensors) < 2 or len(tensors[0]["T"]) != 4 or len(tensors[1]["T"]) != 4:
        return None
    (b, h, s_q, d), s_k = tensors[0]["T"], tensors[1]["T"][-2]
    window = 0
    if "sliding_attention" in name:  # echo::sliding_attention(q, k, v, window), its backward (grad, q, k, v, out, lse, window)
        at = 6 if backward else 3
        window = int(args[at]) if len(args) > at and isinstance(args[at], (int, float)) else 0
        causal = True
    return AttentionCall(b, h, s_q, s_k, d, backward, causal, tensors[0]["dt"].startswith("float8"), window)


def ctas(call: AttentionCall) -> int:
    """CTAs of the kernel: (batch x heads) x blocks of queries (forward) or keys (backward)."""
    return call.batch * call.heads * math.ceil((call.s_k if call.backward else call.s_q) / BLOCK)


def aux_bytes(call: AttentionCall) -> float:
    """Bytes of the backward's two side kernels (FlashAttention-2/3): the preprocess reads O and dO
    (bf16) and writes D = rowsum(dO * O) (fp32); the fp32 dQ accumulator is zeroed, and read back by
    the postprocess, which writes dQ in bf16. The forward has none."""
    if not call.backward:
        return 0.0
    elements = call.batch * call.heads * call.s_q * call.head_dim
    return elements * (2 + 2 + 4 + 4 + 2) + call.batch * call.heads * call.s_q * 4


def attention_time(att, gemm_fraction: float, peak_tflops: float, sms: int, launch_us: float,
                   call: AttentionCall, hbm_GBps: float) -> float:
    """Compute-side duration (microseconds) of ``call`` under the AttentionModel ``att``, with the
    GPU's bf16 GEMM main-loop fraction ``gemm_fraction``; the backward adds its two side kernels
    (aux_bytes at the achievable ``hbm_GBps``, a launch each). The main kernel's memory floor is
    the caller's."""
    vs_gemm = att.bwd_vs_gemm if call.backward else att.fwd_vs_gemm
    rate = peak_tflops * 1e12 / sms * gemm_fraction * vs_gemm  # one SM's MMA rate, FLOP/s
    if call.fp8:
        rate *= att.fp8_speedup
    mult = BWD_GEMM_RATIO if call.backward else 1.0
    iteration = mult * 4.0 * BLOCK * BLOCK * (call.head_dim + att.softmax_headdim) / rate * 1e6
    cta_us = att.bwd_cta_us if call.backward else att.fwd_cta_us
    outer = math.ceil((call.s_k if call.backward else call.s_q) / BLOCK)  # CTAs per head
    inner = math.ceil((call.s_q if call.backward else call.s_k) / BLOCK)  # iterations of a full CTA
    heads = call.batch * call.heads
    side = 2 * launch_us + aux_bytes(call) / (hbm_GBps * 1e3) if call.backward else 0.0
    if not call.causal:
        return side + launch_us + math.ceil(heads * outer / sms) * (cta_us + inner * iteration)
    if call.window:
        # a sliding window: every CTA loops over the blocks its band touches, window / 128 + 1 at
        # most (the first ones fewer; counted whole, as the masked edge blocks are computed whole)
        band = min(inner, math.ceil(call.window / BLOCK) + 1)
        # the i-th CTA of a head loops over min(i + 1, band) blocks (the band meets the diagonal);
        # a window as long as the sequence is the causal triangle below
        iterations = (band * outer - band * (band - 1) / 2) / outer
        total = heads * outer * (cta_us + iterations * iteration)
        return side + launch_us + max(total / sms, cta_us + band * iteration)
    # causal: the i-th of n blocks loops over i+1 of the other side's blocks (square case; a
    # rectangular mask is scaled to the same triangle)
    iterations = inner * (outer + 1) / 2 / outer
    total = heads * outer * (cta_us + iterations * iteration)
    return side + launch_us + max(total / sms, cta_us + inner * iteration)
