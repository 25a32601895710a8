"""Cost guards: a workload whose trace could not finish is refused while the config loads.

The tracer builds every layer of a role's pipeline chunks as modules (on fake tensors, but each
one a Python object with its parameters' metadata) and records every op they run, so its time and
host memory grow with the layers a role holds; dedup's table and the simulator grow with the world
size. A typo (``layers: 1000000000``) used to pass validation and trace for hours. The limits
below admit every real model up to 10 trillion parameters on up to a million GPUs, with room:

- ``model.layers``: at most MAX_LAYERS_PER_ROLE per traced role (layers / pp; the largest
  published dense model has 126 layers in all, DeepSeek-V3 61),
- the whole model: at most MAX_PARAMETERS (estimated from the shape: attention 2h(h + kv·d),
  MLP 2 or 3 x h x ffn per expert, embeddings V x h, input and output),
- ``parallel``: a world of at most MAX_WORLD ranks (which also bounds dedup's rank table: one
  row per rank, about 100 bytes each, 0.2 GB at the limit),
- the simulator's full mode (full_mode_estimate): at most MAX_FULL_MODE_GIB of memory and
  MAX_FULL_MODE_HOURS, from the events it would replay (ranks x micro-batches x ops of a role);
  symmetric mode, one timeline per pipeline stage, has no limit,
- the trace itself (trace_estimate): at most MAX_TRACE_WORKER_GIB of host memory per tracing
  process and MAX_TRACE_HOURS of tracing on one core, from the ops the roles would record.

Each limit can be raised for one run with an environment variable of the same name prefixed
``ECHO_`` (``ECHO_MAX_LAYERS_PER_ROLE=50000``), for a machine that can afford it.
"""

from __future__ import annotations

import os

MAX_LAYERS_PER_ROLE = 20_000
MAX_PARAMETERS = 2e13
MAX_WORLD = 2**21  # 2,097,152 ranks
MAX_TRACE_WORKER_GIB = 64.0
MAX_TRACE_HOURS = 24.0
# The simulator's full mode replays every rank's programs (symmetric mode one per pipeline stage);
# checked while the DAG is built (echo.workflow.params) and again by the stage.
MAX_FULL_MODE_GIB = 32.0
MAX_FULL_MODE_HOURS = 2.0

# The trace's cost, measured on this 2-core machine (2026-12-04). Per op, by
# benchmarks/bench_trace_cost.py: a GPT of 64 / 512 / 2,048 layers in one role records 1,952 /
# 15,419 / 61,589 ops in 2.2 / 14.0 / 62.4 s, the worker peaking at 418 / 493 / 758 MB. Per role
# (a worker process's start, imports and writing), from the workflow's trace benchmarks of the
# many-role SC21 rows: 64 / 35 / 16 roles in 200 / 107 / 55 s on 2 cores, 6.1-6.9 s a role.
TRACE_SECONDS_PER_ROLE = 6.0
TRACE_SECONDS_PER_OP = 1.0e-3
TRACE_WORKER_BASE_GIB = 0.40
TRACE_BYTES_PER_OP = 6.0e3
# Ops one layer records per role (forward, backward, recompute of one micro-batch template): the
# shipped traces record 30-151 (dense GPT about 35-90, MoE and FP8 up to 151, Qwen3-235B); the
# guard takes more than the upper end, so it over-estimates rather than admit what cannot finish.
TRACE_OPS_PER_LAYER = 160

# Full mode's cost, fitted by benchmarks/bench_full_mode.py on this machine (2026-12-04; a GPT at
# TP2 PP2, 8 to 1,024 ranks, 4 to 32 micro-batches, 118 and 335 ops a role: 0.03 to 7.7 s, 0.44 to
# 1.2 GB). Time: per rank x micro-batch x op replayed, and per rank x its data-parallel group's size
# (a collective's rendezvous visits each member: 1,024 ranks at DP256 spend most of their 7.7 s
# there). Memory: the programs each rank keeps (relabelled copies of its class's) and the timeline.
FULL_SECONDS_PER_EVENT_OP = 3.5e-6
FULL_SECONDS_PER_RANK_MEMBER = 2.3e-5
FULL_BASE_GIB = 0.45
FULL_BYTES_PER_RANK_OP = 1.2e3
FULL_BYTES_PER_EVENT_OP = 0.2e3


def limit(name: str) -> float:
    """A limit's value, from ECHO_<name> when set."""
    default = {"MAX_LAYERS_PER_ROLE": MAX_LAYERS_PER_ROLE, "MAX_PARAMETERS": MAX_PARAMETERS,
               "MAX_WORLD": MAX_WORLD, "MAX_TRACE_WORKER_GIB": MAX_TRACE_WORKER_GIB,
               "MAX_TRACE_HOURS": MAX_TRACE_HOURS, "MAX_FULL_MODE_GIB": MAX_FULL_MODE_GIB,
               "MAX_FULL_MODE_HOURS": MAX_FULL_MODE_HOURS}[name]
    raw = os.environ.get(f"ECHO_{name}")
    try:
        return float(raw) if raw else float(default)
    except ValueError:
        raise ValueError(f"ECHO_{name}={raw!r} is not a number") from None


