"""A canonical hash of one rank's graph that does not depend on absolute rank ids.

Two ranks get the same hash when they run the same ops in the same order on the same shapes and
issue the same collectives over groups of the same kind and shape. Groups enter the hash as
their mesh dimension and their members relative to the group's first rank (its shape), p2p
peers as an offset from the rank.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

from echo.trace.layout import Layout

# Shapes and dtype, not the full arguments: scalar arguments can hold a rank's shard offset
# (e.g. the vocabulary range of a vocabulary-parallel embedding) without changing the kernel.
_OP_COLUMNS = ("name", "kind", "phase", "chunk", "stream", "shapes", "dtype")


def graph_hash(ops: pa.Table, comms: pa.Table, layout: Layout, rank: int) -> str:
    h = hashlib.sha256()
    cols = [ops.column(c).to_pylist() for c in _OP_COLUMNS]
    for row in zip(*cols, strict=True):
        h.update(repr(row).encode())
    for op, group, kind, nbytes, peer in zip(*(comms.column(c).to_pylist() for c in
                                              ("op", "group", "group_kind", "bytes", "peer")), strict=True):
        relative = tuple(g - min(group) for g in group)  # the group's shape, not where it sits
        h.update(repr((op, kind, relative, nbytes, peer - rank if peer >= 0 else None)).encode())
    return h.hexdigest()[:20]
