"""Time of a million collective queries against the network model (issue 5: under 10 s).

The simulator asks ``NetworkModel.estimate(op, group=..., nbytes=...)`` for every collective and
p2p transfer it schedules. This benchmark replays a million such queries drawn from the groups of
a 4,096-GPU job (TP 8 x PP 8 x DP 64 on DGX A100 nodes: TP groups inside a node, strided DP
groups across 64 nodes, PP pairs between nodes) three ways:

- ``repeated``: a trace's mix, where the same (op, group, size) recurs (layers, micro-batches):
  what the simulator does, mostly cache hits;
- ``distinct``: every query a different size, so none is a cache hit (the worst case);
- ``vectorised``: one ``time_us`` call per (op, group) over all its sizes.

plus a contention case (``concurrent`` over the DP reductions of 8 pipeline stages at once).

    .venv/bin/python benchmarks/bench_network.py [--queries 1000000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from echo.config import load_topology
from echo.network import NetworkModel

TP, PP, DP, GPN = 8, 8, 64, 8


def job_groups() -> list[tuple[str, list[int]]]:
    """(op, group) pairs of a TP x PP x DP job, ranks ordered tp fastest, then dp, then pp."""
    def rank(t: int, d: int, p: int) -> int:
        return t + TP * (d + DP * p)

    out: list[tuple[str, list[int]]] = []
    for p in range(PP):
        for d in range(0, DP, 8):
            out.append(("all_reduce", [rank(t, d, p) for t in range(TP)]))            # TP
        for t in range(TP):
            group = [rank(t, d, p) for d in range(DP)]
            out += [("reduce_scatter", group), ("all_gather", group)]                  # DP (ZeRO-1)
        if p + 1 < PP:
            out += [("send", [rank(0, 0, p), rank(0, 0, p + 1)]), ("recv", [rank(0, 0, p + 1), rank(0, 0, p)])]
    return out


def _timed(fn) -> tuple[float, float, object]:
    """(wall s, cpu s, result) of fn()."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=1_000_000)
    args = parser.parse_args()
    n = args.queries
    topo = load_topology("dgx-a100-hdr")
    groups = job_groups()
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(groups), n)
    common_sizes = np.array([1 << s for s in range(10, 31)], dtype=np.int64)

    sizes = common_sizes[rng.integers(0, common_sizes.size, n)].tolist()
    distinct_sizes = ((rng.permutation(n) + 1) * 997).tolist()  # n different sizes: no cache hits
    queries = [groups[i] for i in picks.tolist()]

    def scalar(model: NetworkModel, sizes: list[int]) -> float:
        return sum(model.estimate(op, group, nbytes=s).time_us for (op, group), s in zip(queries, sizes, strict=True))

    def vectorised(model: NetworkModel) -> float:
        chunks = np.array_split(np.array(distinct_sizes), len(groups))
        return sum(float(model.time_us(op, group, nbytes=c).sum()) for (op, group), c in zip(groups, chunks, strict=True))

    results = {
        "repeated (trace mix, cached)": _timed(lambda: scalar(NetworkModel(topo), sizes)),
        "distinct (no cache hits)": _timed(lambda: scalar(NetworkModel(topo), distinct_sizes)),
        "vectorised time_us": _timed(lambda: vectorised(NetworkModel(topo))),
    }
    print(f"{len(groups)} distinct (op, group) pairs of a {TP * PP * DP}-GPU job; {n:,} queries each way")
    for name, (wall, cpu, _) in results.items():
        print(f"  {name:30s} {wall:6.2f} s wall {cpu:6.2f} s cpu   {wall / n * 1e6:5.2f} us/query")

    # contention: the DP reduce-scatters of all 8 TP ranks of every stage at once use different
    # rails (no slowdown); 8 all-reduces over the same 8 nodes share every NIC (8x slower)
    model = NetworkModel(topo)
    dp = [(op, g, 256 << 20) for op, g in groups if op == "reduce_scatter"]
    crowd = [("all_reduce", list(range(64)), 256 << 20)] * 8
    wall, _, (shared, crowded) = _timed(lambda: (model.concurrent(dp), model.concurrent(crowd)))
    alone_dp = model.estimate(dp[0][0], dp[0][1], nbytes=dp[0][2]).time_us
    alone_ar = model.estimate(crowd[0][0], crowd[0][1], nbytes=crowd[0][2]).time_us
    print(f"  concurrent ({len(dp)} + {len(crowd)} transfers) {wall * 1e3:6.1f} ms: DP reduce-scatters on "
          f"separate rails x{max(shared) / alone_dp:.2f}, 8 all-reduces on one set of NICs x{max(crowded) / alone_ar:.2f}")
    worst = max(wall for wall, _, _ in results.values())
    print(f"{'PASS' if worst < 10 else 'FAIL'}: a million queries in {worst:.2f} s wall (target < 10 s)")

if __name__ == "__main__":
    main()
