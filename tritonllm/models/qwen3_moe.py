"""Tensor-parallel Qwen3-MoE: dense Qwen3's attention, with sparse MLPs (kernels' moe_route and
fused_moe) in the layers the config marks sparse and the dense MLP in the others."""
import re
from types import ModuleType

from torch import nn

from tritonllm.layers.moe import SparseMoeBlock
from tritonllm.models.qwen3 import Qwen3ForCausalLM

# model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight, one tensor per expert in the checkpoint
EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def is_sparse_layer(config, layer: int) -> bool:
    """As HF transformers decides: off the mlp_only_layers list and on the decoder_sparse_step pattern."""
    return (layer not in (config.mlp_only_layers or []) and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, config, layer: int, ops: ModuleType) -> nn.Module:
        return SparseMoeBlock(config, ops) if is_sparse_layer(config, layer) else super().make_mlp(config, layer, ops)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        expert = EXPERT_WEIGHT.search(name)
        if expert is None:
            return super().checkpoint_target(name)
        stacked = "w2" if expert[2] == "down" else "w13"
        return f"{name[:expert.start()]}.experts.{stacked}", (int(expert[1]), expert[2])

    def checkpoint_name(self, target: str, shard) -> str:
        if not isinstance(shard, tuple):
            return super().checkpoint_name(target, shard)
        return f"{target[:target.rindex('.experts.')]}.experts.{shard[0]}.{shard[1]}_proj.weight"
