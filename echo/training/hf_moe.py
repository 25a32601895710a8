"""Routed experts of transformers' MoE layers, run the way Megatron-Core runs them on GPUs.

transformers keeps each MoE layer's routed experts in one module (``*Experts``) holding 3-D
weights [experts, ., .] and loops over the experts that a batch hit, a data-dependent loop that
a fake trace cannot take and that no GPU framework uses for training. Echo keeps transformers'
router, shared experts and weights and replaces that module's forward with the path of
moe.MoE: balanced routing (every local expert receives tokens x top_k x ep / experts rows, the
capacity a load-balancing loss steers towards), all-to-all dispatch over the expert-parallel
group (the routing weights with them), one batched GEMM per projection with the routing weight
applied inside the fused activation (Megatron-Core's weighted_bias_swiglu / quick_geglu: the
combine's sum over the top_k then keeps nothing for backward), all-to-all combine.
With expert parallelism each rank keeps experts / ep of the weights.

The flex dispatcher (DeepEP, HybridEP) sends a token to each expert-parallel rank once however
many of its top_k experts that rank holds, expands it into one row per local expert on arrival,
sums the local experts' outputs before sending them back, and the source sums the ranks' replies
(``_forward_flex``); the alltoall dispatcher sends one row per chosen expert. Under balanced
routing a rank is hit with the probability ``hit_probability`` gives (with ``model.expert_load``
every dispatcher sends a row per chosen expert: which tokens share a rank is not known). The node-level
deduplication of DeepEP's inter-node kernels (one RDMA copy per node, forwarded over NVLink) is
not modelled: across nodes the flex dispatch is a rank-level all-to-all here.

Imbalanced routing (``model.expert_load``, relative tokens per expert): expert e then receives
its share of the routed rows, the dispatch and combine carry unequal splits, and the local
experts run one GEMM each (Megatron's grouped GEMM over unequal groups). The all-to-alls make
every expert-parallel rank wait for the most loaded one, so the traced rank stands for it: it
holds the heaviest group of experts / ep consecutive experts.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import types

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from echo.training import fp8, fused


def is_experts(m: nn.Module) -> bool:
    """Whether ``m`` is a transformers routed-experts module (3-D gate_up_proj and down_proj)."""
    up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and up.dim() == 3 and down.dim() == 3


def heaviest_group(load: list[float], ep: int) -> list[float]:
    """Each expert's share of all routed rows, for the group of experts / ep consecutive experts
    with the largest total (where a rank sits in the expert-parallel group does not change the
    step: the all-to-alls wait for the heaviest rank)."""
    per = len(load) // ep
    groups = [load[g * per:(g + 1) * per] for g in range(ep)]
    total = sum(load)
    return [x / total for x in max(groups, key=sum)]


def hit_probability(experts: int, top_k: int, ep: int, groups: tuple[int, int] = (1, 1)) -> float:
    """Probability that a token's top_k experts include one of a given expert-parallel rank's
    experts / ep, routing balanced (each token's experts a uniform draw, as Megatron's
    moe_router_force_load_balancing makes them); ``groups`` = (n_group, topk_group) of a
    group-limited router (DeepSeek-V3: the token first picks topk_group of n_group expert groups,
    then its top_k experts among theirs). A rank's experts are consecutive, so they lie in one group
    or cover whole groups."""
    n_group, topk_group = groups
    per_group, local = experts // n_group, experts // ep
    # experts a token draws its top_k from (at least top_k: a router cannot pick more than it sees)
    chosen = max(topk_group * per_group, top_k)
    spans = max(1, local // per_group)  # groups the rank's experts cover
    in_group = min(local, per_group)    # of its experts, those in each covered group
    miss = 0.0
    for j in range(spans + 1):  # j of the rank's groups are among the token's topk_group
        p_j = math.comb(spans, j) * math.comb(n_group - spans, topk_group - j) / math.comb(n_group, topk_group)
        miss += p_j * math.comb(chosen - j * in_group, top_k) / math.comb(chosen, top_k)
    return 1.0 - miss


def localize_experts(chunk: nn.Module, ep: int, load: list[float] | None = None, dispatcher: str = "alltoall",
                     groups: tuple[int, int] = (1, 1)) -> None:
    """Cut every experts module of ``chunk`` to its 1/ep share and give it the Megatron path
    (balanced, or by ``load``: relative tokens per expert; ``dispatcher``: parallel.moe_dispatcher;
    ``groups``: the router's (n_group, topk_group), for the flex dispatcher's deduplication)."""
    for m in chunk.modules():
        if not is_experts(m):
            continue
        experts = m.gate_up_proj.shape[0]
        if experts % ep:
            raise ValueError(f"{experts} experts are not divisible by ep {ep}")
        local = experts // ep
        for name, param in list(m.named_parameters(recurse=False)):
            # a new parameter of the local share (fake: no memory); tagged so that data
            # parallelism reduces it over the expert-data-parallel group
            new = nn.Parameter(param.new_empty((local, *param.shape[1:])))
            new.echo_expert = True
            setattr(m, name, new)
        m.local_experts, m.ep, m.ep_group, m.dispatcher = local, ep, None, dispatcher
        m.experts, m.groups = experts, groups
        m.shares = heaviest_group(load, ep) if load else None
        m.forward = types.MethodType(_forward if load is None else _forward_imbalanced, m)


def _forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """[tokens, h] in and out, as transformers' experts modules (indices and weights [tokens, k])."""
    tokens, h = hidden_states.shape
    k = top_k_index.shape[-1]
    if self.ep > 1 and getattr(self, "dispatcher", "alltoall") == "flex":
        return _forward_flex(self, hidden_states, top_k_weights)
    # one copy of each token per chosen expert, grouped by destination (balanced routing); the
    # routing weights travel with them (Megatron's dispatcher sends the permuted probabilities)
    routed = _sort_chunks(self, _all_to_all(self, hidden_states.repeat_interleave(k, dim=0)))
    probs = _sort_chunks(self, _all_to_all(self, top_k_weights.reshape(-1, 1)))
    y = _project(self, routed.view(self.local_experts, -1, h), slice(None), probs.view(self.local_experts, -1, 1))
    y = _all_to_all(self, _sort_chunks(self, y.reshape(-1, h), back=True))
    return y.view(tokens, k, h).sum(dim=1)


