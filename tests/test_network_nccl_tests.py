"""The nccl-tests log reader: the shipped Azure logs, newer-format logs, and damaged copies."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from echo.errors import ConfigError
from echo.network.nccl_tests import MEASUREMENTS, LogFormatError, read_log, read_logs, read_runs, resolve_logs


@pytest.fixture
def azure_log(reference):
    """The shipped Azure log of ``gpus`` GPUs (nccl-tests/azure-ndv4-a100/ of the reference folder)."""
    return lambda gpus: reference / "nccl-tests" / "azure-ndv4-a100" / f"all_reduce_perf_{gpus}gpus.log"


def _copy(tmp_path: Path, text: str, name: str = "all_reduce_perf_8gpus.log") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), start=1) if needle in line)


# --- the shipped logs ---------------------------------------------------------------------

@pytest.mark.parametrize("gpus, nodes, sizes, first, last, per_thread, iters, errors", [
    (2, 1, 28, (8, 8.65), (1 << 30, 5183.1), 2, (5, 20), "numeric"),
    (4, 1, 28, (8, 16.42), (1 << 30, 7169.6), 4, (5, 20), "numeric"),
    (8, 1, 28, (8, 31.44), (1 << 30, 8139.6), 8, (5, 20), "numeric"),
    (16, 2, 25, (1024, 34.66), (16 << 30, 250681), 1, (20, 50), "N/A"),
    (64, 8, 23, (1024, 314.8), (4 << 30, 66376), 1, (20, 50), "N/A"),
])
def test_reads_every_shipped_log(gpus, nodes, sizes, first, last, per_thread, iters, errors, azure_log):
    (run,) = read_runs(azure_log(gpus))
    assert run.collective == "all_reduce" and run.op == "all_reduce"
    assert run.ranks == gpus and len(run.hosts) == nodes and run.gpus_per_node == gpus // nodes
    assert run.hosts[0] == "node-000000" and run.device_name == "A100-SXM4-40GB"
    assert (run.options["warmup_iters"], run.options["iters"]) == iters and run.options["nGpus"] == per_thread
    table = run.table()
    assert table.schema == MEASUREMENTS and table.num_rows == 2 * sizes  # out-of-place and in-place
    rows = table.to_pylist()
    assert {r["placement"] for r in rows} == {"out_of_place", "in_place"}
    assert (rows[0]["bytes"], rows[0]["time_us"], rows[0]["placement"]) == (*first, "out_of_place")
    assert (rows[-1]["bytes"], rows[-1]["time_us"], rows[-1]["placement"]) == (*last, "in_place")
    assert all(r["gpus_per_thread"] == per_thread and r["nodes"] == nodes for r in rows)
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (gpus - 1) / gpus, abs=0.02) for r in rows)
    if errors == "N/A":
        assert all(r["error"] is None for r in rows)
    else:
        assert all(r["error"] is not None and r["error"] < 1e-6 for r in rows)
    assert all(r["line"] >= 10 for r in rows) and rows[0]["line"] < rows[-1]["line"]


def test_mpi_prefix_and_node_names_of_eight_servers(azure_log):
    (run,) = read_runs(azure_log(64))
    assert run.hosts == [f"node-0000{h}" for h in ("00", "02", "06", "07", "08", "09", "0C", "0D")]
    assert set(run.per_host.values()) == {8}
    assert run.avg_busbw_GBps == pytest.approx(48.5229) and run.out_of_bounds_ok


def test_read_logs_concatenates_and_names_sources(tmp_path, azure_log):
    table = read_logs([azure_log(2), azure_log(16)])
    assert table.num_rows == 2 * 28 + 2 * 25
    assert read_log(azure_log(2), source="nccl-tests/x.log").column("source").unique().to_pylist() == ["nccl-tests/x.log"]
    assert read_logs([]).num_rows == 0


# --- damaged copies -----------------------------------------------------------------------

def test_cut_mid_row_names_the_line(tmp_path, azure_log):
    text = azure_log(8).read_text()
    cut_at = text.index("  268435456  ") + 40  # in the middle of the 256 MiB row
    path = _copy(tmp_path, text[:cut_at])
    with pytest.raises(LogFormatError, match=r"line (\d+): the log was cut short mid-row") as err:
        read_log(path)
    assert err.value.line == _line_of(text, "  268435456  ") and str(path) in str(err.value)


def test_cut_between_rows_is_refused(tmp_path, azure_log):
    text = azure_log(16).read_text()
    lines = text.splitlines(keepends=True)
    last_row = _line_of(text, "  1073741824  ")
    path = _copy(tmp_path, "".join(lines[:last_row]), "all_reduce_perf_16gpus.log")
    with pytest.raises(LogFormatError, match="without nccl-tests' closing '# Avg bus bandwidth' line") as err:
        read_log(path)
    assert err.value.line == last_row


def test_non_numeric_cell_names_line_and_column(tmp_path, azure_log):
    text = azure_log(8).read_text()
    damaged = text.replace("   566.1  118.54", "   56x.1  118.54")
    assert damaged != text
    with pytest.raises(LogFormatError, match=r"line \d+: column 'time': '56x.1' is not a number") as err:
        read_log(_copy(tmp_path, damaged))
    assert err.value.line == _line_of(text, "   566.1  118.54")


def test_digit_changed_in_a_cell_is_caught(tmp_path, azure_log):
    text = azure_log(8).read_text()
    damaged = text.replace("   566.1  118.54", "   966.1  118.54")  # time no longer matches algbw
    with pytest.raises(LogFormatError, match="a damaged cell"):
        read_log(_copy(tmp_path, damaged))


def test_log_of_another_collective_under_the_wrong_name(tmp_path, azure_log):
    """An all_reduce log renamed to all_gather: its bus factor 2(n-1)/n gives it away."""
    path = _copy(tmp_path, azure_log(8).read_text(), "all_gather_perf_8gpus.log")
    with pytest.raises(LogFormatError, match="fits all_reduce_perf, not all_gather_perf"):
        read_log(path)


def _as_all_gather(text: str, n: int) -> str:
    """An all_reduce log rewritten as an all_gather log of the same times (busbw = algbw (n-1)/n)."""
    out = []
    for line in text.splitlines():
        cells = line.split()
        if len(cells) == 12 and cells[0].isdigit():
            for i in (6, 10):
                cells[i] = f"{float(cells[i - 1]) * (n - 1) / n:.2f}"
            line = "  ".join(cells)
        out.append(line)
    return "\n".join(out) + "\n"


def test_a_genuine_all_gather_log_parses_as_all_gather(tmp_path, azure_log):
    table = read_log(_copy(tmp_path, _as_all_gather(azure_log(8).read_text(), 8), "all_gather_perf_8gpus.log"))
    assert set(table.column("op").to_pylist()) == {"all_gather"} and table.num_rows == 56
    # ... and named as an all_reduce log, it is refused
    with pytest.raises(LogFormatError, match="fits all_gather_perf.*not all_reduce_perf"):
        read_log(_copy(tmp_path, _as_all_gather(azure_log(8).read_text(), 8), "all_reduce_perf_8gpus.log"))


@pytest.mark.parametrize("content, reason", [
    ("size_bytes,time_us\n1024,3.0\n", "not an nccl-tests log"),
    ("", "not an nccl-tests log: no '# nThread"),
    ("# nThread 1 nGpus 8 minBytes 8 maxBytes 64 step: 2(factor) warmup iters: 5 iters: 20\n#\n", "no '# Using devices'"),
])
def test_foreign_files_are_refused(tmp_path, content, reason):
    with pytest.raises(LogFormatError, match=reason):
        read_log(_copy(tmp_path, content, "whatever.log"))


def test_binary_file_is_refused(tmp_path):
    path = tmp_path / "all_reduce_perf.log"
    path.write_bytes(b"\x7fELF\0\0\x01binary")
    with pytest.raises(LogFormatError, match="binary content"):
        read_log(path)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(LogFormatError, match="cannot read"):
        read_log(tmp_path / "nope.log")


# --- other launchers and newer nccl-tests -------------------------------------------------

NEWER = """\
0: # nccl-tests version 2.13.9 nccl-headers=21903 nccl-library=21903
0: # Collective test starting: all_gather_perf
0: # nThread 1 nGpus 1 minBytes 1048576 maxBytes 4194304 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
0: #
0: # Using devices
0: #  Rank  0 Group  0 Pid  41001 on   gpu-a device  0 [0000:18:00] NVIDIA H100 80GB HBM3
0: #  Rank  1 Group  0 Pid  41002 on   gpu-a device  1 [0000:2a:00] NVIDIA H100 80GB HBM3
0: #  Rank  2 Group  0 Pid  52001 on   gpu-b device  0 [0000:18:00] NVIDIA H100 80GB HBM3
0: #  Rank  3 Group  0 Pid  52002 on   gpu-b device  1 [0000:2a:00] NVIDIA H100 80GB HBM3
0: gpu-a:41001:41001 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
[1,2]<stderr>: some warning from another rank
0: #
0: #                                                              out-of-place                       in-place
0: #       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
0: #        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
0:      1048576         65536     float    none      -1    20.00   52.43   39.32      0    19.00   55.19   41.39      0
0:      2097152        131072     float    none      -1    30.00   69.91   52.43      0    29.00   72.32   54.24    N/A
0:      4194304        262144     float    none      -1    50.00   83.89   62.91      2    49.00   85.60   64.20      0
0: # Out of bounds values : 0 OK
0: # Avg bus bandwidth    : 52.4
0: #
"""


def test_newer_format_with_srun_labels_groups_root_and_wrong_columns(tmp_path):
    (run,) = read_runs(_copy(tmp_path, NEWER, "run.log"))
    assert run.collective == "all_gather" and run.op == "all_gather"
    assert run.ranks == 4 and run.hosts == ["gpu-a", "gpu-b"] and run.gpus_per_node == 2
    assert run.device_name == "NVIDIA H100 80GB HBM3"
    assert run.options["agg_iters"] == 1 and run.options["graph"] == 0 and run.options["step_kind"] == "factor"
    rows = run.table().to_pylist()
    assert [r["wrong"] for r in rows] == [0, 0, 0, None, 2, 0]
    assert all(r["error"] is None for r in rows) and rows[0]["redop"] == "none"
    assert rows[0]["time_us"] == 20.0 and rows[-1]["busbw_GBps"] == 64.20


def test_collective_line_and_file_name_must_agree(tmp_path):
    with pytest.raises(LogFormatError, match="ran all_gather_perf but the file is named all_reduce_perf"):
        read_log(_copy(tmp_path, NEWER, "all_reduce_perf_4gpus.log"))


def test_unnamed_log_of_ambiguous_collective_is_refused(tmp_path, azure_log):
    text = NEWER.replace("0: # Collective test starting: all_gather_perf\n", "")
    with pytest.raises(LogFormatError, match="cannot tell which collective"):
        read_log(_copy(tmp_path, text, "run.log"))
    # an all-reduce's bus factor is its own: no name needed
    assert read_runs(_copy(tmp_path, azure_log(8).read_text(), "run8.log"))[0].collective == "all_reduce"


# --- where a topology's logs are found ----------------------------------------------------

def test_logs_are_named_relative_to_the_reference_folder(tmp_path, monkeypatch):
    (tmp_path / "nccl-tests").mkdir()
    (tmp_path / "nccl-tests" / "a.log").write_text("x")
    assert resolve_logs(["nccl-tests/a.log"], "t.yaml", root=tmp_path) == [tmp_path / "nccl-tests" / "a.log"]
    monkeypatch.setenv("ECHO_REFERENCE", str(tmp_path))  # the default root
    assert resolve_logs(["nccl-tests/a.log"], "t.yaml") == [tmp_path / "nccl-tests" / "a.log"]
    with pytest.raises(ConfigError, match=r"t.yaml: calibration.logs.1: 'nccl-tests/b.log' not found in the "
                                          r"reference folder .*; set ECHO_REFERENCE"):
        resolve_logs(["nccl-tests/a.log", "nccl-tests/b.log"], "t.yaml")
    for outside in ("../a.log", str(tmp_path / "nccl-tests" / "a.log")):
        with pytest.raises(ConfigError, match="calibration.logs.0: .* must be relative to the reference folder"):
            resolve_logs([outside], "t.yaml")


def test_measurement_schema_is_complete():
    assert isinstance(MEASUREMENTS, pa.Schema)
    for name in ("source", "line", "op", "gpus", "nodes", "gpus_per_node", "gpus_per_thread", "bytes",
                 "placement", "time_us", "algbw_GBps", "busbw_GBps", "error", "wrong"):
        assert name in MEASUREMENTS.names
