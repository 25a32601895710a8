"""A GPU (or the local CPU): its peaks and the parameters of its kernel-time model, each with its provenance."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from echo.config.figure import Figure

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


class GpuPower(BaseModel):
    """A GPU's board power (echo.plan.energy: energy and its cost of a run)."""

    model_config = _STRICT
    tdp_w: Figure = Field(description="board power limit, W: what a GPU draws at full load")
    idle_w: Figure = Field(description="draw of an idle GPU in a running job (clocks up, no kernels), W")


class Variability(BaseModel):
    """How much GPUs of this model differ in speed (echo.simulate.variability)."""

    model_config = _STRICT
    speed_sigma: Figure = Field(description="relative standard deviation of a GPU's persistent factor on its "
                                "kernel times across the GPUs of a cluster (0.013: 1.3%)")


class Host(BaseModel):
    """The CPU thread that launches a GPU's work (echo.simulate.program: the host clock).

    A GPU runs kernels from a queue that the host fills ahead of it, op by op; the queue hides
    the host's time until the host falls behind (a stretch of ops shorter than their launches)
    or has to wait for the GPU (a device-to-host copy whose value the host needs: Megatron's
    MoE dispatchers read the token counts per expert before each dispatch)."""

    model_config = _STRICT
    launch_us: Figure = Field(description="host time per op the training step puts on the GPU (the framework's "
                              "Python, the dispatcher, the launch call), microseconds: the pace of a launching "
                              "thread that does not wait for the GPU (echo.fit.host_launch: the Kineto traces' "
                              "floor, and the fit on the Megatron-Bridge fit rows)")


class Provenance(BaseModel):
    """Where one compute-model parameter (or a group of them, named by its prefix) comes from."""

    model_config = _STRICT
    status: Literal["fitted", "transferred", "assumed", "datasheet"] = Field(
        description="fitted: by echo.fit to published per-kernel measurements of this GPU's silicon "
                    "(compute_model.fitted_by); transferred: fitted on another GPU and carried over; "
                    "assumed: a judgement; datasheet: a spec")
    basis: str = Field(description="the measurements, the fit and its error, or the reasoning")


class FittedBy(BaseModel):
    """The fit (echo.fit, rule fit) that gave the parameters whose provenance says fitted."""

    model_config = _STRICT
    fit: str = Field(description="its report, results/fit/<hardware>.json: values, fit and held-out rows, inputs")
    parameters: tuple[str, ...] = Field(min_length=1, strict=False, description="the parameters it fitted "
                                        "(dotted names, as ComputeModel.parameter_names gives them)")
    code: str = Field(pattern="^[0-9a-f]{12}$", description="its code version (code_version('fit')); another today "
                      "makes the fit stale (echo.fit.stale_fits) until it is re-run and this file updated")


class GemmRate(BaseModel):
    """How one GEMM input format runs on the tensor cores (echo.profile.gemm_model)."""

    model_config = _STRICT
    peak_fraction: float = Field(gt=0, le=1, description="fraction of the format's dense tensor-core peak that a "
                                 "CTA's main loop sustains with a large output tile (the rate K-deep work runs at)")
    wave_overhead_us: float = Field(ge=0, description="fixed time of each wave of CTA tiles, microseconds: the "
                                    "pipeline fill before the first MMA and the epilogue writing the output tile")
    full_rate_reuse: float = Field(gt=0, description="operand reuse tm*tn/(tm+tn) (FLOPs per operand element "
                                   "staged) at which a tile reaches peak_fraction; a smaller tile runs at "
                                   "reuse/full_rate_reuse of it (its operand traffic, not the MMA, limits it)")


