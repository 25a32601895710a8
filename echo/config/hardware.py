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


class Provenance(BaseModel):
    """Where one compute-model parameter comes from."""

    model_config = _STRICT
    status: Literal["calibrated", "transferred", "assumed", "datasheet"] = Field(
        description="calibrated: fitted here to published measurements of this GPU; transferred: fitted "
                    "on another GPU and carried over; assumed: a judgement, not fitted; datasheet: a spec")
    basis: str = Field(description="the measurements, the fit and its error, or the reasoning")


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
        default_factory=dict, description="per parameter (matmul_efficiency, ...): calibrated, transferred, assumed or datasheet")

    @model_validator(mode="after")
    def _provenance_names_parameters(self) -> ComputeModel:
        params = set(type(self).model_fields) - {"source", "provenance"}
        unknown = sorted(set(self.provenance) - params)
        if unknown:
            raise ValueError(f"provenance for unknown parameters {unknown}; parameters: {', '.join(sorted(params))}")
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
