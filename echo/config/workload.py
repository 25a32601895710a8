"""A training job: the model, how it is parallelized, and how it is trained."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


class ModelConfig(BaseModel):
    """The transformer's shape."""

    model_config = _STRICT
    arch: Literal["gpt", "llama", "hf", "module"] = Field(
        description="gpt: learned positions, GELU, LayerNorm; llama: RoPE, SwiGLU, RMSNorm, GQA; hf: the "
        "architecture of hf_config, built by transformers; module: a user's nn.Module (hf and module are set "
        "by the loader when hf_config or module is given)")
    layers: PositiveInt = Field(description="transformer layers")
    hidden: PositiveInt = Field(description="model width h")
    heads: PositiveInt = Field(description="attention heads")
    kv_heads: PositiveInt | None = Field(None, description="key/value heads (GQA); default = heads")
    ffn_hidden: PositiveInt | None = Field(None, description="MLP width; default 4*hidden for gpt, 8/3*hidden rounded up to 256 for llama")
    vocab: PositiveInt = Field(description="vocabulary size")
    seq_len: PositiveInt = Field(description="tokens per sequence")
    attention: Literal["flash", "math"] = Field(
        "flash", description="flash: fused attention (no s x s tensors kept); math: QK^T, softmax, "
        "dropout and PV as separate kernels, as Megatron-LM ran before fused attention")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability (attention and hidden)")
    experts: int = Field(0, ge=0, description="> 0 makes the MLP a mixture of experts")
    top_k: int = Field(0, ge=0, description="experts each token is routed to")
    expert_load: list[float] | None = Field(
        None, description="relative tokens each routed expert receives, one entry per expert (any positive "
        "scale; e.g. a measured router histogram); default: balanced. The traced rank holds the heaviest "
        "expert-parallel group, which the all-to-alls make every rank wait for (hf models)")
    hf_config: dict | None = Field(
        None, description="a Hugging Face config.json: in the workload file its path (relative to the "
        "repository root); once loaded, its content with hf_overrides applied. The shape fields above are "
        "then derived from it (echo.config.hf)")
    hf_source: str | None = Field(None, description="the path hf_config was read from (set by the loader)")
    hf_overrides: dict = Field(default_factory=dict, description="config.json keys to change, e.g. num_hidden_layers")
    module: str | None = Field(
        None, description="a user's model: 'path/to/file.py:function' (path relative to the repository root) "
        "returning an nn.Module with tok_emb, blocks, ln_f, head and optionally tp_plan (examples/tiny_model.py); "
        "the shape fields above must describe it")
    module_args: dict = Field(default_factory=dict, description="keyword arguments of the module's function")
    module_digest: str | None = Field(None, description="sha256 of the module's file (set by the loader: an edit re-traces)")

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.arch == "llama":  # SwiGLU's 2/3 of 4h, rounded up to a multiple of 256 (Llama's rule)
            return -(-(8 * self.hidden // 3) // 256) * 256
        return 4 * self.hidden

    @property
    def head_dim(self) -> int:
        if self.hf_config and self.hf_config.get("head_dim"):  # Qwen3, GPT-OSS: not hidden / heads
            return int(self.hf_config["head_dim"])
        return self.hidden // self.heads

    @model_validator(mode="after")
    def _hf_is_whole(self) -> ModelConfig:
        if (self.arch == "hf") != (self.hf_config is not None):
            raise ValueError("arch 'hf' goes with hf_config (the loader sets both from the config.json path)")
        if (self.arch == "module") != (self.module is not None):
            raise ValueError("arch 'module' goes with module (the loader sets it from the module path)")
        return self


class ParallelConfig(BaseModel):
    """How the job is split over ranks; world size = tp * pp * dp * cp."""

    model_config = _STRICT
    tp: PositiveInt = Field(1, description="tensor-parallel degree")
    pp: PositiveInt = Field(1, description="pipeline-parallel degree")
    dp: PositiveInt = Field(1, description="data-parallel degree")
    cp: PositiveInt = Field(1, description="context-parallel degree")
    ep: PositiveInt = Field(1, description="expert-parallel degree, folded over the tp x cp x dp ranks of a stage (Megatron-Core)")
    sequence_parallel: bool = Field(False, description="shard norms/dropout over tp (all-gather/reduce-scatter instead of all-reduce)")
    zero: Literal[0, 1, 2, 3] = Field(1, description="0 = DDP; 1, 2, 3 = ZeRO stage (3 = FSDP)")
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-2p", "zb-v", "dualpipev",
                      "dualpipe"] = Field(
        "1f1b", description="pipeline schedule (echo.training.schedule; zb-h1, zb-h2, zb-2p and zb-v: the "
        "zero-bubble schedules of Qi et al., each backward split into its input- and weight-gradient parts; zb-2p "
        "and zb-v are built for the stages' own pass times, echo.training.zb_auto and zb_v; zb-v places two chunks "
        "per pipeline rank in a V: rank s holds virtual stages s and 2 pp - 1 - s, ordered by the zero-bubble "
        "runtime's own V heuristic; dualpipev: DeepSeek's DualPipe cut "
        "in half (deepseek-ai/DualPipe's DualPipeV), the same V, its steady state pairing one micro-batch's "
        "forward with another's backward, overlapped at their expert-parallel all-to-alls; dualpipe: DeepSeek's "
        "DualPipe (DeepSeek-V3 report), micro-batches fed from both ends of the pipeline: rank s holds model "
        "stage s for the half fed at rank 0 and stage pp - 1 - s for the half fed at the last rank, two copies of "
        "every stage's parameters whose gradients are summed over the two ranks before the data-parallel "
        "reduction)")
    virtual_stages: PositiveInt = Field(1, description="model chunks per pipeline rank (interleaved)")
    overlap_grad_reduce: bool = Field(
        False, description="Megatron-LM's --overlap-grad-reduce: gradient buckets are reduced during the last "
        "backward as they fill, instead of after it (simulation only: the trace is the same)")
    overlap_param_gather: bool = Field(
        False, description="Megatron-LM's --overlap-param-gather: the distributed optimizer's parameter "
        "all-gathers overlap the next iteration's forward, each bucket waited for where the forward reaches "
        "its layers (needs zero 1 or 2 and data parallelism; simulation only)")
    tp_comm_overlap: bool = Field(
        False, description="Transformer Engine's --tp-comm-overlap (userbuffers): each sequence-parallel "
        "all-gather / reduce-scatter is pipelined in tp chunks with the GEMM that consumes / produces it "
        "(needs sequence_parallel and tp > 1; simulation only)")
    moe_dispatcher: Literal["alltoall", "flex"] = Field(
        "alltoall", description="Megatron-Core's --moe-token-dispatcher-type for expert parallelism: alltoall "
        "(tokens permuted by expert, all-to-all, then the received chunks sorted from source-rank order to "
        "local-expert order, and back before the combine: two more passes over the routed rows per "
        "direction); flex (DeepEP / HybridEP: a token goes once to each rank holding one of its experts and "
        "is expanded there into a row per local expert, no chunk sort; the experts' rows are summed per token "
        "before the combine; their node-level deduplication across nodes is not modelled)")
    ep_comm_overlap: bool = Field(
        False, description="Megatron-Core's --overlap-moe-expert-parallel-comm (combined 1F1B, as DeepSeek-V3's "
        "DualPipe overlaps): in steady state a forward and a backward of two micro-batches run interleaved at "
        "their expert-parallel all-to-alls, each all-to-all hidden behind the other pass' compute; the "
        "schedule warms up one micro-batch more so that the two are independent (needs ep > 1 and, with pp > 1, the "
        "interleaved schedule; simulation only)")
    post_validation: bool = Field(
        False, description="the zero-bubble paper's optimizer post-validation: no synchronization of every "
        "stage before the optimizer step (the gradient-norm and inf/NaN all-reduce is checked after the "
        "update, rolled back if needed), so each stage starts its next step as soon as it can (simulation "
        "only; symmetric mode)")
    stage_layers: list[NonNegativeInt] | None = Field(
        None, description="layers of each virtual stage in pipeline order (pp x virtual_stages entries); "
        "default: layers split evenly. Llama 3 405B puts one layer less on the first and last stage. Only the "
        "first and last virtual stage may hold none (the embedding, or the head and loss, alone)")
    pipeline_split: Literal["even", "embedding_and_loss"] = Field(
        "even", description="how layers split over the virtual stages when stage_layers is not given: even; "
        "embedding_and_loss (Megatron-LM's --account-for-embedding-in-pipeline-split and "
        "--account-for-loss-in-pipeline-split): the embedding and the head and loss count as a layer each, "
        "so the first and last virtual stage hold one layer less (none, where each stage holds one) and "
        "(layers + 2) must divide by pp x virtual_stages")

    @property
    def placement(self) -> str:
        """How chunks sit on pipeline ranks: interleaved (chunk c of rank s is virtual stage
        c * pp + s, Megatron-LM's), v (the zero-bubble paper's ZB-V: rank s holds virtual
        stages s and 2 pp - 1 - s, so the first rank also holds the last stage) or dual
        (DualPipe: the model in pp stages, rank s holds stage s as chunk 0, on the way of the
        micro-batches fed at rank 0, and stage pp - 1 - s as chunk 1, on the way of those fed at
        the last rank)."""
        return "v" if self.schedule in V_SCHEDULES else "dual" if self.schedule in DUAL_SCHEDULES else "interleaved"

    @property
    def model_stages(self) -> int:
        """Stages the model is split into: pp x virtual_stages, or pp where a micro-batch passes one
        chunk of each rank (dual)."""
        return model_stages(self.placement, self.pp, self.virtual_stages)

    def virtual_stage(self, chunk: int, pp_rank: int) -> int:
        """The virtual stage (position in the model's pipeline order) of a rank's chunk."""
        return virtual_stage(self.placement, self.pp, chunk, pp_rank)

    def rank_of_stage(self, stage: int, chunk: int = 0) -> tuple[int, int]:
        """(pipeline rank, chunk) holding virtual stage ``stage`` (dual: on chunk ``chunk``'s way)."""
        if self.placement == "v":
            return (stage, 0) if stage < self.pp else (2 * self.pp - 1 - stage, 1)
        if self.placement == "dual":
            return (stage, 0) if chunk == 0 else (self.pp - 1 - stage, 1)
        return stage % self.pp, stage // self.pp

    def layers_of(self, layers: int) -> list[int]:
        """Layers of every virtual stage, in pipeline order (stage v*pp + s is chunk v of rank s)."""
        chunks = self.model_stages
        if self.stage_layers:
            return list(self.stage_layers)
        if self.pipeline_split == "embedding_and_loss":
            return split_with_embedding_and_loss(layers, chunks)
        return [layers // chunks] * chunks

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


# What the tracer does not read, per section: how the simulator replays a trace (the pipeline
# schedule over the traced chunks, the overlap flags) and how many micro-batches it repeats. The
# trace, dedup and profile stages see the workload without these keys (trace_dump), so changing
# one re-runs the simulation only, and sweep layouts that differ only in them share one trace.
def split_with_embedding_and_loss(layers: int, chunks: int) -> list[int]:
    """Megatron's split with the embedding and the head and loss counted as a layer each: the
    first and last virtual stage hold one layer less (ValueError when it does not divide)."""
    per, rest = divmod(layers + 2, chunks)
    if rest or per < 1 or chunks < 2:
        raise ValueError(f"{layers} layers + embedding + loss do not split evenly over {chunks} virtual stages")
    return [per - 1] + [per] * (chunks - 2) + [per - 1]


# schedules whose chunks sit in a V on the pipeline ranks, or on both ways of a pipeline fed from
# both ends (ParallelConfig.placement)
V_SCHEDULES = ("zb-v", "dualpipev")
DUAL_SCHEDULES = ("dualpipe",)


def model_stages(placement: str, pp: int, chunks: int) -> int:
    """Positions on a micro-batch's way through the pipeline: every chunk of every rank, or one
    chunk of each rank where micro-batches run from both ends (dual)."""
    return pp if placement == "dual" else pp * chunks


def virtual_stage(placement: str, pp: int, chunk: int, pp_rank: int) -> int:
    """Chunk ``chunk`` of pipeline rank ``pp_rank`` as a position in the model: interleaved
    (chunk * pp + pp_rank), a V (rank s holds virtual stages s and 2 pp - 1 - s) or dual (rank s
    holds stage s on the way from rank 0 and stage pp - 1 - s on the way from the last rank)."""
    if placement == "v":
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    if placement == "dual":
        return pp_rank if chunk == 0 else pp - 1 - pp_rank
    return chunk * pp + pp_rank

NOT_TRACED = {
    "parallel": ("schedule", "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "ep_comm_overlap",
                 "post_validation"),
    "training": ("global_batch", "cuda_graph"),
}


class TrainingConfig(BaseModel):
    """One optimizer iteration's batch and numerics."""

    model_config = _STRICT
    global_batch: PositiveInt = Field(description="sequences per iteration")
    micro_batch: PositiveInt = Field(1, description="sequences per micro-batch")
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = Field(
        "bf16", description="compute dtype; fp8: the linear layers' GEMMs run in FP8 by fp8_recipe, everything "
        "else (embedding, LM head, norms, attention core, optimizer) in bf16 with fp32 master weights")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="activation recomputation: none; selective (the modules of recompute_modules); full "
        "(every layer from its input, Megatron's full granularity)")
    recompute_modules: list[Literal["core_attn", "layernorm", "moe_act", "mlp", "mla_up_proj"]] = Field(
        default_factory=lambda: ["core_attn"], description="with recompute: selective, Megatron-Core's --recompute-modules (default "
        "core_attn): core_attn re-runs the attention core in backward (Korthikanti et al.); layernorm and moe_act "
        "keep their input and not their output, which backward recomputes (CheckpointWithoutOutput: the norms "
        "before attention and MLP; the routed experts' activation); mlp checkpoints each dense MLP; mla_up_proj "
        "keeps MLA's latents and recomputes the up-projections and RoPE (DeepSeek). All but core_attn need an "
        "hf_config model")
    fp8_recipe: Literal["delayed", "current", "mxfp8", "blockwise", "nvfp4"] | None = Field(
        None, description="how FP8 tensors are scaled (dtype fp8 only). delayed: per-tensor scales from an amax "
        "history, amaxes all-reduced once per step (Transformer Engine's default on Hopper); current: per-tensor "
        "scales from each tensor's own amax (Megatron FP8-CS, torchao tensorwise); mxfp8: 1x32 E8M0 block scales "
        "(Blackwell); blockwise: 1x128 activation and 128x128 weight tiles (DeepSeek-V3); nvfp4: FP4 E2M1 with 1x16 "
        "E4M3 block scales (Blackwell)")
    fp8_param_gather: bool = Field(
        False, description="ZeRO / FSDP all-gather parameters in FP8 (half the bytes of bf16); dtype fp8 only")
    cross_entropy_fusion: bool = Field(
        False, description="Megatron's --cross-entropy-loss-fusion (the Megatron-Bridge presets' "
        "cross_entropy_fusion_impl te): the loss and the logits' gradient in one kernel over the bf16 logits; "
        "off, the loss runs on an fp32 copy of the logits (Megatron's default, torchtitan)")
    grad_reduce_in_fp32: bool = Field(
        True, description="Megatron's gradient buffers (main_grad) and their reduction in fp32 (True: "
        "--accumulate-allreduce-grads-in-fp32, Megatron-Bridge's bf16_mixed default); False: in the compute "
        "dtype, half the buffer and half the reduce-scatter bytes, the optimizer casting its shard to fp32 "
        "(the Bridge performance presets' grad_reduce_in_fp32=False). ZeRO 0-2 (FSDP2 reduces in fp32)")
    cuda_graph: Literal["none", "full_iteration"] = Field(
        "none", description="CUDA graphs: none (eager: the host launches every op, echo.simulate's host clock, "
        "Hardware.host); full_iteration (Megatron-Core's cuda_graph_scope full_iteration: the whole step is "
        "captured and replayed as one launch, so no host time and no host sync; Megatron then runs its MoE "
        "dispatch without reading token counts on the host). Graphs of single modules (attn, moe_router, ...) "
        "are not expressed: their ops are launched one by one")


class Workload(BaseModel):
    """A whole workload file (config/workloads/{name}.yaml)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(description="the file's stem")
    model: ModelConfig
    parallel: ParallelConfig
    training: TrainingConfig
    description: str = Field("", description="free text")
    verify: int = Field(1, ge=0, description="extra ranks dedup traces to confirm they hash like their class")

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def micro_batches(self) -> int:
        """Micro-batches each pipeline runs per iteration."""
        t, p = self.training, self.parallel
        return t.global_batch // (t.micro_batch * p.dp)

    def traced(self) -> Workload:
        """The workload as the tracer sees it: the ``NOT_TRACED`` keys set to fixed values (a
        schedule that runs the same chunks, no overlap flag, one micro-batch per stage), so that
        workloads differing only in them trace alike and the trace cannot come to depend on them."""
        p, t = self.parallel, self.training
        fixed = {
            # the schedule's chunk placement is traced (which layers a rank holds, its p2p peers)
            "parallel": {"schedule": {"v": "zb-v", "dual": "dualpipe"}.get(
                p.placement, "interleaved" if p.virtual_stages > 1 else "1f1b"),
                         "overlap_grad_reduce": False,
                         "overlap_param_gather": False, "tp_comm_overlap": False, "ep_comm_overlap": False,
                         "post_validation": False},
            "training": {"global_batch": t.micro_batch * p.dp * p.pp, "cuda_graph": "none"},
        }
        assert {k: tuple(v) for k, v in fixed.items()} == NOT_TRACED, "traced() must fix exactly NOT_TRACED"
        return self.model_copy(update={"parallel": p.model_copy(update=fixed["parallel"]),
                                       "training": t.model_copy(update=fixed["training"])})

    def trace_dump(self) -> dict:
        """``traced().model_dump()``: what the trace, dedup and profile stages depend on."""
        return self.traced().model_dump()

    def contradictions(self) -> list[tuple[str, str]]:
        """(key, reason) for every pair of numbers that cannot both hold."""
        m, p, t = self.model, self.parallel, self.training
        out: list[tuple[str, str]] = []

        def need(ok: bool, key: str, reason: str) -> None:
            if not ok:
                out.append((key, reason))

        need(m.arch == "hf" or m.hidden % m.heads == 0, "model.hidden", f"hidden {m.hidden} is not divisible by heads {m.heads}")
        need(m.heads % p.tp == 0, "parallel.tp", f"heads {m.heads} is not divisible by tp {p.tp}")
        need(m.kv % p.tp == 0 or p.tp % m.kv == 0, "model.kv_heads", f"kv_heads {m.kv} and tp {p.tp} do not divide one another")
        need(m.heads % m.kv == 0, "model.kv_heads", f"heads {m.heads} is not divisible by kv_heads {m.kv}")
        need(m.ffn % p.tp == 0, "model.ffn_hidden", f"ffn_hidden {m.ffn} is not divisible by tp {p.tp}")
        need(m.vocab % p.tp == 0, "model.vocab", f"vocab {m.vocab} is not divisible by tp {p.tp}")
        chunks = p.model_stages
        split = "pp" if p.placement == "dual" else "pp x virtual_stages"  # what the model's stages are
        need(p.stage_layers is None or p.pipeline_split == "even", "parallel.pipeline_split",
             "stage_layers gives the split itself: leave pipeline_split at even")
        if p.stage_layers is None and p.pipeline_split == "embedding_and_loss":
            try:
                split_with_embedding_and_loss(m.layers, chunks)
            except ValueError:
                need(False, "parallel.pipeline_split", f"layers {m.layers} + embedding + loss = {m.layers + 2} are "
                     f"not divisible by {split} = {chunks}")
        elif p.stage_layers is None:
            need(m.layers % chunks == 0, "model.layers", f"layers {m.layers} are not divisible by {split} = {chunks}")
        else:
            need(len(p.stage_layers) == chunks, "parallel.stage_layers",
                 f"{len(p.stage_layers)} entries, expected {split} = {chunks}")
            need(sum(p.stage_layers) == m.layers, "parallel.stage_layers",
                 f"entries sum to {sum(p.stage_layers)}, not layers {m.layers}")
            empty = [i for i, n in enumerate(p.stage_layers) if n == 0]
            need(all(i in (0, chunks - 1) for i in empty) and len(p.stage_layers) > 1, "parallel.stage_layers",
                 f"virtual stages {empty} hold no layer: only the first (embedding) or last (head and loss) may")
        need(t.global_batch % (t.micro_batch * p.dp) == 0, "training.global_batch",
             f"global_batch {t.global_batch} is not divisible by micro_batch x dp = {t.micro_batch * p.dp}")
        need(m.seq_len % (p.cp * (2 if p.cp > 1 else 1)) == 0, "parallel.cp", f"seq_len {m.seq_len} cannot be split into 2 x cp = {2 * p.cp} chunks")
        need(not p.sequence_parallel or m.seq_len % p.tp == 0, "parallel.sequence_parallel",
             f"seq_len {m.seq_len} is not divisible by tp {p.tp}")
        need((m.experts == 0) == (m.top_k == 0), "model.top_k", "experts and top_k must both be 0 or both be > 0")
        need(m.top_k <= m.experts, "model.top_k", f"top_k {m.top_k} exceeds experts {m.experts}")
        if m.expert_load is not None:
            need(len(m.expert_load) == m.experts, "model.expert_load",
                 f"{len(m.expert_load)} entries for {m.experts} experts")
            need(all(x > 0 for x in m.expert_load), "model.expert_load", "every expert needs a load above 0")
            need(m.arch == "hf", "model.expert_load", "imbalanced routing is traced for hf_config models")
        need(p.ep == 1 or (m.experts > 0 and m.experts % p.ep == 0), "parallel.ep", f"ep {p.ep} needs experts divisible by it (experts = {m.experts})")
        need(p.ep == 1 or (p.tp * p.cp * p.dp) % p.ep == 0, "parallel.ep",
             f"ep {p.ep} must divide tp x cp x dp = {p.tp * p.cp * p.dp} (the ranks of a stage it folds over)")
        need(p.schedule in ("interleaved", *V_SCHEDULES, *DUAL_SCHEDULES) or p.virtual_stages == 1,
             "parallel.virtual_stages",
             f"virtual_stages {p.virtual_stages} > 1 needs schedule: interleaved (or zb-v, dualpipev, dualpipe)")
        need(p.schedule not in DUAL_SCHEDULES or (p.virtual_stages == 2 and p.pp > 1 and p.pp % 2 == 0),
             "parallel.schedule", f"{p.schedule} feeds the pipeline from both ends, one chunk a way: virtual_stages 2 and "
             f"an even pp (got {p.virtual_stages} and {p.pp})")
        need(p.schedule not in DUAL_SCHEDULES or (self.micro_batches >= 2 * p.pp and self.micro_batches % 2 == 0),
             "training.global_batch", f"{p.schedule} feeds half the micro-batches from each end: it needs an even "
             f"count of at least 2 x pp = {2 * p.pp} (got {self.micro_batches})")
        need(p.schedule not in DUAL_SCHEDULES or p.zero < 3, "parallel.zero",
             f"{p.schedule} keeps two copies of each stage on two ranks; zero 3 (FSDP) shards them over data "
             "parallelism instead")
        need(p.schedule not in V_SCHEDULES or (p.virtual_stages == 2 and p.pp > 1), "parallel.schedule",
             f"{p.schedule} holds two chunks per pipeline rank in a V: virtual_stages 2 and pp > 1 (got "
             f"{p.virtual_stages} and {p.pp})")
        need(p.schedule != "dualpipev" or self.micro_batches >= 2 * p.pp, "training.global_batch",
             f"dualpipev needs at least 2 x pp = {2 * p.pp} micro-batches (got {self.micro_batches})")
        need(p.schedule != "interleaved" or p.pp > 1, "parallel.schedule", "interleaved needs pp > 1")
        need(p.schedule != "interleaved" or self.micro_batches % p.pp == 0, "training.global_batch",
             f"interleaved needs micro-batches ({self.micro_batches}) divisible by pp {p.pp}")
        need(not p.overlap_param_gather or p.zero in (1, 2), "parallel.overlap_param_gather",
             f"overlaps the distributed optimizer's parameter all-gather, which needs zero 1 or 2 (zero is {p.zero})")
        need(not p.overlap_param_gather or p.dp * p.cp > 1, "parallel.overlap_param_gather",
             "there is no parameter all-gather without data parallelism (dp x cp = 1)")
        need(not p.tp_comm_overlap or p.tp > 1, "parallel.tp_comm_overlap",
             f"overlaps tensor-parallel communication, which needs tp > 1 (tp is {p.tp})")
        need((t.dtype == "fp8") == (t.fp8_recipe is not None), "training.fp8_recipe",
             "dtype fp8 needs an fp8_recipe (delayed | current | mxfp8 | blockwise | nvfp4)" if t.dtype == "fp8"
             else f"fp8_recipe {t.fp8_recipe} needs dtype: fp8 (dtype is {t.dtype})")
        need(not t.fp8_param_gather or (t.dtype == "fp8" and p.zero >= 1), "training.fp8_param_gather",
             "gathers FP8 parameters, which needs dtype fp8 and a sharded optimizer (zero 1, 2 or 3)")
        modules = t.recompute_modules
        need(t.recompute == "selective" or modules == ["core_attn"], "training.recompute_modules",
             f"{list(modules)} are recomputed under recompute: selective (recompute is {t.recompute})")
        need(len(set(modules)) == len(modules), "training.recompute_modules", f"{list(modules)} lists a module twice")
        need(m.arch == "hf" or set(modules) <= {"core_attn"}, "training.recompute_modules",
             f"{sorted(set(modules) - {'core_attn'})} are traced for hf_config models only")
        need("moe_act" not in modules or m.experts > 0, "training.recompute_modules",
             "moe_act recomputes the routed experts' activation; the model has no experts")
        need("mla_up_proj" not in modules or bool((m.hf_config or {}).get("kv_lora_rank")), "training.recompute_modules",
             "mla_up_proj recomputes multi-head latent attention's up-projections; the model has no kv_lora_rank")
        need(t.grad_reduce_in_fp32 or p.zero < 3, "training.grad_reduce_in_fp32",
             "FSDP2 (zero 3) reduces gradients in fp32 as torchtitan runs it; a compute-dtype reduction is not modelled")
        need(not p.ep_comm_overlap or p.ep > 1, "parallel.ep_comm_overlap",
             f"overlaps expert-parallel all-to-alls, which needs ep > 1 (ep is {p.ep})")
        need(p.schedule not in ("dualpipev", "dualpipe") or not p.ep_comm_overlap, "parallel.ep_comm_overlap",
             f"{p.schedule} pairs its steady-state forwards and backwards itself (leave ep_comm_overlap off)")
        need(not p.ep_comm_overlap or p.pp == 1 or p.schedule == "interleaved", "parallel.ep_comm_overlap",
             "with pp > 1 the combined 1F1B needs schedule: interleaved (Megatron-Core): in plain 1F1B a pair's "
             "backward waits for the next stage's whole pair")
        need(not p.schedule.startswith("zb-") or not p.ep_comm_overlap, "parallel.ep_comm_overlap",
             f"the combined 1F1B pairs a forward with a whole backward; {p.schedule} splits the backward")
        need(not p.tp_comm_overlap or p.sequence_parallel, "parallel.tp_comm_overlap",
             "pipelines the sequence-parallel all-gathers and reduce-scatters, which needs sequence_parallel: true")
        return out