class GemmModel(BaseModel):
    """The GEMM kernel model: a launch floor plus waves of CTA tiles, per input format."""

    model_config = _STRICT
    launch_us: float = Field(ge=0, description="fixed time of a GEMM kernel beyond its waves of tiles "
                             "(launch, grid scheduling), microseconds, as a profiler's kernel duration shows it")
    bf16: GemmRate = Field(description="bf16 and fp16 inputs (the same tensor-core rate)")
    tf32: GemmRate | None = Field(None, description="fp32 inputs on tf32 tensor cores")
    fp8: GemmRate | None = Field(None, description="FP8 (E4M3/E5M2) inputs with per-tensor scales")
    fp4: GemmRate | None = Field(None, description="NVFP4 inputs (E2M1 with 1x16 block scales, the FP4 peak)")
    blockwise_fp8: float | None = Field(None, gt=0, le=1, description="main-loop rate of blockwise-scaled FP8 "
                                        "(1x128 activation / 128x128 weight fp32 scales, DeepSeek style) relative "
                                        "to fp8's: the scales are applied on CUDA cores outside the MMA")
    mxfp8: float | None = Field(None, gt=0, le=1, description="main-loop rate of MXFP8 (1x32 E8M0 block scales) "
                                "relative to fp8's")
    blockwise_launch_us: float | None = Field(None, ge=0, description="fixed time of a blockwise-FP8 GEMM kernel "
                                              "(DeepGEMM-style persistent TMA kernels, which start their tiles sooner "
                                              "than the cuBLAS / XLA kernels launch_us is fitted on), microseconds; "
                                              "None: launch_us")


class AttentionModel(BaseModel):
    """The flash-attention kernel model (echo.profile.attention_model), bf16/fp16 inputs."""

    model_config = _STRICT
    fwd_vs_gemm: float = Field(gt=0, le=1, description="rate of the forward's two GEMMs (QK^T, PV) relative to "
                               "gemm.bf16.peak_fraction; flash kernels cannot beat the GPU's best GEMM")
    bwd_vs_gemm: float = Field(gt=0, le=1, description="the same for the backward's five GEMMs")
    fwd_cta_us: float = Field(ge=0, description="fixed time of one forward CTA (a block of 128 queries), "
                              "microseconds: loading Q, the softmax epilogue, writing O and the log-sum-exp")
    bwd_cta_us: float = Field(ge=0, description="fixed time of one backward CTA (a block of 128 keys), "
                              "microseconds: loading K and V, writing dK and dV, draining the dQ accumulation")
    softmax_headdim: float = Field(ge=0, description="the softmax's cost per score (exp, max, scaling) as extra "
                                   "head-dim columns of MMA work: a head of dim d runs like d + softmax_headdim")
    fp8_speedup: float | None = Field(None, ge=1, description="throughput of an FP8 flash kernel over the bf16 "
                                      "one at the same shape; None: no FP8 attention (no FP8 tensor cores)")


