"""Models given as Hugging Face configs, built with transformers' own modeling code (offline, no
weights) and cut into pipeline chunks like the reference models.

transformers' decoder layers are used as they are: attention projections, RoPE variants, MLA's
low-rank projections, RMSNorm, routers, shared experts. Echo replaces two things, both for the
GPU a trace stands for rather than for the math:
- the attention kernel: an attention function registered as "echo" (transformers' own
  AttentionInterface) runs Echo's causal attention core, so context parallelism, selective
  recompute and the fused (flash) kernel are the same as for the reference models;
- the routed experts' forward: transformers loops over the experts a batch hit, a data-dependent
  loop a fake trace cannot take. Echo runs the Megatron-Core path instead (hf_moe.py): balanced
  routing, all-to-all dispatch over expert parallelism, one grouped GEMM per projection, combine.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import nullcontext

import torch
import torch.nn as nn

from echo.config.workload import ModelConfig, Workload
from echo.errors import ConfigError
from echo.training import fused, hf_mla, hf_moe, sliding_attention
from echo.training.layers import RecomputedOutputs, RecomputeHook, attention_core, recomputed
from echo.training.layout import chunk_slots

ATTENTION = "echo"


def _echo_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: q [b, heads, s, d], k/v [b, kv_heads, s, d]
    in, ([b, s, heads, d_v], None) out. Causal, as every decoder here (no mask is passed)."""
    group = query.shape[1] // key.shape[1]
    value, d_v = hf_mla.pad_value(value, query.shape[-1])  # MLA: v heads narrower than q/k heads
    selective, hook = getattr(module, "echo_selective", False), getattr(module, "echo_hook", nullcontext)
    cp_group, p = getattr(module, "cp_group", None), dropout if module.training else 0.0
    window = kwargs.get("sliding_window")
    if window and cp_group is None and query.shape[2] > window:
        if group > 1:  # the band kernel takes one key / value head per query head
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        # one fused kernel over the band (sliding_attention); dropout is not applied, as in the flash path
        core = lambda q, k, v: sliding_attention.sliding_attention(q, k, v, window)[0]  # noqa: E731
        out = recomputed(core, hook)(query, key, value) if selective else core(query, key, value)
    else:  # grouped-query K / V as they are: the fused kernel reads each head for its group (attention_core)
        out = attention_core(query, key, value, selective, hook, cp_group, "flash", p)
    return out[..., :d_v].transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _echo_attention)


def source(cfg: ModelConfig) -> str:
    return cfg.hf_source or "model.hf_config"