def estimated_parameters(model) -> float:
    """Parameters of a transformer of this shape (``echo.config.workload.ModelConfig``)."""
    h, d = float(model.hidden), float(model.head_dim)  # floats: an absurd size must not overflow
    attention = 2 * h * model.heads * d + 2 * h * model.kv * d  # q, o and k, v projections
    gated = model.arch in ("llama", "hf")  # SwiGLU: gate, up and down
    # an MoE's experts are narrower than a dense layer's MLP where the config says so (DeepSeek, Qwen3)
    moe = (model.hf_config or {}).get("moe_intermediate_size")
    expert_ffn = moe if model.experts and isinstance(moe, int | float) and moe > 0 else model.ffn
    mlp = (3 if gated else 2) * h * float(expert_ffn) * max(1, model.experts)
    return float(model.layers) * (attention + mlp) + 2.0 * model.vocab * h


def trace_estimate(workload) -> dict[str, float]:
    """What tracing the workload would cost: roles (one per pipeline stage: the tracer's
    representatives), ops each role records, host memory of one tracing process, hours on one core."""
    p = workload.parallel
    roles = float(p.pp)
    ops = float(workload.model.layers) / p.pp * TRACE_OPS_PER_LAYER + TRACE_OPS_PER_LAYER  # + embedding, head, optimizer
    return {"roles": roles, "ops_per_role": ops,
            "worker_gib": TRACE_WORKER_BASE_GIB + ops * TRACE_BYTES_PER_OP / 2**30,
            "hours": roles * (TRACE_SECONDS_PER_ROLE + ops * TRACE_SECONDS_PER_OP) / 3600}


def full_mode_estimate(workload) -> dict[str, float]:
    """What simulating the workload in full mode would cost: the op events it replays (every rank,
    every micro-batch, the ops of its role as trace_estimate counts them), memory, hours."""
    p = workload.parallel
    ranks, micro_batches = float(workload.world_size), float(workload.micro_batches)
    rank_ops = ranks * trace_estimate(workload)["ops_per_role"]
    events = rank_ops * micro_batches
    return {"ranks": ranks, "events": events,
            "gib": FULL_BASE_GIB + (rank_ops * FULL_BYTES_PER_RANK_OP + events * FULL_BYTES_PER_EVENT_OP) / 2**30,
            "hours": (events * FULL_SECONDS_PER_EVENT_OP + ranks * p.dp * FULL_SECONDS_PER_RANK_MEMBER) / 3600}


def full_mode_refusal(workload) -> str | None:
    """Why full-mode simulation of the workload is refused (None: it is not)."""
    est = full_mode_estimate(workload)
    if est["gib"] <= limit("MAX_FULL_MODE_GIB") and est["hours"] <= limit("MAX_FULL_MODE_HOURS"):
        return None
    return (f"full mode replays every rank: {workload.name} has {est['ranks']:,.0f} ranks and about "
            f"{est['events']:.3g} op events, estimated {est['gib']:,.1f} GiB and {est['hours']:,.2f} h "
            f"(limits {limit('MAX_FULL_MODE_GIB'):g} GiB, {limit('MAX_FULL_MODE_HOURS'):g} h; ECHO_MAX_FULL_MODE_GIB "
            "and ECHO_MAX_FULL_MODE_HOURS raise them); symmetric mode simulates it")


def cost_problems(workload) -> list[tuple[str, str]]:
    """(key, reason with the estimate) for each limit the workload exceeds."""
    m, p = workload.model, workload.parallel
    out = []
    per_role = float(m.layers) / p.pp
    if per_role > limit("MAX_LAYERS_PER_ROLE"):
        out.append(("model.layers", f"{m.layers} layers put {per_role:,.0f} on each of {p.pp} pipeline roles; the "
                    f"tracer builds each (limit {limit('MAX_LAYERS_PER_ROLE'):,.0f} per role, "
                    "ECHO_MAX_LAYERS_PER_ROLE raises it)"))
    params = estimated_parameters(m)
    if params > limit("MAX_PARAMETERS"):
        out.append(("model.layers" if m.layers > 1000 else "model.hidden",
                    f"the model has about {params:.3g} parameters (limit {limit('MAX_PARAMETERS'):.3g}, "
                    "ECHO_MAX_PARAMETERS raises it)"))
    cost = trace_estimate(workload)
    if per_role <= limit("MAX_LAYERS_PER_ROLE") and cost["worker_gib"] > limit("MAX_TRACE_WORKER_GIB"):
        out.append(("model.layers", f"tracing one role would record about {cost['ops_per_role']:,.0f} ops in "
                    f"{cost['worker_gib']:,.1f} GiB of host memory (limit {limit('MAX_TRACE_WORKER_GIB'):g} GiB, "
                    "ECHO_MAX_TRACE_WORKER_GIB raises it)"))
    if cost["hours"] > limit("MAX_TRACE_HOURS"):
        out.append(("parallel.pp", f"tracing {cost['roles']:,.0f} roles of about {cost['ops_per_role']:,.0f} ops "
                    f"would take about {cost['hours']:,.1f} h on one core (limit {limit('MAX_TRACE_HOURS'):g} h, "
                    "ECHO_MAX_TRACE_HOURS raises it)"))
    if workload.world_size > limit("MAX_WORLD"):
        out.append(("parallel", f"a world of {workload.world_size:,} ranks (limit {limit('MAX_WORLD'):,.0f}, "
                    "ECHO_MAX_WORLD raises it)"))
    return out
