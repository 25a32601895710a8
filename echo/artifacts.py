"""Column contracts of every Parquet artifact, the one place each stage's output shape is defined.

Stages write with ``echo.io.write_parquet(table, path, SCHEMA)``, which checks these columns
(extra columns are allowed and kept). Paths: docs/DESIGN.md, "Paths".
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

RESULTS = Path("results")

# --- trace: results/trace/{workload}/ ------------------------------------------------------
# One row per recorded op of one traced (representative) rank. The traced step is one forward
# and one backward of one micro-batch per chunk plus the optimizer step; the schedule composes.
OPS = pa.schema([
    ("rank", pa.int32()),        # global rank of the representative that ran the op
    ("seq", pa.int32()),         # order of the op within that rank's trace
    ("name", pa.string()),       # aten overload, e.g. aten.mm.default, or c10d op name
    ("op_class", pa.string()),   # gemm | attention | elementwise | norm | softmax | embedding |
                                 # cross_entropy | optimizer | copy | reduction | collective | p2p | other
    ("kind", pa.string()),       # compute | collective | p2p | memcpy
    ("phase", pa.string()),      # forward | backward | recompute | grad_sync | optimizer
                                 # (grad_sync: the data-parallel gradient reduction after the last
                                 # micro-batch's backward; optimizer: the step and any param all-gather)
    ("chunk", pa.int32()),       # virtual stage index on this pipeline rank
    ("microbatch", pa.int32()),  # -1: a per-micro-batch template the schedule repeats
    ("stream", pa.string()),     # compute | comm | p2p
    ("shapes", pa.string()),     # JSON list of input tensor shapes
    ("args", pa.string()),       # JSON of the call: tensors as {"T": shape, "dt": dtype}, scalars as is;
                                 # enough for the profile stage to rebuild and time the kernel
    ("dtype", pa.string()),      # dtype of the first tensor input (torch name, e.g. bfloat16)
    ("flops", pa.float64()),     # matmul-class FLOPs (GEMM, attention); 0 for the rest
    ("bytes", pa.float64()),     # bytes read + written by the op
    ("kernel_key", pa.string()), # op + shapes + dtype + flags: the unit the profile stage times
    ("comm_id", pa.int32()),     # row in comms.parquet for collectives/p2p, else -1
    ("dtensor", pa.int32()),     # DTensor-level calls this kernel stands for (its own, and the
                                 # kernel-less views before it); 0 without DTensor. In kernel_key.
])

# One row per collective or p2p transfer of one traced rank.
COMMS = pa.schema([
    ("rank", pa.int32()),
    ("comm_id", pa.int32()),
    ("seq", pa.int32()),          # the op's seq in ops.parquet
    ("op", pa.string()),          # all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | send | recv
    ("group", pa.list_(pa.int32())),  # global ranks of the group (for p2p: [self, peer])
    ("group_size", pa.int32()),
    ("group_kind", pa.string()),  # tp | dp | pp | cp | ep | world
    ("bytes", pa.int64()),        # message size as nccl-tests counts it: all_reduce = buffer,
                                  # all_gather = whole output, reduce_scatter = whole input, p2p = tensor
    ("peer", pa.int32()),         # p2p peer's global rank, -1 for collectives
    ("dtype", pa.string()),
    ("phase", pa.string()),
    ("chunk", pa.int32()),
    ("blocking", pa.bool_()),     # the compute stream waits for it right away (e.g. TP all-reduce)
])

# Dependencies between ops of one rank (by seq).
DEPS = pa.schema([
    ("rank", pa.int32()),
    ("src", pa.int32()),
    ("dst", pa.int32()),
    ("kind", pa.string()),        # data | stream | wait
])

# One row per traced rank: its role, mesh coordinates and memory model.
TRACED_RANKS = pa.schema([
    ("rank", pa.int32()),
    ("role", pa.string()),        # e.g. "pp3": what makes this rank's graph distinct
    ("pp_rank", pa.int32()),
    ("tp_rank", pa.int32()),
    ("dp_rank", pa.int32()),
    ("cp_rank", pa.int32()),
    ("graph_hash", pa.string()),  # canonical hash, independent of absolute rank ids
    ("param_bytes", pa.int64()),  # per-rank model parameters (compute dtype)
    ("grad_bytes", pa.int64()),
    ("optimizer_bytes", pa.int64()),       # master weights + moments held by this rank
    ("activation_bytes_per_microbatch", pa.int64()),  # saved for backward by one micro-batch
    ("trace_wall_s", pa.float64()),
])

# --- dedup: results/dedup/{workload}/rank_classes.parquet ----------------------------------
RANK_CLASSES = pa.schema([
    ("rank", pa.int32()),
    ("class_id", pa.int32()),
    ("representative", pa.int32()),  # traced rank whose graph this rank shares
    ("graph_hash", pa.string()),
    ("pp_rank", pa.int32()),
    ("tp_rank", pa.int32()),
    ("dp_rank", pa.int32()),
    ("cp_rank", pa.int32()),
    ("node", pa.int32()),            # filled by simulate's placement; -1 here
])

# --- profile: results/profile/{workload}/{hardware}/kernels.parquet ------------------------
KERNELS = pa.schema([
    ("kernel_key", pa.string()),
    ("name", pa.string()),
    ("op_class", pa.string()),
    ("shapes", pa.string()),
    ("dtype", pa.string()),
    ("flops", pa.float64()),
    ("bytes", pa.float64()),
    ("duration_us", pa.float64()),
    ("achieved_tflops", pa.float64()),
    ("achieved_GBps", pa.float64()),
    ("source", pa.string()),          # measured | model | imported
    ("count", pa.int64()),            # occurrences across the traced ranks
])

# --- calibrate: results/calibrate/{topology}/collectives.parquet ---------------------------
COLLECTIVES = pa.schema([
    ("op", pa.string()),
    ("gpus", pa.int32()),
    ("nodes", pa.int32()),
    ("bytes", pa.int64()),
    ("time_us", pa.float64()),
    ("algbw_GBps", pa.float64()),
    ("busbw_GBps", pa.float64()),
    ("algorithm", pa.string()),       # ring | tree | nvls | direct | p2p
    ("source", pa.string()),          # model (nominal figures) | fitted | measured
    ("measured_time_us", pa.float64()),  # where a measurement exists at this point, else null
])

# --- simulate: results/simulate/{workload}/{hardware}/{topology}/ --------------------------
SUMMARY = pa.schema([
    ("workload", pa.string()),
    ("hardware", pa.string()),
    ("topology", pa.string()),
    ("world_size", pa.int64()),
    ("step_time_s", pa.float64()),
    ("compute_s", pa.float64()),
    ("exposed_comm_s", pa.float64()),
    ("bubble_s", pa.float64()),
    ("tokens_per_s", pa.float64()),
    ("tflops_per_gpu", pa.float64()),
    ("mfu", pa.float64()),
    ("peak_mem_gib", pa.float64()),
    ("sim_wall_s", pa.float64()),
])

TIMELINE = pa.schema([
    ("class_id", pa.int32()),
    ("pp_rank", pa.int32()),
    ("stream", pa.string()),
    ("name", pa.string()),
    ("kind", pa.string()),        # forward | backward | optimizer | send | recv | collective
    ("microbatch", pa.int32()),
    ("chunk", pa.int32()),
    ("start_s", pa.float64()),
    ("end_s", pa.float64()),
])

# --- simulate: results/simulate/{workload}/{hardware}/{topology}/schedule.parquet -------------
# Each traced rank's pipeline p2p in schedule order: the traced per-chunk template expanded over
# the micro-batch order the simulation ran (gpipe, 1f1b, interleaved).
SCHEDULE = pa.schema([
    ("rank", pa.int32()),
    ("step", pa.int32()),          # position of the task in the stage's order
    ("task", pa.string()),         # F | B
    ("microbatch", pa.int32()),
    ("chunk", pa.int32()),
    ("op", pa.string()),           # send | recv
    ("peer", pa.int32()),
    ("bytes", pa.int64()),
])

# --- import: results/import/{job}/{hardware}/ (echo.profile.gpu_import) ----------------------
# One row per GPU activity (kernel, memcpy, memset) of a real job's Kineto traces, one file per rank.
IMPORTED_ACTIVITY = pa.schema([
    ("rank", pa.int32()),
    ("step", pa.int32()),          # ProfilerStep#N whose span holds the launch; -1 outside any step
    ("stream", pa.int32()),
    ("kind", pa.string()),         # kernel | memcpy | memset
    ("kernel", pa.string()),       # the GPU kernel's name as the profiler recorded it
    ("ts_us", pa.float64()),
    ("dur_us", pa.float64()),
    ("correlation", pa.int64()),
    ("launched", pa.bool_()),      # its launch is in the file (False: launched before the window opened)
    ("op", pa.string()),           # innermost cpu_op around the launch (aten::mm), null when none
    ("op_ts_us", pa.float64()),    # that op event's start (one op event may launch several kernels)
    ("op_class", pa.string()),     # the tracer's op class (gemm, elementwise, ...), collective for NCCL
    ("shapes", pa.string()),       # JSON list of the op's tensor input shapes, null without record_shapes
    ("dtype", pa.string()),
    ("signature", pa.string()),    # id of (op, tensor shapes, dtypes): echo.profile.gpu_trace.signature_id
    ("kernel_key", pa.string()),   # the traced kernel of that signature, when a workload was given
    ("with_shapes", pa.bool_()),   # matched to an op with shapes (a collective: with its bytes)
    ("collective", pa.string()),   # all_reduce | all_gather | reduce_scatter | all_to_all | ... for NCCL
    ("group_size", pa.int32()),
    ("group_ranks", pa.string()),  # JSON list of the group's global ranks, where the trace records it
    ("bytes", pa.int64()),         # the collective's message as nccl-tests counts it
    ("input_bytes", pa.int64()),   # the op's tensor inputs, each at its recorded dtype
    ("concurrent_share", pa.float64()),  # of its duration, the share another stream's kernel ran beside it
])

# Per (rank, step, stream): busy (union of its activities) and idle time within the step.
IMPORTED_STREAMS = pa.schema([
    ("rank", pa.int32()),
    ("step", pa.int32()),
    ("stream", pa.int32()),
    ("step_us", pa.float64()),
    ("busy_us", pa.float64()),
    ("idle_us", pa.float64()),
    ("activities", pa.int64()),
    ("nccl_us", pa.float64()),     # of busy_us, NCCL kernels
])

# Per op class of the A100 (or any) model's check: measured op events vs the roofline estimate.
IMPORTED_MODEL_ERROR = pa.schema([
    ("rank", pa.int32()),
    ("op", pa.string()),
    ("op_class", pa.string()),
    ("shapes", pa.string()),
    ("dtype", pa.string()),
    ("isolated", pa.bool_()),      # no kernel of another stream ran beside these events (the clean measurement)
    ("fmt", pa.string()),          # a GEMM's format (bf16, fp32 = TF32 cores, fp32_simt, ...); "" otherwise
    ("signature", pa.string()),    # echo.profile.gpu_trace.signature_id of (op, shapes, dtypes)
    ("work", pa.float64()),        # FLOPs of a GEMM, bytes of a streamed op
    ("events", pa.int64()),        # op events of this (op, shapes, dtype) measured
    ("measured_us", pa.float64()), # median GPU time per event
    ("predicted_us", pa.float64()),
    ("error", pa.float64()),       # predicted / measured - 1
    ("bound", pa.string()),
])
