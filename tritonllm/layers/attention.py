import torch
from torch import nn

from tritonllm.context import get_context
from tritonllm.layers.ops import ops


class Attention(nn.Module):
    """Attention of one layer over its paged KV cache (the new K/V are stored by the q/k prologue)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # [num_blocks, block_size, num_kv_heads, head_dim], given by the model runner.
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        context = get_context()
        if context.is_prefill:
            return ops().prefill_attention(q, self.k_cache, self.v_cache, context.cu_seqlens_q, context.seq_lens,
                                           context.block_tables, self.scale, max_q_len=context.max_q_len)
        return ops().decode_attention(q, self.k_cache, self.v_cache, context.seq_lens, context.block_tables, self.scale)


def allocate_kv_caches(model: nn.Module, num_blocks: int, block_size: int, dtype, device, fill: float | None = None):
    """Give every attention layer of model its [num_blocks, block_size, Hkv, D] caches (uninitialized,
    or filled with `fill`)."""
    for module in model.modules():
        if isinstance(module, Attention):
            shape = (num_blocks, block_size, module.num_kv_heads, module.head_dim)
            for name in ("k_cache", "v_cache"):
                cache = torch.empty(shape, dtype=dtype, device=device)
                setattr(module, name, cache if fill is None else cache.fill_(fill))
