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
- ``parallel``: a world of at most MAX_WORLD ranks.

Each limit can be raised for one run with an environment variable of the same name prefixed
``ECHO_`` (``ECHO_MAX_LAYERS_PER_ROLE=50000``), for a machine that can afford it.
"""

from __future__ import annotations

import os

MAX_LAYERS_PER_ROLE = 20_000
MAX_PARAMETERS = 2e13
MAX_WORLD = 2**21  # 2,097,152 ranks


def limit(name: str) -> float:
    """A limit's value, from ECHO_<name> when set."""
    default = {"MAX_LAYERS_PER_ROLE": MAX_LAYERS_PER_ROLE, "MAX_PARAMETERS": MAX_PARAMETERS,
               "MAX_WORLD": MAX_WORLD}[name]
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
    if workload.world_size > limit("MAX_WORLD"):
        out.append(("parallel", f"a world of {workload.world_size:,} ranks (limit {limit('MAX_WORLD'):,.0f}, "
                    "ECHO_MAX_WORLD raises it)"))
    return out
