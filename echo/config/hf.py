"""A model given as a Hugging Face ``config.json``: read it, apply overrides, and derive the shape
fields every stage reads (layers, widths, heads, experts) from the architecture's own keys. Also a
user's own module (``module: file.py:function``): its file is checked and fingerprinted.

Only JSON is read here; transformers builds the modules at trace time (echo.training.hf). The
whole resolved config is kept in the workload, so that editing the JSON file re-traces.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from echo.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
# ModelConfig field -> config.json keys that can carry it, first present wins (architectures
# name the same quantity differently: Mixtral's num_local_experts, Qwen3's num_experts, ...)
_SHAPE_KEYS = {
    "layers": ("num_hidden_layers",),
    "hidden": ("hidden_size",),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",),
    "ffn_hidden": ("intermediate_size",),
    "vocab": ("vocab_size",),
    "experts": ("n_routed_experts", "num_experts", "num_local_experts"),
    "top_k": ("num_experts_per_tok",),
}
_REQUIRED = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
DERIVED = tuple(_SHAPE_KEYS)  # fields a workload with hf_config may not set itself


def read_hf_config(path: str, overrides: dict, workload_path: Path) -> dict:
    """The config.json at ``path`` (relative to the repository root, or absolute) with
    ``overrides`` applied; refused with file, key and reason when unreadable or incomplete."""
    file = Path(path) if Path(path).is_absolute() else REPO_ROOT / path
    if not file.is_file():
        raise ConfigError(workload_path, "model.hf_config", f"no such file: {file}")
    try:
        data = json.loads(file.read_text())
    except ValueError as exc:
        raise ConfigError(file, "-", f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(file, "-", "expected a JSON object (a config.json)")
    unknown = sorted(set(overrides) - set(data))
    if unknown:
        raise ConfigError(workload_path, f"model.hf_overrides.{unknown[0]}",
                          f"not a key of {file.name}; an override must change a key the config has")
    for key, value in overrides.items():
        if not _same_kind(data[key], value):
            raise ConfigError(workload_path, f"model.hf_overrides.{key}",
                              f"expected a {_kind(data[key])} like {file.name}'s {data[key]!r}, got {value!r}")
    data = {**data, **overrides}
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ConfigError(file, missing[0], "missing: every config.json of a decoder model has it")
    return data


def _kind(v) -> str:
    if isinstance(v, bool):
        return "true/false"
    if isinstance(v, int):
        return "whole number"
    if isinstance(v, float):
        return "number"
    return type(v).__name__.replace("str", "string").replace("dict", "mapping")


def _same_kind(old, new) -> bool:
    """An override keeps the type of the key it changes (a whole number may be written 4.0; a
    number may be whole; null stays free on either side)."""
    if old is None or new is None:
        return True
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, int):
        return isinstance(new, int) or (isinstance(new, float) and new.is_integer())
    if isinstance(old, float):
        return isinstance(new, int | float)
    return type(new) is type(old)


class ShapeError(ValueError):
    """A config.json shape key whose value is no whole number."""

    def __init__(self, key: str, value):
        self.key = key
        super().__init__(f"expected a whole number, got {value!r}")


def shape_fields(hf: dict) -> dict:
    """ModelConfig fields derived from a resolved config.json (experts 0 for a dense model);
    ShapeError naming the config.json key whose value is no whole number."""
    out = {}
    for field, keys in _SHAPE_KEYS.items():
        key = next((k for k in keys if hf.get(k) is not None), None)
        if key is not None:
            value = hf[key]
            whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
            if isinstance(value, bool) or not whole:
                raise ShapeError(key, value)
            out[field] = int(value)
    out.setdefault("experts", 0)
    out.setdefault("top_k", 0 if not out["experts"] else out.get("top_k", 0))
    return out


def module_file(spec: str) -> tuple[Path, str]:
    """'path/to/file.py:function' -> (the file, relative paths from the repository root; function)."""
    path, _, function = spec.rpartition(":")
    file = Path(path) if Path(path).is_absolute() else REPO_ROOT / path
    return file, function


def expand_module(model: dict, workload_path: Path) -> dict:
    """A ``module:`` model with its file checked and its digest recorded (an edit re-traces)."""
    spec = model["module"]
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(workload_path, "model.module", "expected 'path/to/file.py:function'")
    file, function = module_file(spec)
    if not file.is_file():
        raise ConfigError(workload_path, "model.module", f"no such file: {file}")
    if not function.isidentifier():
        raise ConfigError(workload_path, "model.module", f"'{function}' is not a function name")
    return {**model, "arch": "module", "module_digest": hashlib.sha256(file.read_bytes()).hexdigest()}


def expand_model_section(model: dict, workload_path: Path) -> dict:
    """A workload's ``model:`` mapping with ``hf_config`` (a path) resolved into the config's
    content and the shape fields filled from it, or a ``module:`` model checked; any other
    mapping is returned as is."""
    # a workload dumped and loaded again (sweeps) carries every key, unset ones as None
    if model.get("module") is not None and model.get("module_digest") is None:
        return expand_module(model, workload_path)
    if model.get("hf_config") is None or isinstance(model["hf_config"], dict):
        return model
    clash = [k for k in DERIVED if k in model]
    if clash:
        raise ConfigError(workload_path, f"model.{clash[0]}",
                          "comes from hf_config; change it with hf_overrides (the config.json key)")
    if not isinstance(model["hf_config"], str):
        raise ConfigError(workload_path, "model.hf_config", "expected the path of a config.json")
    overrides = model.get("hf_overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(workload_path, "model.hf_overrides", "expected a mapping of config.json keys")
    hf = read_hf_config(model["hf_config"], overrides, workload_path)
    try:
        shape = shape_fields(hf)
    except ShapeError as exc:
        where = f"model.hf_overrides.{exc.key}" if exc.key in overrides else f"model.hf_config ({exc.key})"
        raise ConfigError(workload_path, where, str(exc)) from None
    return {**model, "arch": "hf", "hf_source": model["hf_config"], "hf_config": hf,
            "hf_overrides": overrides, **shape}
