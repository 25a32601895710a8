"""Wall time and memory of the simulate stage on real traces of GPT-3 175B, and its FLOPs check.

For each job the earlier stages run once and are cached under benchmarks/out/ (keyed by the
workload and the trace stage's code version): the real trace of one representative rank per
pipeline stage (``echo.trace.run_trace``), the rank classes (``echo.dedup.rank_classes``), A100
kernel times (``echo.profile.run_profile``, the roofline model) and the DGX A100 network model
(``echo.network.run_calibrate``). Then ``echo.simulate.run_simulate`` runs in a fresh process per
case (warm cache: only the simulate stage is timed) and the table shows its ``sim_wall_s`` (the
stage's own clock, reading and writing artifacts included), the process' peak RSS, and how both
grow with micro-batches and world size.

    .venv/bin/python benchmarks/bench_simulate.py          # or: make bench

The first run traces 4 layouts of GPT-3 175B (8 or 16 pipeline roles each), several minutes on
2 cores; later runs only simulate.
"""

from __future__ import annotations

import hashlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
HARDWARE, TOPOLOGY = "a100-sxm-80gb", "dgx-a100-hdr"
MODEL = {"arch": "gpt", "layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq_len": 2048}


def workload_dict(pp: int, dp: int, global_batch: int, tp: int = 8, schedule: str = "1f1b") -> dict:
    par = {"tp": tp, "pp": pp, "dp": dp, "zero": 1, "schedule": schedule}
    if schedule == "zb-v":  # two chunks a rank in a V
        par["virtual_stages"] = 2
    if schedule.startswith("zb-"):
        par["post_validation"] = True
    return {"model": MODEL, "parallel": par,
            "training": {"global_batch": global_batch, "micro_batch": 1, "dtype": "bf16", "recompute": "none"}}


def parse(spec: dict, name: str):
    from echo.config import parse_workload

    return parse_workload(spec, Path(f"{name}.yaml"))


def cached_root(prefix: str, spec: dict) -> Path:
    """Where a job's earlier stages are cached: keyed by its spec and the trace stage's code version."""
    from echo.workflow.versions import code_version

    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode() + code_version("trace").encode()).hexdigest()[:10]
    return OUT / f"{prefix}-{key}"


def prepare_job(w, root: Path, hardware: str = HARDWARE, topology: str = TOPOLOGY) -> Path:
    """Trace, rank classes, kernel times and network model of workload ``w`` under ``root``, once."""
    if (root / "done").is_file():
        return root
    import pyarrow.parquet as pq

    from echo.artifacts import RANK_CLASSES
    from echo.config import load_hardware, load_topology
    from echo.dedup import rank_classes
    from echo.io import write_parquet
    from echo.network import run_calibrate
    from echo.profile import run_profile
    from echo.trace import run_trace

    t0 = time.perf_counter()
    print(f"  preparing {root.name}: tracing ...", flush=True)
    run_trace(w, root / "trace")
    write_parquet(rank_classes(w, pq.read_table(root / "trace" / "ranks.parquet")), root / "rank_classes.parquet",
                  RANK_CLASSES)
    run_profile(load_hardware(hardware), root / "trace", root / "kernels.parquet")
    run_calibrate(load_topology(topology), root / "calib")
    (root / "done").write_text(f"{time.perf_counter() - t0:.1f} s\n")
    print(f"  prepared in {time.perf_counter() - t0:.0f} s", flush=True)
    return root


def prepare(pp: int, dp: int, v: bool = False) -> Path:
    """Trace, classes, kernels and network of GPT-3 175B at TP8 x pp x dp, cached (``v``: in
    ZB-V's placement, two chunks a rank). The traced graph does not depend on the global batch
    nor on the schedule beyond the chunk placement (the schedule repeats one micro-batch's template)."""
    spec = workload_dict(pp, dp, dp, schedule="zb-v" if v else "1f1b")
    root = cached_root(f"gpt3-175b-tp8-pp{pp}-dp{dp}{'-v' if v else ''}", spec)
    return prepare_job(parse(spec, root.name), root)


