"""What an aten op is: its class, FLOPs (matmul-class only), bytes moved, and a JSON of its call.

FLOPs follow the model-FLOPs convention MFU uses (Megatron-LM, Narayanan et al. 2021): a GEMM
costs 2*M*N*K, attention 4*b*h*s_q*s_k*d forward (QK^T and PV, causal masking not halved) and
twice that backward. Everything else is memory-bound and costed by its bytes.
"""

from __future__ import annotations

import json
import math

import torch

from echo.trace import hashing
from echo.training.sliding_attention import band_pairs

_GEMM = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_grouped_mm", "_grouped_mm"}
_CLASS_BY_NAME = {
    "native_layer_norm": "norm", "native_layer_norm_backward": "norm", "_fused_rms_norm": "norm",
    "_fused_rms_norm_backward": "norm", "_softmax": "softmax", "_softmax_backward_data": "softmax",
    "_log_softmax": "softmax", "_log_softmax_backward_data": "softmax",
    "nll_loss_forward": "cross_entropy", "nll_loss_backward": "cross_entropy",
    "embedding": "embedding", "embedding_dense_backward": "embedding",
    "_to_copy": "copy", "copy_": "copy", "clone": "copy", "cat": "copy", "stack": "copy",
    "_fused_adamw_": "optimizer", "_fused_adam_": "optimizer",
    "sum": "reduction", "mean": "reduction", "amax": "reduction", "max": "reduction",
}
# Ops that launch no kernel: views, aliases, allocation, metadata. They are not recorded.
_FREE = {
    "detach", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "as_strided", "alias",
    "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes", "unbind", "reshape",
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
    "_reshape_alias", "view_as", "chunk", "narrow", "device", "size", "stride", "sym_size",
    "is_same_size", "_has_compatible_shallow_copy_type", "set_", "resize_", "contiguous",
}


def base_name(func) -> str:
    """aten.mm.default -> mm"""
    return func._schema.name.split("::")[-1]


def is_free(func) -> bool:
    name = base_name(func)
    # profiler.* ops mark record_function ranges; they launch nothing
    return name in _FREE or getattr(func, "is_view", False) or func.namespace == "profiler"


def op_class(func) -> str:
    name = base_name(func)
    if func.namespace == "fsdp":  # FSDP2's all-gather copy-in/out and gradient chunk_cat
        return "copy"
    if func.namespace == "echo":  # Echo's own kernels (training/fp8.py, fused.py), memory-bound but attention
        if name.startswith("sliding_attention"):
            return "attention"
        return ("norm" if name.startswith("rms_norm") else "quantize" if name == "quantize" else
                "softmax" if name == "cross_entropy" or name.startswith("scaled_causal_softmax") else "elementwise")
    if name in _GEMM:
        return "gemm"
    if "attention" in name:
        return "attention"
    if name in _CLASS_BY_NAME:
        return _CLASS_BY_NAME[name]
    if name.startswith("_foreach_"):
        return "optimizer"
    if torch.Tag.pointwise in getattr(func, "tags", ()):
        return "elementwise"
    return "other"


def _tensors(obj) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for x in obj if isinstance(obj, (list, tuple)) else [obj]:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out.extend(_tensors(x))
    return out


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def moved_bytes(func, args, kwargs, out) -> float:
    """Bytes read (tensor inputs) plus bytes written (tensor outputs, and the inputs an in-place op
    writes into: _fused_adamw_ returns nothing but rewrites params and both moments)."""
    ins = _tensors(list(args) + list(kwargs.values()))
    written = _tensors(out)
    if not written:
        for arg, value in zip(func._schema.arguments, args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += _tensors(value)
    return float(sum(tensor_bytes(t) for t in ins) + sum(tensor_bytes(t) for t in written))


def matmul_flops(func, args) -> float:
    """FLOPs of GEMM and attention ops; 0 for everything else."""
    name = base_name(func)
    if name in ("mm", "_scaled_mm"):
        (m, k), n = args[0].shape, args[1].shape[-1]
        # FP4 (float4_e2m1fn_x2) packs two values per element: the logical K is twice the shape's
        return 2.0 * m * n * k * (2 if args[0].dtype == torch.float4_e2m1fn_x2 else 1)
    if name in ("_scaled_grouped_mm", "_grouped_mm") and args[0].dim() == 2 and args[1].dim() in (2, 3):
        # forward / data gradient (rows, K) x (G, K, N): each routed row meets its one expert's weight;
        # weight gradient (N, rows) x (rows, K) -> (G, N, K): offs splits the rows among the experts, so
        # each row still meets each output column once. Either way one GEMM's 2 * M * N * K.
        (m, k), n = args[0].shape, args[1].shape[-1]
        return 2.0 * m * n * k * (2 if args[0].dtype == torch.float4_e2m1fn_x2 else 1)
    if name == "addmm":
        (m, k), n = args[1].shape, args[2].shape[-1]
        return 2.0 * m * n * k
    if name in ("bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    if name.startswith("sliding_attention"):
        # the causal band's (query, key) pairs (training/sliding_attention.py), not the full square
        backward = "backward" in name
        q, window = args[1 if backward else 0], args[6 if backward else 3]
        b, h, s, d = q.shape
        fwd = 4.0 * b * h * d * band_pairs(s, int(window))
        return 2.0 * fwd if backward else fwd
    if "attention" in name:
        q, k = args[0], args[1]
        if "backward" in name:
            # backward ops take grad_out first: (grad_out, q, k, v, ...)
            q, k = args[1], args[2]
        b, h, s_q, d = q.shape
        fwd = 4.0 * b * h * s_q * k.shape[-2] * d
        return 2.0 * fwd if "backward" in name else fwd
    return 0.0


def encode_args(args, kwargs) -> str:
    """The call as JSON: tensors as {"T": shape, "dt": dtype}, enough to rebuild and time it."""
    return json.dumps({"args": [_encode(a) for a in args], "kwargs": {k: _encode(v) for k, v in kwargs.items()}},
                      separators=(",", ":"))


def _encode(x):
    if isinstance(x, torch.Tensor):
        return {"T": list(x.shape), "dt": str(x.dtype).removeprefix("torch.")}
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    if isinstance(x, bool | int | str) or x is None:
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    return {"S": str(x)}


def kernel_key(name: str, args_json: str, flags: str = "") -> str:
    """Stable id of (op, shapes, dtype, flags) (echo.trace.hashing.kernel_key)."""
    return hashing.kernel_key(name, args_json, flags)


def shapes_of(args) -> str:
    return json.dumps([list(t.shape) for t in _tensors(list(args))], separators=(",", ":"))


def dtype_of(args) -> str:
    ts = _tensors(list(args))
    return str(ts[0].dtype).removeprefix("torch.") if ts else ""
