"""The Megatron-Bridge performance summary as workloads (echo.validate.bridge)."""

from __future__ import annotations

import csv
from collections import Counter

import pytest

from echo.config import load_workload
from echo.validate import bridge


def test_stage_layers_counts_embedding_and_loss_when_layers_do_not_divide():
    assert bridge.stage_layers(80, 40) == [2] * 40                # Llama 3 70B, PP8 x VP5: 2 each
    layout = bridge.stage_layers(126, 64)                       # Llama 3.1 405B, PP16 x VP4
    assert layout == [1] + [2] * 62 + [1] and sum(layout) == 126
    assert bridge.stage_layers(61, 16) is None                  # DeepSeek-V3: 63 / 16 does not divide


def test_declared_split_covers_every_row(reference):
    split = bridge.declared_split()
    with (reference / "megatron_bridge_perf_all.csv").open() as f:
        keys = [(r["file"], r["line"]) for r in csv.DictReader(x for x in f if not x.startswith("#"))]
    assert set(split) == set(keys) and set(split.values()) == {"fit", "validation"}
    # about a quarter are fit rows, as the sidecar's rule says
    assert 0.15 < Counter(split.values())["fit"] / len(keys) < 0.35


def test_rows_map_precision_system_and_layout(reference):
    rows = bridge.bridge_rows(reference)
    by_name = {r.name: r for r in rows}
    llama = by_name["mbridge-h100-llama-3.1-70b-fp8cs-64g-tp4pp8cp1vp5ep1-gbs256mbs1-fp8ag"]
    assert (llama.hardware, llama.topology) == ("h100-sxm-80gb", "dgx-h100-ndr")
    w = load_workload(llama.name)
    assert (w.training.dtype, w.training.fp8_recipe) == ("fp8", "current")
    assert (w.parallel.tp, w.parallel.pp, w.parallel.virtual_stages, w.parallel.dp) == (4, 8, 5, 2)
    assert w.parallel.sequence_parallel and w.parallel.tp_comm_overlap
    # the releases that measured one layout share its workload and are each scored
    assert sum(r.name == llama.name for r in rows) == 4
    gb = [r for r in rows if r.hardware == "gb200" and r.workload["training"].get("fp8_recipe") == "nvfp4"]
    assert gb and {r.topology for r in gb} == {"gb200-nvl72-64"}


@pytest.mark.parametrize("reason", ["Megatron FSDP", "do not split", "alternate values"])
def test_inexpressible_rows_are_left_out_with_a_reason(reference, reason):
    assert any(reason in why for _, _, why in bridge.skipped(reference))
