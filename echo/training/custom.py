"""A user's own model: a function returning an ``nn.Module`` (``model.module`` of a workload, e.g.
examples/tiny_model.py), cut into pipeline chunks like the reference models.

The module's contract: ``tok_emb`` (token embedding), ``blocks`` (nn.ModuleList; each block maps
[batch, seq, hidden] to the same), ``ln_f`` and ``head`` (final norm, LM head), and optionally
``tp_plan`` (linear name inside a block -> "colwise" | "rowwise"). Tensor and pipeline
parallelism, ZeRO and FSDP apply as to the reference models; sequence, context and expert
parallelism need hooks inside attention and the experts that a foreign module does not have,
and are refused before tracing.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn as nn

from echo.config.hf import module_file
from echo.config.workload import ModelConfig, Workload
from echo.errors import ConfigError
from echo.training.layers import RecomputeHook, recomputed
from echo.training.layout import chunk_slots

_REQUIRED = ("tok_emb", "blocks", "ln_f", "head")


def builder(cfg: ModelConfig) -> Callable[..., nn.Module]:
    """The function ``cfg.module`` names, loaded from its file (not an installed package)."""
    file, function = module_file(cfg.module)
    spec = importlib.util.spec_from_file_location(f"echo_user_model_{file.stem}", file)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:  # the user's file does not import: say so before any tracing
        raise ConfigError(file, "-", f"cannot be imported: {type(exc).__name__}: {exc}") from None
    fn = getattr(mod, function, None)
    if not callable(fn):
        raise ConfigError(file, function, "no such function in the file (model.module)")
    return fn


def check_buildable(w: Workload) -> None:
    """Build the module on the meta device and refuse, before tracing, what does not fit."""
    cfg, p = w.model, w.parallel
    where = f"config/workloads/{w.name}.yaml"
    for on, key in ((p.sequence_parallel, "parallel.sequence_parallel"), (p.cp > 1, "parallel.cp"), (p.ep > 1, "parallel.ep")):
        if on:
            raise ConfigError(where, key, "is not traced for a user's module (it needs hooks inside attention/experts)")
    with torch.device("meta"):
        model = builder(cfg)(**cfg.module_args)
    missing = [a for a in _REQUIRED if not hasattr(model, a)]
    if missing:
        raise ConfigError(where, "model.module", f"the module has no {missing[0]} (needs {', '.join(_REQUIRED)})")
    facts = {"layers": len(model.blocks), "hidden": model.tok_emb.embedding_dim, "vocab": model.tok_emb.num_embeddings}
    for key, value in facts.items():
        if getattr(cfg, key) != value:
            raise ConfigError(where, f"model.{key}", f"is {getattr(cfg, key)}, the module has {value}")
    plan = getattr(model, "tp_plan", {}) or {}
    if p.tp > 1 and not plan:
        raise ConfigError(where, "parallel.tp", "tp > 1 needs the module's tp_plan (linear name -> colwise | rowwise)")
    for name, style in plan.items():
        if style not in ("colwise", "rowwise") or not isinstance(model.blocks[0].get_submodule(name), nn.Linear):
            raise ConfigError(where, "model.module", f"tp_plan entry {name}: {style} is not a colwise/rowwise linear of a block")


class ModuleChunk(nn.Module):
    """Consecutive blocks of a user's module, with its embedding on the first chunk and its final
    norm and head on the last; same contract as model.ModelChunk."""

    custom = True

    def __init__(self, model: nn.Module, layer_ids: range, *, first: bool, last: bool,
                 recompute: str = "none", hook: RecomputeHook = nullcontext):
        super().__init__()
        self.first, self.last = first, last
        self.tok_emb = model.tok_emb if first else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in layer_ids)
        self.ln_f, self.head = (model.ln_f, model.head) if last else (None, None)
        self.tp_plan = dict(getattr(model, "tp_plan", {}) or {})
        self.full, self.hook, self.seq_shard = recompute == "full", hook, (0, 1)

    def set_groups(self, groups: dict) -> None:
        """Nothing to hand out: context and expert parallelism are refused for user modules."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x)
        for block in self.blocks:
            x = recomputed(block, self.hook)(x) if self.full else block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x


def build_module_chunks(w: Workload, pp_rank: int, hook: RecomputeHook = nullcontext) -> list[ModuleChunk]:
    model = builder(w.model)(**w.model.module_args)
    return [ModuleChunk(model, slot.layers, first=slot.first, last=slot.last, recompute=w.training.recompute, hook=hook)
            for slot in chunk_slots(w.parallel, w.model.layers, pp_rank)]
