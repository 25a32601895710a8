"""Rebuild a traced kernel as a real CPU call: resolve the aten overload, decode its args JSON.

The trace encodes each call (echo.artifacts.OPS ``args``) as ``{"args": [...], "kwargs": {...}}``
with tensors as ``{"T": shape, "dt": dtype}``, other objects (dtypes, layouts, devices, memory
formats) as ``{"S": str(obj)}`` and non-finite floats as strings. Decoding is guided by the op's
schema so that each value lands on its argument with the right type. Tensor contents are random
but valid: floats in [0.5, 1.5) (no zeros, negatives or denormals that would make sqrt/log/div
produce NaN or take slow paths), integer tensors in the range their op indexes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import echo.training.fp8  # noqa: F401  (registers echo::quantize, which FP8 traces record)
import echo.training.fused  # noqa: F401  (registers echo::rms_norm, rope, swiglu, weighted_glu, cross_entropy)
import echo.training.layers  # noqa: F401  (registers echo::scaled_causal_softmax)

Args = tuple[list[Any], dict[str, Any]]


class Unbuildable(Exception):
    """The call cannot be rebuilt on this CPU (unknown op, undecodable argument, ...)."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass
class Call:
    """A rebuilt kernel: the op and a factory of inputs (fresh tensors on every call)."""

    op: torch._ops.OpOverload
    make_args: Callable[[], Args]
    mutates: bool  # writes into an input
    input_bytes: int

    def __call__(self, args: Args) -> Any:
        return self.op(*args[0], **args[1])


def resolve(name: str) -> torch._ops.OpOverload:
    """'aten.add.Tensor' -> torch.ops.aten.add.Tensor"""
    parts = name.split(".")
    if len(parts) != 3:
        raise Unbuildable(f"not an 'ns.op.overload' name: {name!r}")
    ns, op, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError) as exc:
        raise Unbuildable(f"torch has no op {name}") from exc


def build(name: str, args_json: str) -> Call:
    """The call of ``name`` with the arguments ``args_json`` describes, ready to time."""
    op = resolve(name)
    pos, kw = _decode_call(op, args_json)
    bound = _index_bound(op, pos, kw)
    specs = [s for s in _walk((pos, kw)) if isinstance(s, TensorSpec)]
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)

    def make_args() -> Args:
        return _materialize(pos, bound), {k: _materialize(v, bound) for k, v in kw.items()}

    return Call(op, make_args, mutates, sum(s.nbytes for s in specs))


def bind_raw(name: str, args_json: str) -> dict[str, Any]:
    """Argument name -> decoded value (tensors as TensorSpec), by the op's schema."""
    op = resolve(name)
    pos, kw = _decode_call(op, args_json)
    names = [a.name for a in op._schema.arguments]
    return {**dict(zip(names, pos, strict=False)), **kw}


# --- decoding ---------------------------------------------------------------------------------
def _decode_call(op: torch._ops.OpOverload, args_json: str) -> tuple[list[Any], dict[str, Any]]:
    try:
        call = json.loads(args_json)
        pos, kw = call.get("args", []), call.get("kwargs", {})
    except (TypeError, ValueError, AttributeError) as exc:
        raise Unbuildable(f"unreadable args JSON: {exc}") from exc
    schema = {a.name: a for a in op._schema.arguments}
    positional = [a for a in op._schema.arguments if not a.kwarg_only]
    if len(pos) > len(positional):
        raise Unbuildable(f"{len(pos)} positional args for a schema with {len(positional)}")
    dec_pos = [_decode(v, str(a.type)) for v, a in zip(pos, positional, strict=False)]
    unknown = set(kw) - set(schema)
    if unknown:
        raise Unbuildable(f"kwargs not in the schema: {sorted(unknown)}")
    return dec_pos, {k: _decode(v, str(schema[k].type)) for k, v in kw.items()}


def _decode(x: Any, type_str: str) -> Any:
    """One encoded value -> TensorSpec, torch object or Python value (``type_str``: schema type)."""
    if isinstance(x, dict) and "T" in x:
        return TensorSpec(tuple(int(d) for d in x["T"]), _dtype(x.get("dt", "float32")))
    if isinstance(x, dict) and "S" in x:
        return _symbol(x["S"], type_str)
    if isinstance(x, list):
        inner = type_str.removeprefix("Optional[").removeprefix("List[")
        return [_decode(v, inner) for v in x]
    if isinstance(x, str) and ("float" in type_str or "number" in type_str):
        return float(x)  # non-finite floats travel as "inf", "-inf", "nan"
    if isinstance(x, str) and "Device" in type_str:
        return torch.device("cpu")
    return x


def _symbol(s: str, type_str: str) -> Any:
    """str(obj) of a dtype/layout/memory format -> the object; any device -> this CPU."""
    if "Device" in type_str:
        return torch.device("cpu")  # timed here, whatever device the trace ran on
    if s.startswith("torch."):
        obj = getattr(torch, s.removeprefix("torch."), None)
        if isinstance(obj, torch.dtype | torch.layout | torch.memory_format):
            return obj
    try:
        torch.device(s)
        return torch.device("cpu")
    except RuntimeError:
        raise Unbuildable(f"cannot decode {s!r} (schema type {type_str})") from None


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise Unbuildable(f"unknown dtype {name!r}")
    return dt


def _walk(x: Any):
    """Every leaf of nested lists, tuples and dicts."""
    if isinstance(x, list | tuple):
        for v in x:
            yield from _walk(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _walk(v)
    else:
        yield x


# --- valid index ranges -----------------------------------------------------------------------
# Integer tensors are indices; an op fails (or runs an unrepresentative path) when they are out
# of range or all equal. Ops whose index range is an argument: schema name of that argument.
_INDEX_RANGE: dict[str, Callable[[dict[str, Any]], int]] = {
    "embedding": lambda a: a["weight"].shape[0],
    "embedding_dense_backward": lambda a: a["num_weights"],
    "nll_loss_forward": lambda a: a["self"].shape[-1],
    "nll_loss_backward": lambda a: a["self"].shape[-1],
    "nll_loss2d_forward": lambda a: a["self"].shape[1],
    "nll_loss2d_backward": lambda a: a["self"].shape[1],
}


def _index_bound(op: torch._ops.OpOverload, pos: list[Any], kw: dict[str, Any]) -> int:
    """Exclusive upper bound for integer tensor contents of this call."""
    named = {**dict(zip([a.name for a in op._schema.arguments], pos, strict=False)), **kw}
    rule = _INDEX_RANGE.get(op._schema.name.split("::")[-1])
    if rule is not None:
        try:
            return max(1, int(rule(named)))
        except (KeyError, AttributeError, IndexError, TypeError):
            pass
    # Otherwise the smallest dimension of any floating input: valid for gather/index_select/
    # scatter along any dim (conservative, but it never indexes out of range).
    dims = [d for s in _walk((pos, kw)) if isinstance(s, TensorSpec) and s.dtype.is_floating_point
            for d in s.shape]
    return max(1, min(dims, default=2))


def _materialize(x: Any, bound: int) -> Any:
    if isinstance(x, TensorSpec):
        return _random_tensor(x, bound)
    if isinstance(x, list):
        return [_materialize(v, bound) for v in x]
    return x


def _random_tensor(spec: TensorSpec, bound: int) -> torch.Tensor:
    if spec.dtype == torch.bool:
        return torch.rand(spec.shape) < 0.5
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        # fp8 and friends have no rand kernel: draw in fp32 and convert
        return (torch.rand(spec.shape) + 0.5).to(spec.dtype)
    return torch.randint(0, bound, spec.shape, dtype=spec.dtype)
