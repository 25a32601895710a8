"""Peak memory per rank, term by term, with hand-computed numbers (echo.training.data_parallel,
echo.trace.meter, echo.simulate.summary), and against torchtitan's measured peaks
(echo.validate.memory, slow: it traces Llama 3.1 8B to 405B)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.autograd.graph import saved_tensors_hooks

from echo.config.loader import load_workload
from echo.simulate import summary
from echo.simulate.stage import communicators
from echo.trace.meter import LARGE_BUFFER, SMALL_BUFFER, CachingAllocator, MemoryMeter, replay
from echo.training import data_parallel
from echo.training.schedule import in_flight, stage_orders

MIB, GIB = 1 << 20, 1 << 30
BF16 = torch.bfloat16


# --- state: parameters, gradients, optimizer ---------------------------------------------------
@pytest.mark.parametrize("zero, dp, expect", [
    (0, 4, (2000, 4000, 12000)),   # bf16 params, fp32 main grads, fp32 master + Adam m, v: 18 B
    (1, 4, (2000, 4000, 3000)),    # distributed optimizer: (4 + 8) / dp
    (2, 4, (2000, 1000, 3000)),    # gradients sharded too
])
def test_megatron_state_per_parameter(zero, dp, expect):
    m = data_parallel.memory_model(1000, BF16, zero, dp)
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == expect


@pytest.mark.parametrize("zero, expect", [(0, (2000, 2000, 12000)), (1, (2000, 2000, 3000)), (2, (2000, 500, 3000))])
def test_bf16_gradient_buffers_hold_half(zero, expect):
    """grad_reduce_in_fp32 off (the Megatron-Bridge performance presets): 2 B per gradient; the
    optimizer's fp32 copy of its shard is not held through forward and backward."""
    m = data_parallel.memory_model(1000, BF16, zero, 4, grad_dtype=BF16)
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == expect


def test_fp32_training_has_no_master_copy():
    m = data_parallel.memory_model(1000, torch.float32, 1, 4)
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (4000, 4000, 2000)


def test_fsdp2_state_and_the_stage_kept_gathered_under_pp():
    # a 250-element shard: fp32 params, fp32 grads, Adam m and v (16 B)
    m = data_parallel.memory_model(250, BF16, 3, 4)
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (1000, 1000, 2000)
    # under PP torchtitan keeps the 1000 gathered elements (bf16) and their fp32 gradient accumulators
    m = data_parallel.memory_model(250, BF16, 3, 4, unsharded=1000)
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (1000 + 2000, 1000 + 4000, 2000)


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Parameter(torch.zeros(1000))
        self.expert = nn.Parameter(torch.zeros(600))
        self.expert.echo_expert = True


def test_expert_optimizer_state_shards_over_the_expert_data_parallel_group():
    # TP2 x CP2 x DP4, EP4: dense state shards over dp x cp = 8, experts over edp = 2*2*4/4 = 4
    p = SimpleNamespace(tp=2, cp=2, dp=4, ep=4, zero=1)
    m = data_parallel.rank_memory([_Experts()], {"dp": None, "dpcp": None, "edp": None}, p, BF16)
    assert m.param_bytes == 2 * 1600 and m.grad_bytes == 4 * 1600
    assert m.optimizer_bytes == 12 * 1000 // 8 + 12 * 600 // 4


def test_fp8_parameter_gathers_drop_the_bf16_weight():
    w = torch.zeros(64, 32, dtype=BF16)
    state = SimpleNamespace(fp8_gather=True, weights={0: (w, ())})
    assert data_parallel.fp8_primary_savings(state, 1) == 2 * 64 * 32
    assert data_parallel.fp8_primary_savings(state, 3) == 0  # torchao under FSDP keeps no FP8 weight
    assert data_parallel.fp8_primary_savings(SimpleNamespace(fp8_gather=False, weights=state.weights), 1) == 0


