"""Measure the overlap slowdown on this machine: kernels timed with and without gloo traffic.

``measure_slowdown()`` starts ``RANKS`` processes joined by torch.distributed over gloo on
127.0.0.1 (as the real multi-process runs of the tiny workloads are), one torch thread each as
the profile stage times kernels. Every process times one kernel of each op class, in alternating
windows:

- quiet: every rank computes, no communication in flight;
- busy: a background thread of every rank runs back-to-back all-reduces of ``COMM_BYTES``
  (gloo does the transfer and the reduction on its own threads, which compete with the compute
  thread for the cores and memory bandwidth, as a NCCL kernel competes for a GPU's SMs and HBM).

A window's time is the median of its samples (each sample a batch of calls lasting about
``SAMPLE_S``); only samples that started and ended while the traffic was running count as busy.
``s = median over window pairs of busy / quiet - 1``, over the windows of every rank. Quiet and
busy windows alternate so that drift (clock, other jobs) hits both alike.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa

from echo.launch import free_port, launch, wait
from echo.overlap.table import OP_CLASSES, SLOWDOWN

log = logging.getLogger(__name__)

RANKS = 2
THREADS = 1
COMM_OP = "all_reduce"
COMM_BYTES = 16 << 20  # about a tiny workload's whole gradient bucket (4.2 M fp32 parameters)
WINDOW_S = 0.08        # one quiet or busy window of one kernel
PAIRS = 9              # quiet/busy window pairs per kernel
SAMPLE_S = 0.002       # one timed sample (a batch of calls)
TIMEOUT_S = 600.0


def _kernels():
    """op class -> (description, zero-argument call): shapes of the tiny workloads (hidden 256,
    8 heads, sequence 128, micro-batch 2, vocabulary 4096, fp32), one representative op each."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    tokens, h, ffn, heads, seq, vocab = 256, 256, 1024, 8, 128, 4096
    a, w = torch.randn(tokens, h, generator=g), torch.randn(h, ffn, generator=g)
    act = torch.randn(tokens, ffn, generator=g)
    q, k, v = (torch.randn(2, heads, seq, h // heads, generator=g) for _ in range(3))
    scores = torch.randn(2 * heads, seq, seq, generator=g)
    ln_w, ln_b = torch.ones(h), torch.zeros(h)
    emb, idx = torch.randn(vocab, h, generator=g), torch.randint(0, vocab, (tokens,), generator=g)
    logits, target = torch.randn(tokens, vocab, generator=g), torch.randint(0, vocab, (tokens,), generator=g)
    n = 1 << 20
    params, grads, m, v2 = ([torch.randn(n, generator=g)] for _ in range(4))
    steps = [torch.zeros(())]
    dst = torch.empty_like(act)
    return {
        "gemm": (f"mm {tokens}x{h} @ {h}x{ffn}", lambda: torch.mm(a, w)),
        "attention": (f"sdpa causal 2x{heads}x{seq}x{h // heads}",
                      lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        "elementwise": (f"gelu {tokens}x{ffn}", lambda: F.gelu(act)),
        "norm": (f"layer_norm {tokens}x{h}", lambda: F.layer_norm(a, (h,), ln_w, ln_b)),
        "softmax": (f"softmax {2 * heads}x{seq}x{seq}", lambda: torch.softmax(scores, -1)),
        "embedding": (f"embedding {tokens} of {vocab}x{h}", lambda: F.embedding(idx, emb)),
        "cross_entropy": (f"cross_entropy {tokens}x{vocab}", lambda: F.cross_entropy(logits, target)),
        "optimizer": (f"_fused_adamw_ {n}", lambda: torch._fused_adamw_(
            params, grads, m, v2, [], steps, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
            amsgrad=False, maximize=False)),
        "copy": (f"copy_ {tokens}x{ffn}", lambda: dst.copy_(act)),
        "reduction": (f"sum {tokens}x{ffn} dim -1", lambda: act.sum(-1)),
        "other": (f"cumsum {tokens}x{ffn}", lambda: torch.cumsum(act, -1)),
    }


class _Traffic:
    """Back-to-back all-reduces on a background thread until any rank asks to stop (the stop
    flag rides in the reduced buffer, so every rank leaves after the same all-reduce)."""

    def __init__(self, nbytes: int):
        import torch

        self.buf = torch.zeros(nbytes // 4)
        self.stop = threading.Event()
        self.running = threading.Event()
        self.done = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import torch.distributed as dist

        while True:
            self.buf[0] = 1.0 if self.stop.is_set() else 0.0
            dist.all_reduce(self.buf)
            self.done += 1
            self.running.set()
            if self.buf[0] > 0:
                self.running.clear()
                return

    def __enter__(self) -> _Traffic:
        self.thread.start()
        self.running.wait()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _batch(call) -> int:
    """Calls per sample so that a sample lasts about SAMPLE_S."""
    for _ in range(3):
        call()
    t0 = time.perf_counter()
    call()
    one = max(time.perf_counter() - t0, 1e-7)
    return max(1, min(1000, round(SAMPLE_S / one)))


def _window(call, n: int, traffic: _Traffic | None) -> float:
    """Median microseconds per call over one window (busy: only samples fully inside traffic)."""
    samples = []
    end = time.perf_counter() + WINDOW_S
    while time.perf_counter() < end or len(samples) < 3:
        before = traffic.done if traffic else 0
        live = traffic is None or traffic.running.is_set()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        dt = (time.perf_counter() - t0) / n * 1e6
        if traffic is None or (live and traffic.running.is_set() and traffic.done >= before):
            samples.append(dt)
        if traffic is not None and not traffic.running.is_set() and len(samples) >= 1:
            break
    return statistics.median(samples)


def _worker(rank: int, spec: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=spec["ranks"])
    rows = []
    try:
        kernels = _kernels()
        with _Traffic(spec["comm_bytes"]):  # warm the connections and buffers once
            pass
        dist.barrier()
        for op_class in spec["classes"]:
            what, call = kernels[op_class]
            n = _batch(call)
            # ranks agree on the batch (the slowest's), so their windows last alike
            t = torch.tensor([float(n)])
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            n = int(t.item())
            quiet, busy = [], []
            for _ in range(spec["pairs"]):
                dist.barrier()
                quiet.append(_window(call, n, None))
                dist.barrier()
                with _Traffic(spec["comm_bytes"]) as traffic:
                    busy.append(_window(call, n, traffic))
            rows.append({"op_class": op_class, "kernel": what, "quiet": quiet, "busy": busy})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(spec["out"]).joinpath(f"rank{rank}.json").write_text(json.dumps(rows))


def measure_slowdown(classes=OP_CLASSES, ranks: int = RANKS, comm_bytes: int = COMM_BYTES, pairs: int = PAIRS,
                     threads: int = THREADS, timeout_s: float = TIMEOUT_S) -> pa.Table:
    """Run the measurement (see the module docstring); one SLOWDOWN row per op class."""
    unknown = set(classes) - set(OP_CLASSES)
    if unknown:
        raise ValueError(f"overlap measurement: unknown op classes {sorted(unknown)}; known: {OP_CLASSES}")
    if ranks < 2:
        raise ValueError("overlap measurement needs at least 2 ranks (someone to exchange traffic with)")
    with tempfile.TemporaryDirectory(prefix="echo-overlap-") as tmp:
        spec = {"ranks": ranks, "port": free_port(), "comm_bytes": int(comm_bytes), "pairs": pairs,
                "threads": threads, "classes": list(classes), "out": tmp}
        procs = launch("echo.overlap.measure", spec, ranks, Path(tmp), threads)
        wait(procs, Path(tmp), timeout_s, "overlap measurement")
        per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(ranks)]
    cols: dict[str, list] = {f.name: [] for f in SLOWDOWN}
    for i, op_class in enumerate(classes):
        quiet = [q for rows in per_rank for q in rows[i]["quiet"]]
        busy = [b for rows in per_rank for b in rows[i]["busy"]]
        ratios = [b / q for q, b in zip(quiet, busy, strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        for name, value in (("op_class", op_class), ("kernel", per_rank[0][i]["kernel"]), ("comm_op", COMM_OP),
                            ("comm_bytes", int(comm_bytes)), ("alone_us", statistics.median(quiet)),
                            ("overlapped_us", statistics.median(busy)),
                            ("slowdown", statistics.median(ratios) - 1.0), ("spread", q3 - q1),
                            ("windows", len(ratios)),
                            ("ranks", ranks), ("threads", threads), ("source", "measured")):
            cols[name].append(value)
    return pa.table(cols, schema=SLOWDOWN)


def run_overlap(hardware, out_path: Path) -> None:
    """The ``overlap`` rule's stage: measure the overlap slowdown of this machine
    (``hardware.kind`` must be cpu) into ``out_path`` (SLOWDOWN rows, one per op class). It lives
    here, not in the package's __init__, so that the simulator, which imports the table, does not
    carry the measurement's code in its code version."""
    from echo.errors import ConfigError
    from echo.io import write_parquet

    if hardware.kind != "cpu":
        raise ConfigError(f"config/hardware/{hardware.name}.yaml", "kind",
                          "the overlap slowdown is measured on this machine only (kind: cpu); GPUs use "
                          "echo.overlap.table.GPU_TABLE")
    table = measure_slowdown()
    write_parquet(table, out_path, SLOWDOWN)
    for row in table.to_pylist():
        log.info("overlap %-13s %-36s alone %9.1f us, beside %s %9.1f us: s = %.3f", row["op_class"],
                 row["kernel"], row["alone_us"], row["comm_op"], row["overlapped_us"], row["slowdown"])


if __name__ == "__main__":
    _worker(int(sys.argv[1]), json.loads(sys.argv[2]))
