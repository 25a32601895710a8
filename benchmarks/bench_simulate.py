"""Wall time of the simulate stage on synthetic GPT-3 175B-shaped traces.

Builds, per pipeline stage, the ops a TP8 rank of GPT-3 175B launches (the layer's GEMMs,
attention, norms, element-wise ops and TP all-reduces, forward and backward; embedding and LM
head on the end stages; Megatron-sized gradient buckets reduce-scattered over DP; fused Adam and
the parameter all-gather), roofline kernel times for an H100, and an alpha-beta network model.
Then runs echo.simulate.run_simulate end to end (reading and writing the artifacts) and prints
its wall time, first for the two target jobs, then as micro-batches and world size grow.

    .venv/bin/python benchmarks/bench_simulate.py
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from echo.artifacts import COMMS, KERNELS, OPS, RANK_CLASSES, TRACED_RANKS
from echo.config import load_hardware, load_topology, parse_workload
from echo.simulate import run_simulate

H, S, LAYERS, VOCAB, TP = 12288, 2048, 96, 51200, 8
BUCKET = 40_000_000
PEAK, HBM = 989e12 * 0.8, 3.35e12 * 0.85  # H100 bf16 flop/s and bytes/s at achievable efficiency


@dataclass(frozen=True)
class AlphaBeta:
    """A stand-in network model: latency plus bytes over a bus bandwidth that drops off-node."""

    def estimate(self, op: str, *, group: list[int], nbytes: int):
        n = len(group)
        nodes = len({r // 8 for r in group})
        bw = 360e9 if nodes == 1 else 45e9
        factor = {"all_reduce": 2 * (n - 1) / n, "send": 1.0, "recv": 1.0}.get(op, (n - 1) / n)
        return type("Estimate", (), {"time_us": 10.0 + 1e6 * nbytes * factor / bw})()


class Rank:
    """Rows of one representative's trace."""

    def __init__(self, rank: int):
        self.rank, self.ops, self.comms, self.kernels = rank, [], [], {}

    def op(self, phase: str, name: str, flops: float = 0.0, nbytes: float = 0.0) -> None:
        key = f"{name}|{flops:.0f}|{nbytes:.0f}"
        self.kernels[key] = flops / PEAK * 1e6 + nbytes / HBM * 1e6 + 3.0
        self._row(phase, "compute", "compute", name, flops, key, -1)

    def comm(self, phase: str, op: str, group: list[int], kind: str, blocking: bool, nbytes: int) -> None:
        cid = len(self.comms)
        p2p = op in ("send", "recv")
        self.comms.append(dict(rank=self.rank, comm_id=cid, seq=len(self.ops), op=op, group=group,
                               group_size=len(group), group_kind=kind, bytes=nbytes, peer=-1, dtype="bfloat16",
                               phase=phase, chunk=0, blocking=blocking))
        stream = "p2p" if p2p else ("compute" if blocking else "comm")
        self._row(phase, "p2p" if p2p else "collective", stream, op, 0.0, "", cid)

    def _row(self, phase, kind, stream, name, flops, key, cid) -> None:
        self.ops.append(dict(rank=self.rank, seq=len(self.ops), name=name, op_class="gemm", kind=kind, phase=phase,
                             chunk=0, microbatch=-1, stream=stream, shapes="[]", args="{}", dtype="bfloat16",
                             flops=flops, bytes=0.0, kernel_key=key, comm_id=cid))


def layer(r: Rank, phase: str, tp_group: list[int]) -> None:
    """One transformer layer of a TP8 rank; backward runs each GEMM twice (dgrad, wgrad)."""
    act = 2.0 * S * H
    gemms = [("qkv", 2 * S * H * 3 * H / TP), ("proj", 2 * S * H * H / TP),
             ("fc1", 2 * S * H * 4 * H / TP), ("fc2", 2 * S * 4 * H * H / TP)]
    attn = 4.0 * S * S * H / TP / 2  # causal
    reps = 1 if phase == "forward" else 2
    for name in ("ln1", "attn", "proj", "ar", "ln2", "fc1", "gelu", "fc2", "ar2"):
        if name in ("ar", "ar2"):
            r.comm(phase, "all_reduce", tp_group, "tp", True, int(act))
        elif name == "attn":
            r.op(phase, f"sdpa_{phase}", attn * reps, 4 * act / TP)
        elif name in ("ln1", "ln2", "gelu"):
            r.op(phase, f"{name}_{phase}", 0.0, 2 * act * reps)
            r.op(phase, f"add_{phase}", 0.0, 3 * act)
        for g, flops in gemms:
            if g == name or (name == "attn" and g == "qkv"):
                for i in range(reps):
                    r.op(phase, f"{g}_{phase}{i}", flops, act)


