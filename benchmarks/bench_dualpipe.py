"""Wall time of the simulate stage on DualPipe at 2,048 and 16,384 GPUs (issue 19's bound: 16,384
GPUs in under 2 s, flat in world size).

The job is ``config/workloads/deepseek-v3-2048-dualpipe.yaml`` (DeepSeek-V3, PP16 x EP64 x DP128,
DualPipe, 120 micro-batches a step) and the same at DP 1,024 with the global batch scaled so the
micro-batch count stays 120. The earlier stages (trace, rank classes, H100 kernel times, the
dgx-h100-ndr network model) run once and are cached under benchmarks/out/ (keyed by the workload
and the trace stage's code version); each case then simulates in a fresh process, ``REPEATS``
times alternating the two sizes (the machine's pace drifts: the two sizes are compared run for
run), and the table shows each size's ``sim_wall_s`` (the stage's own clock, reading and writing
artifacts included): median and fastest.

    .venv/bin/python benchmarks/bench_dualpipe.py          # or: make bench

The first run traces both layouts (about a minute each on 2 cores); later runs only simulate.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench_simulate import cached_root, prepare_job  # this folder is on the path of a script run from it

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD, HARDWARE, TOPOLOGY = "deepseek-v3-2048-dualpipe", "h100-sxm-80gb", "dgx-h100-ndr"
REPEATS = 5


def spec_at(dp: int) -> dict:
    """The shipped workload's config at data-parallel degree ``dp``, 120 micro-batches a step."""
    from echo.config.loader import config_path, read_yaml

    spec = read_yaml(config_path("workload", WORKLOAD, ROOT / "config"))
    spec["parallel"]["dp"] = dp
    spec["training"]["global_batch"] = spec["training"]["global_batch"] // 128 * dp
    return spec


def parse(spec: dict, name: str):
    from echo.config import parse_workload

    return parse_workload(spec, ROOT / "config" / "workloads" / f"{name}.yaml")


def prepare(dp: int) -> Path:
    """Trace, classes, kernels and network of the job at ``dp``, cached (bench_simulate's cache)."""
    spec = spec_at(dp)
    root = cached_root(f"deepseek-v3-dualpipe-dp{dp}", spec)
    return prepare_job(parse(spec, root.name), root, HARDWARE, TOPOLOGY)


def simulate_one(args: dict) -> dict:
    """Body of the per-case process: run the simulate stage, report its figures."""
    from echo.config import load_hardware, load_topology
    from echo.simulate import run_simulate

    root = Path(args["root"])
    s = run_simulate(parse(args["spec"], args["name"]), load_hardware(HARDWARE), load_topology(TOPOLOGY),
                     root / "trace", root / "rank_classes.parquet", root / "kernels.parquet", root / "calib",
                     root / "sim").to_pylist()[0]
    return {k: s[k] for k in ("world_size", "micro_batches", "events", "step_time_s", "sim_wall_s")}


def run_case(dp: int) -> dict:
    args = {"root": str(prepare(dp)), "name": f"{WORKLOAD}-dp{dp}", "spec": spec_at(dp)}
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(args)], capture_output=True, text=True,
                          cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"dp {dp}: simulate failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    sizes = (128, 1024)
    for dp in sizes:
        prepare(dp)
    runs: dict[int, list[dict]] = {dp: [] for dp in sizes}
    for _ in range(REPEATS):  # alternating, so that both sizes see the same drift of the machine
        for dp in sizes:
            runs[dp].append(run_case(dp))
    print(f"\nDualPipe, DeepSeek-V3 PP16 x EP64, 120 micro-batches, {REPEATS} runs a size, alternating")
    print(f"{'GPUs':>6} {'events':>7} {'step_s':>8} {'sim_wall_s median':>18} {'fastest':>8}")
    walls = {}
    for dp in sizes:
        r = runs[dp][0]
        walls[dp] = [x["sim_wall_s"] for x in runs[dp]]
        print(f"{r['world_size']:>6} {r['events']:>7} {r['step_time_s']:>8.3f} {statistics.median(walls[dp]):>18.2f} "
              f"{min(walls[dp]):>8.2f}")
    ratio = statistics.median(b / a for a, b in zip(walls[sizes[0]], walls[sizes[1]], strict=True))
    big = statistics.median(walls[sizes[1]])
    print(f"  16,384 / 2,048 GPUs, run for run: median ratio {ratio:.2f} (flat: about 1)")
    print(f"  16,384 GPUs in {big:.2f} s (median): {'ok' if big < 2 else 'OVER 2 s'}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(simulate_one(json.loads(sys.argv[2]))))
    else:
        main()
