"""A composed rank's micro-batch memory (echo.trace.meter's figures) from its layer templates.

The meter turns one micro-batch into a list of events (a storage made, resized or freed, with
its change of bytes), a snapshot of what the forwards saved, and the chunk each saved storage
belongs to; ``MemoryMeter.finish`` reads the figures off them. A labelled template trace keeps
those inputs with each event's (block, layer) and each storage's place of birth
(``MemoryMeter.labelled``), and this module lays them out as ``echo.trace.template.compose``
lays out the ops: runs of one label, the template's first, middle and last block standing for
the target chunk's. A storage is known by where it was made: its chunk, the block and layer of
its birth and its place among the storages that layer made, so that a later layer freeing "the
previous layer's output" frees the one the previous target layer made. The figures then come
from the composed events as ``finish`` computes them (live peak, the caching allocator's replay).
"""

from __future__ import annotations

from echo.config.workload import Workload
from echo.trace.meter import EXPANDABLE_SEGMENTS, replay
from echo.trace.template import (
    DEPTH,
    NotComposable,
    Piece,
    _target_layers,
    _template_layer,
    block_order,
    chunk_kind,
    label_runs,
)
from echo.training.layout import Layout, chunk_slots


def _places(piece: Piece) -> dict[int, tuple]:
    """Template entry id -> (block, layer, place among that layer's new storages); outer
    entries (layer -1) are their own place."""
    entries = piece.memory["mem_entries"]
    made: dict[tuple[str, int], list[int]] = {}
    for e in entries:
        made.setdefault((e["block"], e["layer"]), []).append(e["id"])
    for block in ("forward", "backward"):
        counts = {len(made.get((block, lab), [])) for lab in range(piece.depth)}
        if len(counts) > 1:
            raise NotComposable(f"{piece.kind}: template blocks make different numbers of storages in {block}")
    return {i: (b, lab, ids.index(i) if lab >= 0 else i) for (b, lab), ids in made.items() for i in ids}


def _runs(events: list[dict], block: str, depth: int) -> list[tuple[int, list[dict]]]:
    runs = label_runs([e for e in events if e["block"] == block])
    if [lab for lab, _ in runs if lab >= 0] != block_order(block, depth):
        raise NotComposable(f"{block}: memory events are not runs of one block each ({[lab for lab, _ in runs]})")
    return runs


def compose_memory(pieces: dict[tuple[str, int], Piece], w: Workload, rank: int) -> dict:
    """``MeterResult``'s figures (saved, peak, per-chunk and reserved bytes) of ``rank`` of ``w``."""
    layout = Layout(w.parallel)
    v = w.parallel.virtual_stages
    slots = chunk_slots(w.parallel, w.model.layers, layout.coords(rank).pp)
    keys: dict[tuple, int] = {}
    events: list[tuple[int, int]] = []
    chunk_bytes = []
    for slot in slots:
        n = len(slot.layers)
        piece = pieces[(chunk_kind(slot.first, slot.last), DEPTH if n > 1 else 1)]
        saved = 0
        for e in piece.memory["mem_entries"]:
            if e["chunk"] >= 0 and not e["excluded"]:
                saved += e["final_bytes"] * len(_target_layers(e["layer"], n, piece.depth, e["block"]))
        chunk_bytes.append(saved)
    order = ([("forward", c) for c in range(v)] + [("backward", c) for c in reversed(range(v))]
             + [("end", c) for c in range(v)])
    for block, c in order:
        n = len(slots[c].layers)
        piece = pieces[(chunk_kind(slots[c].first, slots[c].last), DEPTH if n > 1 else 1)]
        places = _places(piece)
        for lab, run in _runs(piece.memory["mem_events"], block, piece.depth):
            for layer in _target_layers(lab, n, piece.depth, block):
                for e in run:
                    b, born, place = places[e["id"]]
                    if born < 0:
                        where = -1
                    elif lab < 0:  # an outer event on the first or the last block's storage
                        if born not in (0, piece.depth - 1):
                            raise NotComposable(f"{block}: an outer memory event on template block {born}'s storage")
                        where = 0 if born == 0 else n - 1
                    else:
                        where = layer + (born - _template_layer(layer, n, piece.depth))
                    key = keys.setdefault((c, b, born if born < 0 else "layer", place, where), len(keys))
                    events.append((key, e["delta"]))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    saved = sum(chunk_bytes)
    cache = replay(events, expandable=EXPANDABLE_SEGMENTS)
    return {"saved_bytes": saved, "peak_bytes": max(peak, saved), "chunk_bytes": chunk_bytes,
            "reserved_bytes": max(peak, saved) + cache.peak_reserved - cache.peak_allocated}
