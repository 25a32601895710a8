"""Chakra execution traces (echo.trace.chakra, chakra_schema): Echo's trace exported and imported
back simulates to the same step with every node and dependency kept; the exported fields mean
what Chakra's documentation says they mean; another tool's graph is costed and simulated; bad
files are refused with file and reason."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import edit_yaml

from echo.cli import main
from echo.config import load_hardware, load_workload
from echo.profile import roofline
from echo.profile.kernel import Kernel
from echo.trace import chakra
from echo.trace import chakra_schema as cs

W, H, T = "tiny-tp2pp2", "h100-sxm-80gb", "dgx-h100-ndr"
TABLES = ("ops", "comms", "deps", "ranks")


def _simulate(results: Path, workload: str = W, config_dir: Path | None = None, trace: bool = True) -> dict:
    cfg = ["--config-dir", str(config_dir)] if config_dir else []
    steps = ([["trace", "--workload", workload]] if trace else []) + [
        ["dedup", "--workload", workload], ["profile", "--workload", workload, "--hardware", H],
        ["calibrate", "--topology", T], ["simulate", "--workload", workload, "--hardware", H, "--topology", T]]
    for argv in steps:
        assert main([*argv, "--results", str(results), *cfg]) == 0, argv
    return pq.read_table(results / "simulate" / workload / H / T / "summary.parquet").to_pylist()[0]


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """tiny-tp2pp2 traced, profiled and simulated; exported (costed on H100) and imported into a
    second results folder, which is simulated from the imported tables alone."""
    a, b = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("second")
    first = _simulate(a)
    assert main(["chakra-export", "--workload", W, "--hardware", H, "--results", str(a)]) == 0
    export = a / "chakra" / W
    assert main(["chakra-import", str(export), "--workload", W, "--results", str(b)]) == 0
    second = _simulate(b, trace=False)
    return {"a": a, "b": b, "export": export, "first": first, "second": second}


def test_round_trip_keeps_every_node_dependency_and_column(round_trip):
    for t in TABLES:
        before = pq.read_table(round_trip["a"] / "trace" / W / f"{t}.parquet")
        after = pq.read_table(round_trip["b"] / "trace" / W / f"{t}.parquet")
        assert after.schema.equals(before.schema), t
        assert after.equals(before), t


def test_round_trip_simulates_to_the_same_step(round_trip):
    s1, s2 = round_trip["first"]["step_time_s"], round_trip["second"]["step_time_s"]
    assert s2 == pytest.approx(s1, rel=1e-3)
    for key in ("compute_s", "exposed_comm_s", "bubble_s", "peak_mem_gib"):
        assert round_trip["second"][key] == pytest.approx(round_trip["first"][key], rel=1e-3), key


def _nodes(path: Path):
    meta, nodes = chakra.read_et(path)
    return meta, {n.id: n for n in nodes}


def _attrs(node) -> dict:
    return {a.name: (a.WhichOneof("value"), cs.attr_value(a)) for a in node.attr}


def test_exported_fields_follow_the_chakra_schema(round_trip):
    """Field by field, as Chakra's et_def.proto (0.0.4) and its feeder read them."""
    export, a = round_trip["export"], round_trip["a"]
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["schema"] == "chakra-et 0.0.4" and manifest["costed"]
    assert set(manifest["rank_files"]) == {"0", "1", "2", "3"}  # every world rank -> its class's file
    groups = json.loads((export / "comm_groups.json").read_text())
    ops = pq.read_table(a / "trace" / W / "ops.parquet").to_pylist()
    comms = {(c["rank"], c["comm_id"]): c for c in pq.read_table(a / "trace" / W / "comms.parquet").to_pylist()}
    deps = pq.read_table(a / "trace" / W / "deps.parquet").to_pylist()
    kernels = pq.read_table(a / "profile" / W / H / "kernels.parquet").to_pylist()
    duration = {k["kernel_key"]: k["duration_us"] for k in kernels}
    for rank_s, name in manifest["files"].items():
        rank = int(rank_s)
        raw = (export / name).read_bytes()
        meta, nodes = _nodes(export / name)
        assert meta.version == "0.0.4"
        # length-delimited framing: the first varint is the metadata message's length
        first_len = raw[0] if raw[0] < 0x80 else (raw[0] & 0x7F) | (raw[1] << 7)
        assert first_len == len(meta.SerializeToString())
        mine = [o for o in ops if o["rank"] == rank]
        assert sorted(nodes) == [o["seq"] for o in mine]
        for op in mine:
            n, at = nodes[op["seq"]], _attrs(nodes[op["seq"]])
            assert n.name == op["name"]
            assert at["is_cpu_op"] == ("bool_val", False)
            if op["comm_id"] < 0:
                assert cs.NODE_TYPES[n.type] in ("COMP_NODE", "MEM_LOAD_NODE")
                assert at["num_ops"] == ("int64_val", int(op["flops"]))
                assert at["tensor_size"] == ("uint64_val", int(op["bytes"]))
                assert n.duration_micros == round(duration[op["kernel_key"]])
                continue
            c = comms[(rank, op["comm_id"])]
            assert at["comm_size"] == ("int64_val", c["bytes"])
            if c["op"] in ("send", "recv"):
                assert cs.NODE_TYPES[n.type] == ("COMM_SEND_NODE" if c["op"] == "send" else "COMM_RECV_NODE")
                src, dst = (rank, c["peer"]) if c["op"] == "send" else (c["peer"], rank)
                assert at["comm_src"] == ("int32_val", src) and at["comm_dst"] == ("int32_val", dst)
            else:
                assert cs.NODE_TYPES[n.type] == "COMM_COLL_NODE"
                assert cs.COLLECTIVE_TYPES[at["comm_type"][1]] == c["op"].upper()
                assert groups[at["pg_name"][1]] == c["group"]
        # every dependency is on the node, data ones in data_deps, the rest in ctrl_deps
        for d in (d for d in deps if d["rank"] == rank):
            n = nodes[d["dst"]]
            assert d["src"] in (n.data_deps if d["kind"] == "data" else list(n.ctrl_deps) + list(n.data_deps))
        # and each op's predecessor on its stream, which a graph-only simulator needs
        last: dict[str, int] = {}
        for op in mine:
            if op["stream"] in last:
                n = nodes[op["seq"]]
                assert last[op["stream"]] in list(n.ctrl_deps) + list(n.data_deps)
            last[op["stream"]] = op["seq"]


