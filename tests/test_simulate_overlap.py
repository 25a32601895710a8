"""The overlap slowdown's figures: published for GPUs, measured on this machine for the CPU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pyarrow as pa
import pytest

from echo.config import load_hardware
from echo.errors import ConfigError
from echo.io import write_parquet
from echo.overlap import OP_CLASSES, PUBLISHED, SLOWDOWN, Slowdown, slowdown_table
from echo.overlap.measure import measure_slowdown, run_overlap


def test_published_gpu_figures():
    # Echo paper, next to a 25 MB all-reduce on an A100: GEMM 1.269x, sum 1.508x, transform
    # 1.142x, gradient 1.613x
    a100 = slowdown_table(load_hardware("a100-sxm-80gb"))
    assert a100.of("gemm") == pytest.approx(0.269) and a100.of("attention") == pytest.approx(0.269)
    assert a100.of("norm") == pytest.approx(0.508) and a100.of("softmax") == pytest.approx(0.508)
    assert a100.of("elementwise") == pytest.approx(0.142) and a100.of("optimizer") == pytest.approx(0.613)
    assert set(PUBLISHED) == set(OP_CLASSES)
    assert "2412.12487" in a100.source
    h100 = slowdown_table(load_hardware("h100-sxm-80gb"))
    assert h100.factors == a100.factors and h100.source.startswith("A100 figures (no H100 data yet)")
    assert slowdown_table(SimpleNamespace(name="mi300x", kind="gpu")).source.startswith("A100 figures (unknown GPU)")


def test_cpu_uses_the_measurement(tmp_path):
    cpu = load_hardware("local-cpu")
    assert slowdown_table(cpu).of("gemm") == 0.0  # nothing measured: no slowdown (and a warning)
    rows = [dict(op_class=c, kernel=c, comm_op="all_reduce", comm_bytes=1 << 24, alone_us=10.0, overlapped_us=10.0 + i,
                 slowdown=i / 10.0, spread=0.01, windows=4, ranks=2, threads=1, source="measured")
            for i, c in enumerate(("gemm", "norm", "elementwise"))]
    write_parquet(pa.Table.from_pylist(rows), tmp_path / "slowdown.parquet", SLOWDOWN)
    measured = slowdown_table(cpu, tmp_path / "slowdown.parquet")
    assert (measured.of("gemm"), measured.of("norm"), measured.of("elementwise")) == (0.0, 0.1, 0.2)
    assert measured.of("softmax") == 0.1  # classes not measured: the median of the measured
    assert "measured on this machine next to all_reduce of 16777216 B" in measured.source
    # a negative measurement (noise) slows nothing
    assert Slowdown({"gemm": -0.05}).of("gemm") == 0.0


def test_hardware_field_wins():
    hw = SimpleNamespace(name="x", kind="gpu", overlap_slowdown={"gemm": 0.5, "other": 0.2})
    s = slowdown_table(hw)
    assert (s.of("gemm"), s.of("norm")) == (0.5, 0.2) and "overlap_slowdown" in s.source


def test_measurement_runs_kernels_beside_gloo_traffic():
    # A short real run: two processes, two op classes, two quiet/busy window pairs each. Times
    # are this machine's; only their shape is checked.
    table = measure_slowdown(classes=("gemm", "reduction"), pairs=2, comm_bytes=1 << 20)
    assert table.schema == SLOWDOWN
    rows = table.to_pylist()
    assert [r["op_class"] for r in rows] == ["gemm", "reduction"]
    for r in rows:
        assert r["alone_us"] > 0 and r["overlapped_us"] > 0 and r["windows"] == 4 and r["ranks"] == 2
        assert math.isfinite(r["slowdown"]) and r["spread"] >= 0 and r["source"] == "measured"
        assert r["comm_op"] == "all_reduce" and r["comm_bytes"] == 1 << 20
    with pytest.raises(ValueError, match="unknown op classes"):
        measure_slowdown(classes=("matmul",))


def test_only_this_machine_is_measured(tmp_path):
    with pytest.raises(ConfigError, match="kind: the overlap slowdown is measured on this machine only"):
        run_overlap(load_hardware("h100-sxm-80gb"), tmp_path / "x.parquet")