def stage_rank(s: int, pp: int, dp: int) -> Rank:
    base = s * dp * TP
    r = Rank(base)
    tp_group, dp_group = list(range(base, base + TP)), [base + d * TP for d in range(dp)]
    prev, nxt = base - dp * TP, base + dp * TP
    layers = LAYERS // pp
    act = 2 * S * H
    for phase in ("forward", "backward"):
        src, dst = (prev, nxt) if phase == "forward" else (nxt, prev)
        first, last = (s == 0, s == pp - 1) if phase == "forward" else (s == pp - 1, s == 0)
        if not first:
            r.comm(phase, "recv", sorted([base, src]), "pp", True, act)
        if s == 0 and phase == "forward":
            r.op(phase, "embedding", 0.0, 2.0 * act)
        for _ in range(layers):
            layer(r, phase, tp_group)
        if s == pp - 1:
            r.op(phase, f"head_{phase}", 2 * S * H * VOCAB / TP * (1 if phase == "forward" else 2), act)
        if not last:
            r.comm(phase, "send", sorted([base, dst]), "pp", False, act)
    params = layers * 12 * H * H // TP
    for b in range(-(-params // BUCKET)):
        n = min(BUCKET, params - b * BUCKET)
        r.comm("grad_sync", "reduce_scatter", dp_group, "dp", False, 4 * n)
    for b in range(-(-params // BUCKET)):
        n = min(BUCKET, params - b * BUCKET)
        r.op("optimizer", "adam", 0.0, 16.0 * n / dp)
        r.comm("optimizer", "all_gather", dp_group, "dp", True, 2 * n)
    return r


def write_case(root: Path, pp: int, dp: int) -> list[Rank]:
    ranks = [stage_rank(s, pp, dp) for s in range(pp)]
    trace = root / "trace"
    trace.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([o for r in ranks for o in r.ops], OPS), trace / "ops.parquet")
    pq.write_table(pa.Table.from_pylist([c for r in ranks for c in r.comms], COMMS), trace / "comms.parquet")
    params = LAYERS // pp * 12 * H * H // TP
    pq.write_table(pa.Table.from_pylist([dict(
        rank=r.rank, role=f"pp{s}", pp_rank=s, tp_rank=0, dp_rank=0, cp_rank=0, graph_hash=f"h{s}",
        param_bytes=2 * params, grad_bytes=4 * params, optimizer_bytes=12 * params // dp,
        activation_bytes_per_microbatch=34 * S * H * (LAYERS // pp) // TP, trace_wall_s=0.0)
        for s, r in enumerate(ranks)], TRACED_RANKS), trace / "ranks.parquet")
    world = pp * dp * TP
    per_stage = dp * TP
    pq.write_table(pa.table({
        "rank": pa.array(range(world), pa.int32()), "class_id": pa.array([r // per_stage for r in range(world)], pa.int32()),
        "representative": pa.array([r // per_stage * per_stage for r in range(world)], pa.int32()),
        "graph_hash": pa.array(["h"] * world), "pp_rank": pa.array([r // per_stage for r in range(world)], pa.int32()),
        "tp_rank": pa.array([r % TP for r in range(world)], pa.int32()),
        "dp_rank": pa.array([(r // TP) % dp for r in range(world)], pa.int32()),
        "cp_rank": pa.array([0] * world, pa.int32()), "node": pa.array([-1] * world, pa.int32())},
        schema=RANK_CLASSES), root / "rank_classes.parquet")
    kernels = {k: v for r in ranks for k, v in r.kernels.items()}
    pq.write_table(pa.Table.from_pylist([dict(
        kernel_key=k, name=k, op_class="", shapes="[]", dtype="bfloat16", flops=0.0, bytes=0.0, duration_us=us,
        achieved_tflops=0.0, achieved_GBps=0.0, source="model", count=1) for k, us in kernels.items()], KERNELS),
        root / "kernels.parquet")
    return ranks


def case(pp: int, dp: int, micro_batches: int) -> dict:
    workload = parse_workload({
        "model": {"arch": "gpt", "layers": LAYERS, "hidden": H, "heads": 96, "vocab": VOCAB, "seq_len": S},
        "parallel": {"tp": TP, "pp": pp, "dp": dp, "zero": 1, "schedule": "1f1b"},
        "training": {"global_batch": micro_batches * dp, "micro_batch": 1, "dtype": "bf16"}},
        Path(f"gpt3-175b-pp{pp}-dp{dp}-m{micro_batches}.yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ranks = write_case(root, pp, dp)
        t0 = time.perf_counter()
        s = run_simulate(workload, load_hardware("h100-sxm-80gb"), load_topology("dgx-h100-ndr"), root / "trace",
                         root / "rank_classes.parquet", root / "kernels.parquet", root, root / "out",
                         network=AlphaBeta()).to_pylist()[0]
        wall = time.perf_counter() - t0
    return dict(gpus=workload.world_size, pp=pp, dp=dp, m=micro_batches, ops=sum(len(r.ops) for r in ranks),
                events=s["events"], step_s=s["step_time_s"], mfu=s["mfu"], sim_wall_s=s["sim_wall_s"], wall_s=wall)


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'gpus':>6} {'pp':>3} {'dp':>4} {'m':>4} {'ops':>6} {'events':>6} {'step_s':>8} {'mfu':>6} "
          f"{'sim_wall_s':>10} {'wall_s':>7}")
    for r in rows:
        print(f"{r['gpus']:>6} {r['pp']:>3} {r['dp']:>4} {r['m']:>4} {r['ops']:>6} {r['events']:>6} "
              f"{r['step_s']:>8.3f} {r['mfu']:>6.3f} {r['sim_wall_s']:>10.3f} {r['wall_s']:>7.3f}")


def main() -> None:
    show("GPT-3 175B targets (TP8): 1,024 GPUs PP8 DP16 m96 (< 10 s), 16,384 GPUs PP16 DP128 m64 (< 60 s)",
         [case(8, 16, 96), case(16, 128, 64)])
    show("growth with micro-batches (1,024 GPUs, PP8 DP16)", [case(8, 16, m) for m in (24, 96, 384, 1536)])
    show("growth with world size (PP16, 64 micro-batches)", [case(16, dp, 64) for dp in (8, 32, 128, 512)])


if __name__ == "__main__":
    main()
