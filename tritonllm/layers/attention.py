from types import ModuleType

import torch
from torch import nn

from tritonllm.context import get_context
from tritonllm.layers.norm import RMSNorm
from tritonllm.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """One layer's attention over its paged KV cache, prologue included.

    forward(positions, qkv): per-head q/k RMSNorm, rotary and the new K/V stored in the cache (one
    fused launch), then prefill or decode attention as the step's forward context says.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, rotary: RotaryEmbedding,
                 ops: ModuleType):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_norm = RMSNorm(head_dim, eps, ops)
        self.k_norm = RMSNorm(head_dim, eps, ops)
        self.rotary = rotary
        self.ops = ops
        # [num_blocks, block_size, num_kv_heads, head_dim], given by the model runner.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D] -> o [T, Hq, D]."""
        context = get_context()
        q = self.ops.qk_norm_rotary_store(positions, qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                          self.rotary.cos_sin_cache, self.k_cache, self.v_cache, context.slot_mapping,
                                          self.num_heads, self.num_kv_heads)
        if context.is_prefill:
            return self.ops.prefill_attention(q, self.k_cache, self.v_cache, context.cu_seqlens_q, context.seq_lens,
                                              context.block_tables, self.scale, max_q_len=context.max_q_len)
        return self.ops.decode_attention(q, self.k_cache, self.v_cache, context.seq_lens, context.block_tables,
                                         self.scale, max_seq_len=context.max_seq_len)


def allocate_kv_caches(model: nn.Module, num_blocks: int, block_size: int, dtype, device, fill: float | None = None):
    """Give every attention layer of model its [num_blocks, block_size, Hkv, D] caches (uninitialized,
    or filled with `fill`)."""
    for module in model.modules():
        if isinstance(module, Attention):
            shape = (num_blocks, block_size, module.num_kv_heads, module.head_dim)
            for name in ("k_cache", "v_cache"):
                cache = torch.empty(shape, dtype=dtype, device=device)
                setattr(module, name, cache if fill is None else cache.fill_(fill))