# --- another tool's graph -----------------------------------------------------------------------
def _foreign_graph(folder: Path, ranks=(0, 1)) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    msgs = cs.messages()
    for rank in ranks:
        nodes = []
        for i, (flops, nbytes) in enumerate(((2 * 4096**3, 3 * 4096 * 4096 * 2), (0, 64 * 2**20))):
            n = msgs["Node"](id=10 + i, name=f"layer{i}", type=cs.NODE_TYPE["COMP_NODE"])
            n.attr.extend([cs.attr("num_ops", flops), cs.attr("tensor_size", nbytes, "uint64"),
                           cs.attr("is_cpu_op", False)])
            if i:
                n.data_deps.append(10)
            nodes.append(n)
        ar = msgs["Node"](id=20, name="grad_allreduce", type=cs.NODE_TYPE["COMM_COLL_NODE"], data_deps=[11])
        ar.attr.extend([cs.attr("comm_type", cs.COLLECTIVE_TYPE["ALL_REDUCE"]), cs.attr("comm_size", 2**28),
                        cs.attr("pg_name", "0")])
        nodes.append(ar)
        with open(folder / f"other_tool.{rank}.et", "wb") as fh:
            cs.write_messages(fh, [msgs["GlobalMetadata"](version="0.0.4"), *nodes])
    (folder / "comm_groups.json").write_text(json.dumps({"0": [0, 1]}))
    return folder


@pytest.fixture
def one_step_dp2(config_root: Path) -> Path:
    """tiny-dp2 with one micro-batch per step: another tool's graph is a whole step."""
    edit_yaml(config_root / "workloads" / "tiny-dp2.yaml", **{"training.global_batch": 4})
    return config_root


