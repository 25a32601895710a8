"""A GPU (or the local CPU): its peaks and the few efficiency parameters the compute model needs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


class PeakTflops(BaseModel):
    """Dense peak throughput per dtype, TFLOP/s."""

    model_config = _STRICT
    bf16: PositiveFloat
    fp16: PositiveFloat
    fp32: PositiveFloat
    tf32: PositiveFloat | None = None
    fp8: PositiveFloat | None = Field(None, description="FP8 (E4M3/E5M2) tensor-core peak, also the MXFP8 and "
                                      "block-scaled FP8 rate; None: the GPU has no FP8 tensor cores (A100)")
    fp4: PositiveFloat | None = Field(None, description="FP4 (NVFP4 / MXFP4) tensor-core peak; None: no FP4 "
                                      "tensor cores (before Blackwell)")


class Provenance(BaseModel):
    """Where one compute-model parameter comes from."""

    model_config = _STRICT
    status: Literal["fitted", "transferred", "assumed", "datasheet"] = Field(
        description="fitted: by echo.fit to published measurements of this GPU (compute_model.fitted_by); "
                    "transferred: fitted on another GPU and carried over; assumed: a judgement; datasheet: a spec")
    basis: str = Field(description="the measurements, the fit and its error, or the reasoning")


class FittedBy(BaseModel):
    """The fit (echo.fit, rule fit) that gave the parameters whose provenance says fitted."""

    model_config = _STRICT
    fit: str = Field(description="its report, results/fit/<hardware>.json: values, fit and held-out rows, inputs")
    parameters: tuple[str, ...] = Field(min_length=1, strict=False, description="the parameters it fitted")
    code: str = Field(pattern="^[0-9a-f]{12}$", description="its code version (code_version('fit')); another today "
                      "makes the fit stale (echo.fit.stale_fits) until it is re-run and this file updated")


class ComputeModel(BaseModel):
    """Efficiency parameters of the roofline compute model, with where they came from."""

    model_config = _STRICT
    matmul_efficiency: float = Field(gt=0, le=1, description="best achievable fraction of peak for large GEMMs")
    sustained_compute: float = Field(
        1.0, gt=0, le=1, description="fraction of the burst GEMM rate (matmul_efficiency, a shape search's best "
        "single GEMM) that GEMM and attention kernels sustain inside a training job (clocks under sustained "
        "power, neighbouring kernels); 1 = the burst rate")
    hbm_efficiency: float = Field(gt=0, le=1, description="achievable fraction of hbm_GBps for streaming kernels")
    kernel_launch_us: float = Field(ge=0, description="fixed per-kernel floor (launch + tail), microseconds")
    sm_count: PositiveInt = Field(description="streaming multiprocessors, for wave quantization")
    source: str = Field("", description="provenance of these figures, in one line")
    provenance: dict[str, Provenance] = Field(
        default_factory=dict, description="per parameter (matmul_efficiency, ...): fitted, transferred, assumed or datasheet")
    fitted_by: FittedBy | None = Field(None, description="the fit the parameters with provenance fitted come from")

    @classmethod
    def parameter_names(cls) -> list[str]:
        return [p for p in cls.model_fields if p not in ("source", "provenance", "fitted_by")]

    @model_validator(mode="after")
    def _provenance_names_parameters(self) -> ComputeModel:
        params, named = self.parameter_names(), set(self.fitted_by.parameters if self.fitted_by else ())
        unknown = sorted((set(self.provenance) | named) - set(params))
        if unknown:
            raise ValueError(f"provenance or fitted_by of unknown parameters {unknown}; parameters: {', '.join(sorted(params))}")
        fitted = {p for p, v in self.provenance.items() if v.status == "fitted"}
        if fitted != named:
            raise ValueError(f"provenance says fitted for {sorted(fitted)}, fitted_by names {sorted(named)}")
        return self


class Hardware(BaseModel):
    """config/hardware/{name}.yaml"""

    model_config = _STRICT
    name: str
    kind: Literal["gpu", "cpu"] = Field(description="cpu means the local device: kernels are measured, not modelled")
    # A GPU runs kernels from a queue the host fills ahead of it, so host time (Python, dispatch)
    # hides behind device time; and Megatron-LM, which the GPU targets stand for, runs tensor
    # parallelism without DTensor. On the local CPU the host thread is the device: the profile
    # stage adds measured host overheads (DTensor dispatch, echo.profile.host) to the kernels.
    host_synchronous: bool = Field(
        False, description="the host's dispatch time adds to every kernel (true for the local CPU, whose "
                           "kernels run on the dispatching thread); the profile stage then charges "
                           "measured host overheads such as DTensor's per call")
    description: str = ""
    peak_tflops: PeakTflops
    memory_gib: PositiveFloat
    hbm_GBps: PositiveFloat
    compute_model: ComputeModel
