"""A canonical hash of one rank's graph that does not depend on absolute rank ids.

Two ranks get the same hash when they run the same ops in the same order on the same shapes and
issue the same collectives over groups of the same kind and shape. Groups enter the hash as
their mesh dimension and their members relative to the group's first rank (its shape), p2p
peers as an offset from the rank.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

from echo.training.layout import Layout

# Shapes and dtype, not the full arguments: scalar arguments can hold a rank's shard offset
# (e.g. the vocabulary range of a vocabulary-parallel embedding) without changing the kernel.
# ``dtensor`` (DTensor-level calls behind an op) is part of its kernel key, so of the graph too.
_OP_COLUMNS = ("name", "kind", "phase", "chunk", "stream", "shapes", "dtype", "dtensor")


def kernel_key(name: str, args_json: str, flags: str = "") -> str:
    """Stable id of (op, shapes, dtype, flags): the unit the profile stage times.

    ``flags`` (empty for a plain op, so its key is that of (op, call) alone) says how the op is
    dispatched where that costs time of its own, e.g. ``dtensor=3``: the op is the local kernel
    of 3 DTensor-level calls (see echo.trace.recorder and echo.profile.host)."""
    text = f"{name}|{args_json}" + (f"|{flags}" if flags else "")
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def dtensor_flags(calls: int) -> str:
    """The kernel-key flags of an op behind ``calls`` DTensor-level calls."""
    return f"dtensor={calls}" if calls else ""


def graph_hash(ops: pa.Table, comms: pa.Table, layout: Layout, rank: int) -> str:
    h = hashlib.sha256()
    cols = [ops.column(c).to_pylist() for c in _OP_COLUMNS if c in ops.column_names]
    for row in zip(*cols, strict=True):
        h.update(repr(row).encode())
    for op, group, kind, nbytes, peer in zip(*(comms.column(c).to_pylist() for c in
                                              ("op", "group", "group_kind", "bytes", "peer")), strict=True):
        low = min(group)
        relative = tuple(g - low for g in group)  # the group's shape, not where it sits
        h.update(repr((op, kind, relative, nbytes, peer - rank if peer >= 0 else None)).encode())
    return h.hexdigest()[:20]
