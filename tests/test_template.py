"""Layer templates (echo.trace.template, compose, memory_template): a rank composed from blocks
traced once must be its full trace, op for op, collective for collective, dependency for
dependency, with the same memory figures; what a template cannot stand for is refused."""

from __future__ import annotations

import pyarrow.compute as pac
import pytest

from echo.config import parse_workload
from echo.trace.compose import compose_trace, differences, signature
from echo.trace.runner import trace_ranks
from echo.trace.template import NotComposable, needed, template_workload
from echo.training.layout import Layout

GPT = {"arch": "gpt", "layers": 12, "hidden": 256, "heads": 8, "vocab": 1024, "seq_len": 128}
LLAMA = {"arch": "llama", "layers": 12, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn_hidden": 512,
         "vocab": 1024, "seq_len": 128}
TRAINING = {"global_batch": 8, "micro_batch": 1, "dtype": "bf16", "recompute": "selective"}


def workload(name, model=GPT, training=None, **parallel):
    par = {"tp": 2, "pp": 2, "dp": 2, "zero": 1, "schedule": "1f1b", "sequence_parallel": True, **parallel}
    return parse_workload({"model": model, "parallel": par, "training": {**TRAINING, **(training or {})}},
                          __import__("pathlib").Path(f"{name}.yaml"))


CASES = {
    # interleaved: a rank holds a first (or last) chunk and a middle one
    "gpt-tp2-pp2-v2-selective": workload("a", schedule="interleaved", virtual_stages=2),
    "llama-cp2-pp3-full": workload("b", LLAMA, {"recompute": "full"}, cp=2, pp=3),
    "moe-ep4": workload("c", {**LLAMA, "experts": 8, "top_k": 2}, ep=4),
    "gpt-pp1-dp4-no-sp-zero0": workload("d", training={"recompute": "none"}, pp=1, dp=4, sequence_parallel=False,
                                        zero=0),
    # stage_layers with a chunk of one block: that chunk comes from the one-block template
    "gpt-uneven-stages": workload("e", training={"recompute": "none"}, pp=3, stage_layers=[1, 6, 5]),
    # one block per chunk, three chunks a rank, full recompute: the case a GPT-3 search's check
    # caught (the next chunk's receive used to free the previous chunk's gradient buffer)
    "gpt-one-block-chunks-full": workload("f", {**GPT, "layers": 6}, {"recompute": "full", "micro_batch": 2,
                                                                       "global_batch": 16},
                                          schedule="interleaved", virtual_stages=3),
}
FAST = ("gpt-tp2-pp2-v2-selective",)


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_a_composed_rank_is_its_full_trace(case, tmp_path):
    w = CASES[case]
    composed = compose_trace(w, tmp_path / "composed", tmp_path / "templates", processes=2)
    reps = sorted(Layout(w.parallel).representatives().values())
    traced = trace_ranks(w, reps, tmp_path / "full")
    for r in reps:
        mine = {n: t.filter(pac.equal(t["rank"], r)) for n, t in composed.items()}
        theirs = {n: t.filter(pac.equal(t["rank"], r)) for n, t in traced.items()}
        assert mine["ops"].num_rows > 0
        assert differences(mine, theirs) == [], f"rank {r}"
    # the ranks' graph hashes are what dedup groups by: equal, so the classes are too
    assert composed["ranks"]["graph_hash"].to_pylist() == traced["ranks"]["graph_hash"].to_pylist()


def test_layouts_that_differ_in_depth_pipeline_and_data_parallel_share_templates(tmp_path):
    a = workload("a", schedule="interleaved", virtual_stages=2)
    b = workload("b", pp=4, dp=1, model={**GPT, "layers": 24})
    assert signature(a) == signature(b)
    # what a block runs depends on tp, the micro-batch and recompute: other templates
    assert signature(workload("c", tp=4)) != signature(a)
    assert signature(workload("z", zero=0, schedule="interleaved", virtual_stages=2)) == signature(a)
    assert signature(workload("d", training={"micro_batch": 2, "global_batch": 16})) != signature(a)
    assert template_workload(b, 3).parallel.dp == 1 and template_workload(b, 3).model.layers == 9
    # one-block chunks need the one-block template
    assert needed(workload("e", pp=3, stage_layers=[1, 6, 5])) == {("first", 1), ("middle", 3), ("last", 3)}


@pytest.mark.parametrize("training, parallel, model, reason", [
    ({"dtype": "fp8", "fp8_recipe": "delayed"}, {}, LLAMA, "fp8"),
    ({}, {"zero": 3, "pp": 1, "dp": 4, "sequence_parallel": False}, GPT, "FSDP"),
])
def test_what_a_template_cannot_stand_for_is_refused(training, parallel, model, reason, tmp_path):
    w = workload("x", model, training, **parallel)
    with pytest.raises(NotComposable, match=reason):
        compose_trace(w, tmp_path / "c", tmp_path / "t", processes=2)


def test_hugging_face_models_are_refused_before_tracing():
    hf = parse_workload({"model": {"hf_config": "config/models/qwen3-30b-a3b.json",
                                   "hf_overrides": {"num_hidden_layers": 4}, "seq_len": 128},
                         "parallel": {"tp": 1, "pp": 2, "dp": 1, "ep": 1},
                         "training": TRAINING}, __import__("pathlib").Path("hf.yaml"))
    with pytest.raises(NotComposable, match="blocks may differ by index"):
        template_workload(hf, 3)


def test_a_rank_traced_after_another_in_one_process_is_traced_as_in_a_fresh_one(tmp_path):
    """echo.trace.runner.forked_map traces its first job in the calling process, warm from
    whatever it traced before, and forks the rest from it: the tables must not depend on that."""
    import torch

    from echo.trace.step import trace_rank

    w, other = CASES["gpt-tp2-pp2-v2-selective"], CASES["moe-ep4"]
    fresh = trace_ranks(w, [1], tmp_path / "fresh")  # a worker process of its own
    before = torch.get_default_dtype(), torch.get_num_threads()
    trace_rank(other, 0)
    warm = trace_rank(w, 1)
    assert (torch.get_default_dtype(), torch.get_num_threads()) == before  # the process's settings put back
    # trace_rank leaves the graph hash to its caller (echo.trace.runner hashes the ops compared here)
    no_hash = {n: t.drop_columns(["graph_hash"]) if n == "ranks" else t for n, t in fresh.items()}
    assert differences({n: warm[n].drop_columns(["graph_hash"]) if n == "ranks" else warm[n] for n in fresh},
                       no_hash) == []