def hf_config(cfg: ModelConfig):
    """The transformers config object of ``cfg.hf_config``; an architecture the pinned
    transformers does not know, or keys its class rejects, are a ConfigError naming the file."""
    from transformers import AutoConfig

    data = dict(cfg.hf_config)
    model_type = data.pop("model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        data.pop(key, None)  # provenance, not shape
    try:
        conf = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        raise ConfigError(source(cfg), "model_type", f"transformers {_version()} cannot build it: {exc}") from None
    conf.use_cache = False
    conf._attn_implementation = ATTENTION
    return conf


def _version() -> str:
    import transformers

    return transformers.__version__


def check_buildable(w: Workload) -> None:
    """Refuse, before tracing, what transformers or Echo's plans cannot build for ``w``."""
    cfg, p = w.model, w.parallel
    conf = hf_config(cfg)
    from transformers import AutoModelForCausalLM

    if type(conf) not in AutoModelForCausalLM._model_mapping:
        raise ConfigError(source(cfg), "model_type", f"'{conf.model_type}' has no causal-LM class in transformers {_version()}")
    if getattr(conf, "tie_word_embeddings", False) and (p.pp > 1 or p.tp > 1):
        raise ConfigError(source(cfg), "tie_word_embeddings",
                          "tied embeddings are not traced with tp or pp > 1 (Megatron unties them across stages)")


def build_hf_model(cfg: ModelConfig) -> nn.Module:
    """The whole causal LM of ``cfg`` with uninitialized parameters (the tracer's fake mode)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    _register_attention()
    with no_init_weights():
        lm = AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation=ATTENTION)
    _fuse(lm)
    return lm


def _fuse(lm: nn.Module) -> None:
    """The fused RMSNorm, SwiGLU and RoPE kernels Megatron-Core (Transformer Engine) and compiled
    torchtitan run, in place of transformers' eager op chains (fused.py). RoPE is replaced where
    the model's modeling module uses the standard rotate_half form."""
    fused.fuse_rms_norms(lm)
    fused.fuse_swiglu_mlps(lm)
    modeling = sys.modules[type(lm).__module__]
    standard = getattr(modeling, "apply_rotary_pos_emb", None)
    if standard is not None and standard is not fused.apply_rotary_pos_emb:
        if "rotate_half(q)" in inspect.getsource(standard):
            modeling.apply_rotary_pos_emb = fused.apply_rotary_pos_emb


class HFChunk(nn.Module):
    """Consecutive decoder layers of a transformers causal LM, with the token embedding on the
    first chunk and the final norm + LM head on the last; same contract as model.ModelChunk."""

    hf = True

    def __init__(self, lm: nn.Module, layer_ids: range, *, first: bool, last: bool,
                 recompute: str = "none", hook: RecomputeHook = nullcontext, modules: list[str] | None = None):
        super().__init__()
        base = lm.model
        self.first, self.last, self.layer_ids = first, last, layer_ids
        self.tok_emb = base.embed_tokens if first else None
        self.blocks = nn.ModuleList(base.layers[i] for i in layer_ids)
        self.rotary = base.rotary_emb  # no parameters: every chunk computes its own RoPE tables
        self.ln_f, self.head = (base.norm, lm.lm_head) if last else (None, None)
        self.full, self.hook = recompute == "full", hook
        self.seq_shard = (0, 1)
        # the model's own tensor-parallel plan, where transformers ships one (tensor_parallel.py)
        self.hf_tp_plan = dict(getattr(lm.config, "base_model_tp_plan", None) or {})
        selective = set(modules or ["core_attn"]) if recompute == "selective" else set()
        # layernorm / moe_act: outputs the readers do not keep (layers.RecomputedOutputs)
        self.outputs = RecomputedOutputs(hook) if selective & {"layernorm", "moe_act", "mla_up_proj"} else None
        for block in self.blocks:
            if "mla_up_proj" in selective and hf_mla.is_mla(block.self_attn):
                hf_mla.recompute_up_projections(block.self_attn, self.outputs)
            block.self_attn.echo_selective, block.self_attn.echo_hook = "core_attn" in selective, hook
            block.hook = hook  # the sequence-parallel plan labels its backward gathers with it
            if "layernorm" in selective:
                for name in _NORMS:
                    if isinstance(getattr(block, name, None), nn.Module):
                        _recompute_output(getattr(block, name), self.outputs)
            if "mlp" in selective and not any(hf_moe.is_experts(m) for m in block.mlp.modules()):
                block.mlp.forward = recomputed(block.mlp.forward, hook)  # a dense MLP, checkpointed
            if "moe_act" in selective:
                for m in block.mlp.modules():
                    if hf_moe.is_experts(m):
                        m.recompute_act = self.outputs

    def set_groups(self, groups: dict) -> None:
        for block in self.blocks:
            block.self_attn.cp_group = groups["cp"]
            for m in block.mlp.modules():
                if hasattr(m, "ep_group"):
                    m.ep_group = groups["ep"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x)
        local = x.to_local() if hasattr(x, "to_local") else x
        # positions of the whole (context-parallel local) sequence: attention gathers it first
        s = local.shape[1] * self.seq_shard[1]
        positions = torch.arange(s, device=local.device).unsqueeze(0)
        rope = self.rotary(local, positions)
        for block in self.blocks:
            if self.full:
                x = recomputed(self._layer(block), self.hook)(x, *rope)
            else:
                with self.outputs.saving() if self.outputs is not None else nullcontext():
                    x = self._layer(block)(x, *rope)
        if self.last:
            x = self.head(self.ln_f(x))
        return x

    @staticmethod
    def _layer(block: nn.Module):
        def run(x, cos, sin):
            return block(x, attention_mask=None, position_embeddings=(cos, sin))
        return run


# the norms Megatron-Core's layernorm recompute covers: before attention and before the MLP
# (transformers' names; the q / k norms inside attention are not among them)
_NORMS = ("input_layernorm", "post_attention_layernorm")


def _recompute_output(norm: nn.Module, outputs: RecomputedOutputs) -> None:
    """The norm's output is not kept by its readers; backward recomputes it from the input."""
    run = norm.forward

    def forward(x):
        return outputs.keep(run(x), lambda: run(x))
    norm.forward = forward


def build_hf_chunks(w: Workload, pp_rank: int, hook: RecomputeHook = nullcontext) -> list[HFChunk]:
    """The chunks of pipeline rank ``pp_rank`` (layout as model.build_chunks), routed experts
    cut to this rank's 1/ep of them."""
    lm = build_hf_model(w.model)
    conf = w.model.hf_config  # the router's expert groups (DeepSeek-V3's group-limited routing)
    chunks = [HFChunk(lm, slot.layers, first=slot.first, last=slot.last, recompute=w.training.recompute, hook=hook,
                      modules=w.training.recompute_modules)
              for slot in chunk_slots(w.parallel, w.model.layers, pp_rank)]
    for chunk in chunks:
        hf_moe.localize_experts(chunk, w.parallel.ep, w.model.expert_load, w.parallel.moe_dispatcher,
                                (conf.get("n_group") or 1, conf.get("topk_group") or 1))
    return chunks