def test_another_tools_graph_is_costed_and_simulated(tmp_path, one_step_dp2):
    graph = _foreign_graph(tmp_path / "graph")
    res, cfg = tmp_path / "res", ["--config-dir", str(one_step_dp2)]
    assert main(["chakra-import", str(graph), "--workload", "tiny-dp2", "--results", str(res), *cfg]) == 0
    ops = pq.read_table(res / "trace" / "tiny-dp2" / "ops.parquet").to_pylist()
    assert [o["kind"] for o in ops if o["rank"] == 0] == ["compute", "compute", "collective"]
    comms = pq.read_table(res / "trace" / "tiny-dp2" / "comms.parquet").to_pylist()
    assert {(c["op"], c["group_size"], c["group_kind"], c["bytes"]) for c in comms} == {("all_reduce", 2, "dp", 2**28)}
    summary = _simulate(res, "tiny-dp2", one_step_dp2, trace=False)
    # each node costed by the H100 model from its FLOPs and bytes alone
    hw = load_hardware(H)
    kernels = {k["kernel_key"]: k for k in pq.read_table(res / "profile" / "tiny-dp2" / H / "kernels.parquet").to_pylist()}
    for o in (o for o in ops if o["rank"] == 0 and o["kind"] == "compute"):
        k = Kernel(o["kernel_key"], o["name"], o["op_class"], "compute", o["shapes"], o["dtype"], o["flops"],
                   o["bytes"], o["args"])
        assert kernels[o["kernel_key"]]["duration_us"] == pytest.approx(roofline.estimate(hw, k).duration_us)
    assert summary["step_time_s"] > summary["compute_s"] > 0  # the all-reduce waits for the last layer
    assert load_workload("tiny-dp2", root=one_step_dp2).micro_batches == 1


# --- bad input -----------------------------------------------------------------------------------
def test_bad_files_are_refused_with_file_and_reason(tmp_path, one_step_dp2, capsys):
    graph = _foreign_graph(tmp_path / "graph")
    good = (graph / "other_tool.0.et").read_bytes()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "cut.0.et").write_bytes(good[: len(good) - 7])
    with pytest.raises(cs.ChakraError, match=r"cut\.0\.et: .*truncated"):
        chakra.read_et(bad / "cut.0.et")
    old = io.BytesIO()
    cs.write_messages(old, [cs.messages()["GlobalMetadata"](version="0.0.3")])
    (bad / "old.0.et").write_bytes(old.getvalue())
    with pytest.raises(cs.ChakraError, match=r"old\.0\.et: Chakra schema version '0\.0\.3'; Echo reads 0\.0\.4"):
        chakra.read_et(bad / "old.0.et")
    (bad / "noise.0.et").write_bytes(b"\x05hello world, not protobuf")
    with pytest.raises(cs.ChakraError, match=r"noise\.0\.et"):
        chakra.read_et(bad / "noise.0.et")
    w = load_workload("tiny-dp2", root=one_step_dp2)
    lonely = tmp_path / "lonely"
    _foreign_graph(lonely, ranks=(0,))
    (lonely / "other_tool.0.et").rename(lonely / "other_tool.et")
    with pytest.raises(cs.ChakraError, match=r"name it prefix\.\{rank\}\.et"):
        chakra.import_trace(lonely, tmp_path / "out", w)
    (lonely / "other_tool.et").rename(lonely / "other_tool.5.et")
    with pytest.raises(cs.ChakraError, match=r"other_tool\.5\.et: rank 5 is not in the workload's world of 2"):
        chakra.import_trace(lonely, tmp_path / "out", w)
    assert not (tmp_path / "out").exists()  # nothing written before every file was checked
    # a workload that would repeat the whole-step graph per micro-batch
    two = load_workload("tiny-dp2")
    with pytest.raises(cs.ChakraError, match="one micro-batch on one pipeline stage"):
        chakra.import_trace(graph, tmp_path / "out", two)
    shutil.copy(bad / "old.0.et", tmp_path / "x.0.et")
    assert main(["chakra-import", str(tmp_path / "x.0.et"), "--workload", "tiny-dp2", "--results",
                 str(tmp_path / "res"), "--config-dir", str(one_step_dp2)]) == 2
    assert "x.0.et: Chakra schema version" in capsys.readouterr().err
