"""Tensor-parallel Qwen3 (dense), built from layers that call a kernel backend (`ops`: the Triton
kernels or their references, given at construction)."""
from types import ModuleType

import torch
from torch import nn

from tritonllm.layers.activation import SiluAndMul
from tritonllm.layers.attention import Attention
from tritonllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from tritonllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tritonllm.layers.norm import RMSNorm
from tritonllm.layers.rotary import RotaryEmbedding


def head_dim_of(config) -> int:
    """The config's head_dim, or hidden_size / num_attention_heads where it has none (as HF takes it)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen3Attention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, ops: ModuleType):
        super().__init__()
        head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False)  # HF's Qwen3 gives q, k, v and o the same bias flag
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, ops=ops)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias, ops=ops)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, config.rms_norm_eps,
                              rotary, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(positions, self.qkv_proj(hidden)).flatten(1))


class Qwen3MLP(nn.Module):
    def __init__(self, config, ops: ModuleType):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, ops=ops)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, ops=ops)
        self.act = SiluAndMul(ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, ops: ModuleType, mlp: nn.Module):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary, ops)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    def __init__(self, config, ops: ModuleType, make_mlp):
        super().__init__()
        rotary = RotaryEmbedding(config, head_dim_of(config))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rotary, ops, make_mlp(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(token_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (parameter name, shard id): the packed projections, and the q/k norms that
    # the attention layer owns with the rest of its prologue
    packed_modules_mapping = {
        "q_norm": ("attn.q_norm", None),
        "k_norm": ("attn.k_norm", None),
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, ops: ModuleType):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config, ops, lambda layer: self.make_mlp(config, layer, ops))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_mlp(self, config, layer: int, ops: ModuleType) -> nn.Module:
        """The MLP of decoder layer `layer` (dense in every layer of Qwen3)."""
        return Qwen3MLP(config, ops)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """The parameter a checkpoint tensor loads into, and the shard id its weight loader takes."""
        for checkpoint_name, (param_name, shard) in self.packed_modules_mapping.items():
            if f".{checkpoint_name}." in name:
                return name.replace(checkpoint_name, param_name), shard
        return name, None

    def checkpoint_name(self, target: str, shard) -> str:
        """The checkpoint tensor that checkpoint_target maps to (target, shard): what a checkpoint lacks."""
        for checkpoint_name, (param_name, param_shard) in self.packed_modules_mapping.items():
            if f".{param_name}." in target and param_shard == shard:
                return target.replace(param_name, checkpoint_name)
        return target

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens (the forward context says where they sit)."""
        return self.model(token_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, V] in the model's dtype on rank 0 (None elsewhere) for the N rows given, e.g. the
        last of each sequence. Not widened to float32: the sampler reads any float dtype and
        computes in float32, and the widened copy would cost a pass over the logits every step."""
        return self.lm_head(hidden)