def _forward_flex(self, hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The flex dispatcher (DeepEP / HybridEP) under balanced routing: each token goes once to each
    rank holding one of its experts (``hit_probability``), with its k routing weights; the
    receiver expands it into a row per local expert it chose (Megatron's fused moe_permute), and
    after the experts sums those rows back into one per token (the fused unpermute) for the
    combine; the source sums the replies of the ranks it sent the token to. The index tensors
    stand for DeepEP's layout (is_token_in_rank) and the permutation map: fake, only their sizes
    matter."""
    tokens, h = hidden_states.shape
    k = top_k_weights.shape[-1]
    unique = max(1, round(tokens * hit_probability(self.experts, k, self.ep, self.groups)))
    rows = tokens * k  # this rank's experts' rows from all sources (balanced routing)
    # one fill stands for the kernels that compute DeepEP's layout and the permutation map
    maps = torch.zeros(max(self.ep * unique, rows), dtype=torch.long, device=hidden_states.device)
    sent_at, row_at = maps[:self.ep * unique], maps[:rows]  # (views: no kernel)
    # the tokens for each rank, once each, with their weights (DeepEP's dispatch reads both at once)
    sent, sent_weights = gather_rows(hidden_states, top_k_weights, sent_at)
    received, weights = _all_to_all(self, sent), _all_to_all(self, sent_weights)
    # the received token of each local expert's row, and its weight (the fused permute with probs)
    routed, probs = gather_rows(received, weights.reshape(-1, 1), row_at)
    y = _project(self, routed.view(self.local_experts, -1, h), slice(None), probs.view(self.local_experts, -1, 1))
    replies = _all_to_all(self, rows_sum(y.reshape(-1, h), row_at, self.ep * unique))
    return rows_sum(replies, sent_at, tokens)


@torch.library.custom_op("echo::gather_rows", mutates_args=())
def gather_rows(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x[index], w[index]) in one kernel: the dispatch's read of the tokens and their routing
    weights, the permute of the received rows with their weights. Its backward is one kernel too
    (``scatter_rows``) and keeps only the index."""
    return x.index_select(0, index), w.index_select(0, index)


@gather_rows.register_fake
def _(x, w, index):
    return x.new_empty(index.shape[0], *x.shape[1:]), w.new_empty(index.shape[0], *w.shape[1:])


@torch.library.custom_op("echo::scatter_rows", mutates_args=())
def scatter_rows(gx: torch.Tensor, gw: torch.Tensor, index: torch.Tensor, nx: int,
                 nw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_rows' backward: the rows' gradients summed back by index into nx and nw rows."""
    dx = gx.new_zeros(nx, *gx.shape[1:]).index_add_(0, index, gx)
    return dx, gw.new_zeros(nw, *gw.shape[1:]).index_add_(0, index, gw)


@scatter_rows.register_fake
def _(gx, gw, index, nx, nw):
    return gx.new_empty(nx, *gx.shape[1:]), gw.new_empty(nw, *gw.shape[1:])


def _gather_setup(ctx, inputs, output):
    x, w, index = inputs
    ctx.save_for_backward(index)
    ctx.rows = (x.shape[0], w.shape[0])


def _gather_backward(ctx, gx, gw):
    (index,) = ctx.saved_tensors
    dx, dw = scatter_rows(gx.contiguous(), gw.contiguous(), index, *ctx.rows)
    return dx, dw, None


gather_rows.register_autograd(_gather_backward, setup_context=_gather_setup)


@torch.library.custom_op("echo::rows_sum", mutates_args=())
def rows_sum(x: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """out[index[i]] += x[i] into ``n`` rows, one kernel: the fused unpermute and the combine's
    reduction at the source. Its backward gathers the gradient by the same index and keeps only
    the index (torch's index_add would also keep x, which these kernels do not)."""
    return x.new_zeros(n, x.shape[-1]).index_add_(0, index, x)


@rows_sum.register_fake
def _(x, index, n):
    return x.new_empty(n, x.shape[-1])


def _rows_sum_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _rows_sum_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    return grad.index_select(0, index), None, None


rows_sum.register_autograd(_rows_sum_backward, setup_context=_rows_sum_setup)


def _sort_chunks(self, t: torch.Tensor, back: bool = False) -> torch.Tensor:
    """Megatron's alltoall dispatcher: the all-to-all delivers [source rank][local expert] chunks,
    which it sorts into [local expert][source rank] order for the grouped GEMM, and back before
    the combine (sort_chunks_by_idxs; a copy of the routed rows each way). The flex dispatcher
    (DeepEP, HybridEP) delivers them grouped by expert."""
    if self.ep == 1 or self.local_experts == 1 or getattr(self, "dispatcher", "alltoall") != "alltoall":
        return t
    a, b = (self.local_experts, self.ep) if back else (self.ep, self.local_experts)
    return t.view(a, b, -1, t.shape[-1]).transpose(0, 1).reshape(t.shape)


def _project(self, x: torch.Tensor, e: int | slice, probs: torch.Tensor) -> torch.Tensor:
    """Gate/up projection, activation and down projection of one expert (``e`` an index, x
    [rows, h]) or of all local experts at once (``e`` = slice(None), x [experts, rows, h], one
    batched GEMM per projection). ``probs`` ([..., rows, 1]): the rows' routing weights, applied
    in the activation as Megatron-Core's fused weighted activations do."""
    h, batched = x.shape[-1], x.dim() == 3
    # FP8 training runs the expert GEMMs in FP8 too (Transformer Engine's GroupedLinear)
    matmul = fp8.expert_matmul if fp8.active() is not None else torch.bmm if batched else torch.mm
    bias = lambda b: b[e].unsqueeze(-2) if batched else b[e]  # noqa: E731
    up, down = self.gate_up_proj[e], self.down_proj[e]
    # most architectures store [experts, 2f, h] (a linear's weight); GPT-OSS stores [experts, h, 2f]
    gate_up = matmul(x, up if up.shape[-2] == h else up.transpose(-1, -2))
    if getattr(self, "gate_up_proj_bias", None) is not None:
        gate_up = gate_up + bias(self.gate_up_proj_bias)
    act = _activation(self, gate_up, probs)
    recompute = getattr(self, "recompute_act", None)
    with recompute.saving() if recompute is not None else contextlib.nullcontext():
        y = matmul(act, down if down.shape[-2] == act.shape[-1] else down.transpose(-1, -2))
    if getattr(self, "down_proj_bias", None) is not None:
        y = y + bias(self.down_proj_bias)
    return y


def _activation(self, gate_up: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The experts' weighted gated activation: one fused kernel where Megatron-Core has one (SwiGLU,
    GPT-OSS's clamped gate), else transformers' ops. With ``moe_act`` recompute (``recompute_act``)
    its output is not kept for the down projection's backward, which recomputes it."""
    silu = type(getattr(self, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
    if _plain_swiglu(type(self)) and silu:
        run = lambda: fused.fused_weighted_glu(gate_up, probs, "swiglu")  # noqa: E731
    elif hasattr(self, "_apply_gate") and hasattr(self, "limit") and hasattr(self, "alpha"):  # GPT-OSS
        run = lambda: fused.fused_weighted_glu(gate_up, probs, "clamped", self.limit, self.alpha, 1.0)  # noqa: E731
    else:
        def run():
            gate, lin = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * lin * probs.to(gate_up.dtype)
    act = run()
    recompute = getattr(self, "recompute_act", None)
    return recompute.keep(act, run) if recompute is not None else act


@functools.cache
def _plain_swiglu(cls: type) -> bool:
    """Whether an experts class gates as act(gate) * up over the two halves (transformers'
    default _apply_gate, or none); GPT-OSS's clamped, interleaved gate is not."""
    gate = getattr(cls, "_apply_gate", None)
    return gate is None or "self.act_fn(gate) * up" in inspect.getsource(gate)


def _forward_imbalanced(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """As _forward, with each local expert receiving its share (``shares``) of all routed rows."""
    tokens, h = hidden_states.shape
    k = top_k_index.shape[-1]
    sent = tokens * k
    # rows of this rank's experts, from all ep ranks (each sends its tokens x k rows by the load)
    rows = [max(1, round(sent * self.ep * s)) for s in self.shares]
    received = sum(rows)
    routed = hidden_states.repeat_interleave(k, dim=0)
    if self.ep > 1:
        out_splits = [received // self.ep + (1 if i < received % self.ep else 0) for i in range(self.ep)]
        in_splits = [sent // self.ep + (1 if i < sent % self.ep else 0) for i in range(self.ep)]
        routed = funcol.all_to_all_single_autograd(routed, out_splits, in_splits, self.ep_group)
    else:
        routed = routed[:received] if received <= sent else torch.cat([routed] * -(-received // sent))[:received]
    probs = top_k_weights.reshape(-1, 1)
    if self.ep > 1:
        probs = funcol.all_to_all_single_autograd(probs, out_splits, in_splits, self.ep_group)
    else:
        probs = probs[:received] if received <= sent else torch.cat([probs] * -(-received // sent))[:received]
    y = torch.cat([_project(self, x, e, p) for e, (x, p) in enumerate(zip(routed.split(rows), probs.split(rows),
                                                                          strict=True))])
    if self.ep > 1:
        y = funcol.all_to_all_single_autograd(y, in_splits, out_splits, self.ep_group)
    return y.view(tokens, k, h).sum(dim=1)


def _all_to_all(self, t: torch.Tensor) -> torch.Tensor:
    if self.ep == 1:
        return t
    return funcol.all_to_all_single_autograd(t, None, None, self.ep_group)
