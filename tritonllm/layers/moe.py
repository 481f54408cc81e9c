"""The sparse MLP of Qwen3-MoE: a replicated router and the experts, each expert's width split over
the ranks (its gate/up rows and its down columns), one all-reduce after the down projection.

The experts are stacked per layer, w13 [E, 2N/tp, H] (this rank's gate rows, then its up rows)
and w2 [E, H, N/tp], and filled one checkpoint tensor at a time as the loader streams them.
"""
from types import ModuleType

import torch
from torch import nn

from tritonllm.context import get_context
from tritonllm.distributed import all_reduce, tp_rank, tp_size
from tritonllm.layers.linear import ReplicatedLinear, check_shape, copy_weight, narrow


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, width: int, top_k: int, renormalize: bool,
                 ops: ModuleType):
        super().__init__()
        if width % tp_size():
            raise ValueError(f"moe_intermediate_size={width} is not divisible by tensor_parallel_size {tp_size()}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.renormalize, self.ops = top_k, renormalize, ops
        self.width = width // tp_size()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.width, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.width), requires_grad=False)
        self.w13.shard_ids = tuple((e, proj) for e in range(num_experts) for proj in ("gate", "up"))
        self.w2.shard_ids = tuple((e, "down") for e in range(num_experts))
        for param in (self.w13, self.w2):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: tuple[int, str]):
        """One expert's gate_proj / up_proj [N, H] or down_proj [H, N]: this rank's slice of N."""
        expert, proj = shard_id
        start, n = tp_rank() * self.width, self.width
        hidden = param.shape[1] if proj == "down" else param.shape[2]
        check_shape(loaded, (hidden, n * tp_size()) if proj == "down" else (n * tp_size(), hidden))
        if proj == "down":
            copy_weight(param[expert], narrow(loaded, 1, start, n))
        else:
            copy_weight(param[expert].narrow(0, 0 if proj == "gate" else n, n), narrow(loaded, 0, start, n))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum [T, H] of the routed experts' outputs for x [T, H]."""
        weights, ids = self.ops.moe_route(router_logits, self.top_k, self.renormalize)
        return self.ops.fused_moe(x, self.w13, self.w2, weights, ids, real_tokens=get_context().real_tokens)


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's MLP: softmax over all experts (float32), the top num_experts_per_tok, renormalized
    when the config's norm_topk_prob says so; no shared expert."""

    def __init__(self, config, ops: ModuleType):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, ops=ops)
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                config.num_experts_per_tok, config.norm_topk_prob, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.experts(x, self.gate(x)))