def simulate_one(args: dict) -> dict:
    """Body of the per-case process: run the simulate stage, report its figures and peak RSS."""
    from echo.config import load_hardware, load_topology
    from echo.simulate import run_simulate

    root = Path(args["root"])
    w = parse(args["workload"], args["name"])
    hardware = load_hardware(HARDWARE)
    if not args.get("host", True):  # the peer without the launching host's clock
        hardware = hardware.model_copy(update={"host": None})
    s = run_simulate(w, hardware, load_topology(TOPOLOGY), root / "trace", root / "rank_classes.parquet",
                     root / "kernels.parquet", root / "calib", root / "sim" / args["name"],
                     mode=args.get("mode", "symmetric")).to_pylist()[0]
    keep = ("world_size", "micro_batches", "events", "step_time_s", "mfu", "tflops_per_gpu", "executed_flops",
            "model_flops", "sim_wall_s", "bubble_fraction", "slowdown_s", "fits", "peak_mem_gib", "exposed_comm_s",
            "host_wait_s")
    out = {k: s[k] for k in keep}
    out["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return out


def case(pp: int, dp: int, micro_batches: int, schedule: str = "1f1b", host: bool = True) -> dict:
    root = prepare(pp, dp, v=schedule == "zb-v")
    name = f"gpt3-175b-pp{pp}-dp{dp}-m{micro_batches}-{schedule}" + ("" if host else "-nohost")
    args = {"root": str(root), "name": name, "host": host,
            "workload": workload_dict(pp, dp, micro_batches * dp, schedule=schedule)}
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(args)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{name}: simulate failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row.update(pp=pp, dp=dp, schedule=schedule)
    return row


def analytic_flops(global_batch: int) -> float:
    """Megatron-LM's model FLOPs of one GPT iteration without recomputation (Narayanan et al. 2021,
    eq. 3 with 72 for 96): 72 B s l h^2 (1 + s / (6 h) + V / (12 l h))."""
    s, layers, h, v = MODEL["seq_len"], MODEL["layers"], MODEL["hidden"], MODEL["vocab"]
    return 72.0 * global_batch * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'schedule':>8} {'gpus':>6} {'pp':>3} {'dp':>4} {'m':>4} {'events':>6} {'step_s':>8} {'mfu':>6} "
          f"{'bubble':>6} {'sim_wall_s':>10} {'rss_GiB':>8} {'us/event':>8}")
    for r in rows:
        print(f"{r['schedule']:>8} {r['world_size']:>6} {r['pp']:>3} {r['dp']:>4} {r['micro_batches']:>4} {r['events']:>6} "
              f"{r['step_time_s']:>8.3f} {r['mfu']:>6.3f} {r['bubble_fraction']:>6.3f} {r['sim_wall_s']:>10.3f} "
              f"{r['rss_gib']:>8.3f} {1e6 * r['sim_wall_s'] / r['events']:>8.1f}")


def main() -> None:
    print(f"simulate stage on real GPT-3 175B traces (TP8, {HARDWARE}, {TOPOLOGY}, symmetric mode)")
    small, large = case(8, 16, 96), case(16, 128, 64)
    show("targets: 1,024 GPUs TP8 PP8 DP16 batch 1536 (sim_wall_s <= 10), "
         "16,384 GPUs TP8 PP16 DP128 batch 8192 (<= 60), peak RSS < 4 GiB", [small, large])
    for r, ok in ((small, small["sim_wall_s"] <= 10), (large, large["sim_wall_s"] <= 60)):
        print(f"  {r['world_size']:>6} GPUs: sim_wall_s {r['sim_wall_s']:.2f} s, peak RSS {r['rss_gib']:.2f} GiB: "
              f"{'ok' if ok and r['rss_gib'] < 4 else 'OVER BUDGET'}")
    # the host clock's cost: the same 16K-GPU case without Hardware.host, side by side
    bare = case(16, 128, 64, host=False)
    print(f"  host launches: sim_wall_s {large['sim_wall_s']:.2f} s with, {bare['sim_wall_s']:.2f} s without "
          f"(ratio {large['sim_wall_s'] / bare['sim_wall_s']:.2f}); host wait {large['host_wait_s']:.3f} s of a "
          f"{large['step_time_s']:.2f} s step")
    want = analytic_flops(1536)
    print(f"\nexecuted FLOPs, 1,024 GPUs, batch 1536, no recompute: {small['executed_flops']:.4e} from the trace, "
          f"{want:.4e} analytic (72 B s l h^2 (1 + s/6h + V/12lh)): ratio {small['executed_flops'] / want:.4f}")
    show("growth with micro-batches (1,024 GPUs, TP8 PP8 DP16)", [case(8, 16, m) for m in (24, 96, 384)])
    show("growth with world size (TP8 PP16, 64 micro-batches)", [case(16, dp, 64) for dp in (8, 32, 128)])
    # the zero-bubble schedules (W tasks: three tasks a micro-batch instead of two; zb-2p and zb-v
    # are built for the pass times first): still flat in world size, 16,384 GPUs under 2 s
    rows = [case(16, dp, 64, s) for s in ("zb-h1", "zb-2p", "zb-v") for dp in (8, 128)]
    show("zero-bubble schedules, growth with world size (TP8 PP16, 64 micro-batches, post-validation)", rows)
    for r in rows:
        if r["world_size"] == 16384:
            print(f"  {r['schedule']}: 16,384 GPUs in {r['sim_wall_s']:.2f} s: {'ok' if r['sim_wall_s'] < 2 else 'OVER 2 s'}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(simulate_one(json.loads(sys.argv[2]))))
    else:
        main()