def test_rope_tables_are_one_buffer_of_the_chunk_held_as_state():
    """A llama chunk's layers share one pair of RoPE tables (torchtitan's one freqs_cis buffer,
    Megatron-Core's one RotaryEmbedding), state beside the parameters: 2 x seq x head dim fp32."""
    from echo.config.workload import ModelConfig
    from echo.training.model import ModelChunk

    cfg = ModelConfig.model_validate({"arch": "llama", "layers": 3, "hidden": 64, "heads": 4, "kv_heads": 2,
                                      "ffn_hidden": 128, "vocab": 100, "seq_len": 32})
    chunk = ModelChunk(cfg, 3, first=True, last=True)
    assert len({b.attn.cos.untyped_storage()._cdata for b in chunk.blocks}) == 1
    assert data_parallel.buffer_bytes([chunk]) == 2 * 32 * 16 * 4  # cos and sin, [32, 64 / 4] each


def test_a_buffer_read_in_the_step_is_not_working_memory():
    # the step slices a 4 MiB buffer (a RoPE table) and computes 1 MiB from it: only the 1 MiB
    # result is the micro-batch's; the buffer is state (the meter is given it with the parameters)
    with FakeTensorMode(allow_non_fake_inputs=True):
        table = torch.empty(4 * MIB // 4)
        meter = MemoryMeter([table])
        with meter, meter.functions():
            y = table[: MIB // 4] * 2
            meter.end_chunk()
            meter.end_forward()
            del y
        assert meter.finish().peak_bytes == MIB


# --- activations and working memory: the meter ---------------------------------------------------
def _meter(fn, **kw):
    """Run ``fn`` (building its tensors) under fake tensors with a meter around it."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        meter = MemoryMeter([], **kw)
        with meter, meter.functions(), saved_tensors_hooks(meter.pack, lambda t: t):
            out = fn()
            meter.end_chunk()
            meter.end_forward()
            if out is not None:
                out.backward()
        return meter.finish()


def test_saved_activations_and_the_working_peak():
    # x (4 MiB fp32) -> y = x * 2 (not saved) -> z = exp(y) (saves its 4 MiB output) -> sum
    def step():
        x = torch.empty(MIB, requires_grad=True)
        return (x * 2).exp().sum()
    used = _meter(step)
    assert used.saved_bytes == 4 * MIB
    # forward: x, y and z alive together; backward: z, the gradient of z and of y (+ two scalars)
    assert used.peak_bytes == pytest.approx(12 * MIB, abs=64)
    assert used.chunk_bytes == (4 * MIB,)
    # the allocator serves the three 4 MiB tensors from one 20 MiB segment, the scalars from 2 MiB
    assert used.reserved_bytes - used.peak_bytes == pytest.approx(LARGE_BUFFER + SMALL_BUFFER - 12 * MIB, abs=2048)


def test_fused_rmsnorm_keeps_its_input_and_one_fp32_per_row():
    norm = nn.RMSNorm(256, dtype=BF16)

    def step():
        x = torch.empty(8, 128, 256, dtype=BF16, requires_grad=True)
        return norm(x).float().sum()
    # the CPU composite saves fp32 copies (2 x 4 B per element); the CUDA kernel: input + 1/rms
    assert _meter(step).saved_bytes == 8 * 128 * 256 * 2 + 8 * 128 * 4


def test_fused_swiglu_keeps_gate_and_up_only():
    def step():
        h = torch.empty(64, 2 * 512, dtype=BF16, requires_grad=True)
        gate, up = h.chunk(2, dim=-1)
        return (F.silu(gate) * up).float().sum()
    # h (the fc1 output, gate and up) is kept; silu(gate) is not; the product is not saved here
    assert _meter(step).saved_bytes == 64 * 1024 * 2


@pytest.mark.parametrize("native, expect", [(True, 128 + 2 * 32 + 128), (False, 128 + 2 * 128 + 128)])
def test_grouped_keys_and_values(native, expect):
    # 8 query heads, 2 key/value heads repeated 4x before the attention kernel; 16 KiB per head (64 x 128 bf16)
    def step():
        q = torch.empty(1, 8, 64, 128, dtype=BF16, requires_grad=True)
        kv = torch.empty(1, 2, 64, 128, dtype=BF16, requires_grad=True)
        q2, k = q * 1, kv.repeat_interleave(4, dim=1)
        v = kv.repeat_interleave(4, dim=1)
        return F.scaled_dot_product_attention(q2, k, v, is_causal=True).float().sum()
    used = _meter(step, native_gqa=native, gqa=4)
    lse = 8 * 64 * 4  # the kernel's fp32 log-sum-exp per query row
    # q, k, v (expanded, or as the kernel reads them: 1/4) and the output
    assert used.saved_bytes == expect * 1024 + lse


def test_attention_output_reshape_is_a_view_on_a_gpu():
    def step():
        q = torch.empty(1, 8, 64, 128, dtype=BF16, requires_grad=True)
        y = F.scaled_dot_product_attention(q * 1, q * 1, q * 1, is_causal=True)
        z = y.transpose(1, 2).reshape(1, 64, 8 * 128)  # a copy on the CPU, a view of [b, s, h, d] on CUDA
        return (z * z).float().sum()
    # q2, k2, v2, the kernel's output and log-sum-exp, and (for z * z) z itself, which is y's bytes
    assert _meter(step).saved_bytes == 4 * 128 * 1024 + 8 * 64 * 4


# --- the caching allocator ----------------------------------------------------------------------
def test_allocator_segments_and_fragmentation():
    a = CachingAllocator()
    assert a.round_size(1) == 512 and a.round_size(1000) == 1024
    b = a.malloc(1000)
    assert a.reserved == SMALL_BUFFER  # small requests share 2 MiB segments
    a.release(b)
    a.malloc(5 * MIB)
    assert a.reserved == SMALL_BUFFER + LARGE_BUFFER  # 1-10 MiB: a 20 MiB segment
    # logits (8), their fp32 copy (16), log-softmax (16); the first two freed; two more 16s
    a = CachingAllocator()
    x, y, _ = a.malloc(8 * GIB), a.malloc(16 * GIB), a.malloc(16 * GIB)
    a.release(x), a.release(y)
    a.malloc(16 * GIB), a.malloc(16 * GIB)
    assert a.peak_allocated == 48 * GIB and a.reserved == 56 * GIB  # the freed 8 GiB segment stays


def test_expandable_segments_extend_a_free_tail():
    for expandable, reserved in ((False, 40 * GIB), (True, 24 * GIB)):
        a = CachingAllocator(expandable)
        x = a.malloc(16 * GIB)
        a.release(x)
        a.malloc(24 * GIB)  # a new 24 GiB segment, or the freed 16 GiB extended by 8
        assert a.reserved == pytest.approx(reserved, abs=LARGE_BUFFER)


def test_replay_warms_the_cache_once():
    events = [(0, 8 * GIB), (1, 16 * GIB), (0, -8 * GIB), (2, 16 * GIB), (1, -16 * GIB), (2, -16 * GIB)]
    assert replay(events, repeats=1).peak_reserved == replay(events, repeats=3).peak_reserved == 40 * GIB


# --- the rank's peak ------------------------------------------------------------------------------
def test_rank_breakdown_terms():
    order = stage_orders("interleaved", 4, 8, 2)[0]
    assert in_flight(order) == 11  # 2 * 3 + (2 - 1) * 4 + 1 chunk-micro-batches
    b = summary.rank_breakdown(state=10 * GIB, activation=2 * GIB, peak=3 * GIB, reserved=3.5 * GIB,
                               chunk_activation=(), communicators=3, chunks=2, order=order)
    assert b.activations == 11 * GIB  # 1 GiB per chunk-micro-batch
    assert b.working == 1 * GIB and b.fragmentation == 0.5 * GIB
    assert b.allocator == (10 + 11 + 1 + 0.5) * GIB
    nccl = 3 * summary.NCCL_CHANNELS * summary.NCCL_PEERS_PER_CHANNEL * summary.NCCL_CONNECTION_BYTES
    assert summary.NCCL_CONNECTION_BYTES == 4 * MIB + 4_915_200 + 512 * 1024
    assert b.framework == 32 * MIB + nccl and b.device == b.allocator + b.framework


def test_per_chunk_activations_follow_the_order():
    # the last chunk holds the loss (3 GiB), the first 1 GiB: stage 3 of PP4 x 2 chunks
    order = stage_orders("interleaved", 4, 8, 2)[3]
    even = summary.activations_in_flight(4 * GIB, (), 2, order)
    split = summary.activations_in_flight(4 * GIB, (1 * GIB, 3 * GIB), 2, order)
    held = peak = 0
    for t in order:
        held += (1, 3)[t.chunk] * (1 if t.kind == "F" else -1)
        peak = max(peak, held)
    assert split == peak * GIB and even == in_flight(order) * 2 * GIB


def test_communicators_of_a_rank():
    comms = [{"group": [0, 1, 2, 3], "peer": -1}, {"group": [0, 1, 2, 3], "peer": -1},
             {"group": [0, 4], "peer": -1}, {"group": [0, 8], "peer": 8}, {"group": [0, 8], "peer": 8}]
    assert communicators(comms) == 3  # two groups and one p2p peer


# --- against torchtitan's measurements -------------------------------------------------------------
# The rows CI traces (Llama 3.1 8B and 70B: a few minutes; the 405B rows are reported by
# `python -m echo.validate.memory torchtitan`), each with the bound it meets and, where that is
# above the 5%, the known gap next to it.
TITAN_BOUNDS = {
    # FSDP x CP (dp_shard_cp): within 5% since the RoPE tables are one buffer of the model, held
    # as state (they were one per layer, working memory, 1 GiB a CP degree at 32K tokens a rank)
    ("T2", 8, 1): (0.05, ""), ("T2", 4, 2): (0.05, ""), ("T2", 2, 4): (0.05, ""), ("T2", 1, 8): (0.05, ""),
    # 70B FSDP32 x TP8, local batch 16 under full AC: 7-12% under, cause not found (the fp32 loss
    # on the vocabulary-parallel logits is traced; AsyncTP's symmetric-memory buffers are not)
    ("T4", 32, 1): (0.16, "unexplained"),
}


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(TITAN_BOUNDS), ids=lambda k: f"{k[0]}-fsdp{k[1]}-cp{k[2]}")
def test_torchtitan_rows_within_their_bound(key, reference):
    from echo.validate.memory import TORCHTITAN, predict, torchtitan_rows

    bound, _ = TITAN_BOUNDS[key]
    rows = [r for r in torchtitan_rows() if (r["table"], int(r["FSDP"]), int(r["CP"])) == key]
    assert rows
    for r in rows:
        name, _ = TORCHTITAN[(r["table"], r["techniques"], int(r["FSDP"]), int(r["CP"]))]
        got = predict(load_workload(name)).reserved_gib
        measured = float(r["memory_GiB"])
        assert abs(got / measured - 1) <= bound, (r["techniques"], got, measured)


def test_every_torchtitan_row_is_mapped_to_a_workload_or_a_reason(reference):
    from echo.config.loader import load_workload
    from echo.validate.memory import TORCHTITAN, torchtitan_rows

    rows = torchtitan_rows()
    keys = {(r["table"], r["techniques"], int(r["FSDP"]), int(r["CP"])) for r in rows}
    assert keys == set(TORCHTITAN)
    for r in rows:
        name, note = TORCHTITAN[(r["table"], r["techniques"], int(r["FSDP"]), int(r["CP"]))]
        assert note
        if name is None:
            continue
        w = load_workload(name)  # the workload states the row's layout
        p, t = w.parallel, w.training
        assert (p.dp, p.tp, p.pp, p.cp, p.zero) == (int(r["FSDP"]), int(r["TP"]), int(r["PP"]), int(r["CP"]), 3)
        assert t.micro_batch * w.micro_batches == int(r["local_bs"]) and t.recompute == r["AC"]
        assert w.model.seq_len == int(r["seq_len_stated"] or r["seq_len_config_default"])
