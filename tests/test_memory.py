"""The traced memory model against Korthikanti et al. (MLSys 2023), Figure 1, per GPU.

Their models (Table 3): GPT with unfused attention and dropout 0.1, seq 2048, vocab 51200, TP 8;
175B and 530B run the interleaved schedule with 3 model chunks per pipeline rank (the schedule
factor 1 + (p-1)/(p*v) in their section 4.2.3 is what their figures imply). Parameters and
optimizer state are Megatron's 18 bytes per parameter without a distributed optimizer, averaged
over the pipeline stages as the figure does; activations are those of the first stage with its
micro-batches in flight under the schedule.
"""

from __future__ import annotations

import pytest

from echo.config.workload import Workload
from echo.trace import trace_ranks
from echo.training.layout import Layout
from echo.training.schedule import in_flight, stage_orders

GIB = 2**30
# name: heads, hidden, layers, pp, global batch, micro-batch, chunks per pipeline rank
MODELS = {"22B": (64, 6144, 48, 1, 4, 4, 1), "175B": (96, 12288, 96, 8, 64, 1, 3),
          "530B": (128, 20480, 105, 35, 280, 1, 3), "1T": (160, 25600, 128, 64, 512, 1, 1)}
# name: parameters + optimizer state, activations without recompute, with SP + selective recompute
FIGURE_1 = {"22B": (45.56, 59.25, 9.56), "175B": (45.56, 66.84, 12.35),
            "530B": (31.64, 114.02, 23.08), "1T": (32.96, 131.25, 26.56)}


def korthikanti(name: str, optimized: bool) -> Workload:
    heads, hidden, layers, pp, gb, mb, v = MODELS[name]
    return Workload.model_validate({
        "name": name, "verify": 0,
        "model": {"arch": "gpt", "layers": layers, "hidden": hidden, "heads": heads, "vocab": 51200,
                  "seq_len": 2048, "attention": "math", "dropout": 0.1},
        "parallel": {"tp": 8, "pp": pp, "dp": 1, "zero": 0, "sequence_parallel": optimized,
                     "schedule": "interleaved" if v > 1 else "1f1b", "virtual_stages": v},
        "training": {"global_batch": gb, "micro_batch": mb, "dtype": "bf16",
                     "recompute": "selective" if optimized else "none"}})


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_memory_matches_korthikanti_figure_1(name, tmp_path):
    params_opt, act_plain, act_optimized = FIGURE_1[name]
    for optimized, published in ((False, act_plain), (True, act_optimized)):
        w = korthikanti(name, optimized)
        p = w.parallel
        reps = sorted(set(Layout(p).representatives().values()))
        ranks = trace_ranks(w, [reps[0], reps[len(reps) // 2], reps[-1]] if p.pp > 2 else reps,
                            tmp_path / str(optimized))["ranks"].to_pylist()
        first = next(r for r in ranks if r["pp_rank"] == 0)
        held = in_flight(stage_orders(p.schedule, p.pp, w.micro_batches, p.virtual_stages)[0])
        activations = first["activation_bytes_per_microbatch"] / p.virtual_stages * held / GIB
        assert activations == pytest.approx(published, rel=0.10), (name, optimized)
        if not optimized:
            per_stage = {r["pp_rank"]: (r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]) / GIB for r in ranks}
            middle = [v for s, v in per_stage.items() if 0 < s < p.pp - 1]
            mean = (sum(per_stage.values()) + (p.pp - len(per_stage)) * (middle[0] if middle else 0)) / p.pp
            assert mean == pytest.approx(params_opt, rel=0.10), name
