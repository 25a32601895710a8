"""Mixture-of-experts MLP with expert parallelism (Switch/GShard style, as Megatron-Core runs it).

A router picks ``top_k`` of ``experts`` for every token; tokens travel to the ranks holding their
experts with an all-to-all over the expert-parallel group (dispatch), run through the local
experts as one grouped GEMM per projection, and come back with a second all-to-all (combine).

Routing is balanced by assumption: every expert receives tokens x top_k / experts tokens, the
capacity a load-balancing loss steers towards. Tensor shapes are therefore static, as a fake
trace needs; real imbalance is a later refinement. Experts are not tensor-parallel (Megatron's
expert tensor parallel size 1); with tp > 1 the tokens are the rank's sequence-parallel shard.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from echo.config.workload import ModelConfig


class MoE(nn.Module):
    COLWISE, ROWWISE = (), ()  # experts are not tensor-parallel: the TP plan leaves them alone

    def __init__(self, cfg: ModelConfig, ep: int):
        super().__init__()
        self.top_k, self.ep = cfg.top_k, ep
        self.local_experts = cfg.experts // ep
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        e, h, f = self.local_experts, cfg.hidden, cfg.ffn
        self.w1 = nn.Parameter(torch.empty(e, h, f))
        self.w3 = nn.Parameter(torch.empty(e, h, f))
        self.w2 = nn.Parameter(torch.empty(e, f, h))
        self.ep_group = None  # set by the tracer when ep > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = x.to_local() if isinstance(x, DTensor) else x  # the rank's own tokens
        b, s, h = local.shape
        tokens = local.reshape(b * s, h)
        weights, _ = torch.topk(F.softmax(self.router(tokens).float(), dim=-1), self.top_k, dim=-1)
        # one copy of each token per chosen expert, grouped by destination (balanced routing)
        routed = tokens.repeat_interleave(self.top_k, dim=0)
        routed = self._all_to_all(routed)
        per_expert = routed.view(self.local_experts, -1, h)
        y = torch.bmm(F.silu(torch.bmm(per_expert, self.w1)) * torch.bmm(per_expert, self.w3), self.w2)
        y = self._all_to_all(y.reshape(-1, h))
        combined = (y.view(b * s, self.top_k, h) * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)
        return combined.view(b, s, h)

    def _all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        if self.ep == 1:
            return t
        return funcol.all_to_all_single_autograd(t, None, None, self.ep_group)