class ComputeModel(BaseModel):
    """Parameters of the kernel-time model (echo.profile.roofline), with where each came from.

    A GPU file gives ``gemm`` and ``attention`` (the per-format kernel models, fitted on per-kernel
    measurements, echo.fit.kernels). A nominal device (the local CPU, whose kernels are measured;
    synthetic test hardware) may give ``matmul_efficiency`` instead: every GEMM then runs at that
    fraction of its dtype's peak with nominal tile constants, attention at the same rate."""

    model_config = _STRICT
    sm_count: PositiveInt = Field(description="streaming multiprocessors: CTAs run in waves of this many")
    kernel_launch_us: float = Field(ge=0, description="fixed time of a non-GEMM kernel (launch to completion "
                                    "of a tiny grid), microseconds: the floor of memory-bound kernels")
    hbm_efficiency: float = Field(gt=0, le=1, description="fraction of hbm_GBps a streaming kernel reaches with "
                                  "enough bytes in flight (the asymptote of an occupancy sweep)")
    matmul_efficiency: float | None = Field(None, gt=0, le=1, description="nominal devices only (no gemm "
                                            "section): the fraction of each dtype's peak every GEMM runs at")
    gemm: GemmModel | None = Field(None, description="the GEMM kernel model (GPU files)")
    attention: AttentionModel | None = Field(None, description="the flash-attention kernel model (GPU files)")
    source: str = Field("", description="provenance of these figures, in one line")
    provenance: dict[str, Provenance] = Field(
        default_factory=dict, description="per parameter (dotted name, e.g. gemm.bf16.peak_fraction) or group of "
        "them (a prefix, e.g. gemm.bf16): fitted, transferred, assumed or datasheet")
    fitted_by: FittedBy | None = Field(None, description="the fit the parameters with provenance fitted come from")

    def parameter_names(self) -> list[str]:
        """Every parameter this file sets (None-valued optional ones left out), dotted: sm_count, ...,
        gemm.launch_us, gemm.bf16.peak_fraction, ..., attention.fwd_vs_gemm, ..."""
        out = []
        for name in type(self).model_fields:
            if name in ("source", "provenance", "fitted_by"):
                continue
            value = getattr(self, name)
            if value is not None:
                out.extend(_leaves(name, value))
        return out

    def provenance_of(self, parameter: str) -> Provenance | None:
        """The provenance of a dotted parameter: its own entry, else its nearest group's."""
        parts = parameter.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in self.provenance:
                return self.provenance[".".join(parts[:i])]
        return None

    def value(self, parameter: str):
        """The value of a dotted parameter."""
        out = self
        for part in parameter.split("."):
            out = getattr(out, part)
        return out

    @model_validator(mode="after")
    def _provenance_names_parameters(self) -> ComputeModel:
        if (self.gemm is None) == (self.matmul_efficiency is None):
            raise ValueError("give either gemm (a GPU's kernel model) or matmul_efficiency (a nominal device), "
                             "not both or neither")
        if self.gemm is not None and self.attention is None:
            raise ValueError("a gemm section needs an attention section")
        params = self.parameter_names()
        groups = {".".join(p.split(".")[:i]) for p in params for i in range(1, p.count(".") + 1)}
        named = set(self.fitted_by.parameters if self.fitted_by else ())
        unknown = sorted((set(self.provenance) | named) - set(params) - groups)
        if unknown:
            raise ValueError(f"provenance or fitted_by of unknown parameters {unknown}; parameters: {', '.join(params)}")
        fitted = {p for p, v in self.provenance.items() if v.status == "fitted"}
        if fitted != named:
            raise ValueError(f"provenance says fitted for {sorted(fitted)}, fitted_by names {sorted(named)}")
        return self


def _leaves(prefix: str, value) -> list[str]:
    if isinstance(value, BaseModel):
        return [leaf for f in type(value).model_fields if getattr(value, f) is not None
                for leaf in _leaves(f"{prefix}.{f}", getattr(value, f))]
    return [prefix]


class Hardware(BaseModel):
    """config/hardware/{name}.yaml"""

    model_config = _STRICT
    name: str
    kind: Literal["gpu", "cpu"] = Field(description="cpu means the local device: kernels are measured, not modelled")
    # A GPU runs kernels from a queue the host fills ahead of it, so host time (Python, dispatch)
    # hides behind device time, except where the host falls behind or waits (``host``); and Megatron-LM, which the GPU targets stand for, runs tensor
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
    variability: Variability | None = Field(None, description="GPU-to-GPU speed spread for the step-time "
                                            "quantiles (summary step_p50_s ...); None: every GPU alike")
    host: Host | None = Field(None, description="the launching host's pace (echo.simulate: GPU ops wait "
                              "for their launch); None: the host is never behind (and the local CPU, whose "
                              "host time is its kernels', host_synchronous)")
    power: GpuPower | None = Field(None, description="board power for energy figures (python -m echo plan); "
                                   "None: energy is not estimated")

    @model_validator(mode="after")
    def _one_host_model(self) -> Hardware:
        # a synchronous host's time is already in its kernels (the profile stage): a launch pace would count it twice
        if self.host is not None and self.host_synchronous:
            raise ValueError("host (a launch pace) is for devices with a kernel queue; a host_synchronous device's "
                             "host time is in its kernels")
        return self
