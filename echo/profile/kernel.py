"""What the profile stage works on (a distinct kernel of a trace) and what it produces for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    """One distinct kernel of a trace: what the model and the timer need to know about it."""

    kernel_key: str
    name: str          # aten overload, e.g. aten.mm.default
    op_class: str
    kind: str          # compute | memcpy
    shapes: str        # JSON list of input tensor shapes
    dtype: str
    flops: float
    bytes: float
    args: str          # JSON of the call (see echo.artifacts.OPS)
    count: int = 1
    dtensor: int = 0   # DTensor-level calls it stands for (echo.artifacts.OPS; part of kernel_key)

    @property
    def base(self) -> str:
        """aten.mm.default -> mm"""
        parts = self.name.split(".")
        return parts[1] if len(parts) >= 3 else self.name


@dataclass(frozen=True)
class Result:
    """One kernel's duration and where it came from."""

    duration_us: float
    source: str          # measured | model | imported
    threads: int         # intra-op threads it was timed with; 0 when modelled
    bound: str | None    # compute | memory | launch for a modelled kernel, else None
    isolated_us: float | None = None    # measured: the kernel timed alone, before the in-loop factor
    inloop_factor: float | None = None  # measured: in-loop / isolated time of its op class (echo.profile.inloop)
    host_us: float = 0.0                # host overhead included in duration_us (echo.profile.host, .eager)
    colocation_factor: float = 1.0      # slowdown from the run's other ranks on this CPU, applied (echo.profile.eager)
