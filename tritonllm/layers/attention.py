from types import ModuleType

import torch
from torch import nn

from tritonllm.context import get_context
from tritonllm.kernels.fp8 import empty_kv_scales
from tritonllm.kernels.kv_cache import empty_kv_cache
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
        # [num_blocks, block_size, num_kv_heads, head_dim], given by the model runner; with an fp8
        # cache also the scales of its rows, [num_blocks, block_size, num_kv_heads] float32.
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale = self.v_scale = None

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D] -> o [T, Hq, D]."""
        context = get_context()
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
        copies = {}
        if context.is_prefill and context.gather_tables is not None:
            # An fp8 cache: prefill runs the kernel of a plain cache (on Hopper the warp-specialized
            # one) on copies of the step's blocks in q's dtype. The store writes the new tokens' rows
            # there as it quantizes them; only blocks with cached tokens are copied out of the cache.
            copy_shape = (context.num_copies, *self.k_cache.shape[1:])
            copies = {"k_copy": qkv.new_empty(copy_shape), "v_copy": qkv.new_empty(copy_shape),
                      "copy_slots": context.copy_slots}
        q = self.ops.qk_norm_rotary_store(positions, qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                          self.rotary.cos_sin_cache, self.k_cache, self.v_cache, context.slot_mapping,
                                          self.num_heads, self.num_kv_heads, **scales, **copies)
        if copies:
            k, v = self.ops.gather_kv_blocks(self.k_cache, self.v_cache, context.gather_blocks, q.dtype, **scales,
                                             out=(copies["k_copy"], copies["v_copy"]))
            return self.ops.prefill_attention(q, k, v, context.cu_seqlens_q, context.seq_lens, context.gather_tables,
                                              self.scale, max_q_len=context.max_q_len)
        if context.is_prefill:
            return self.ops.prefill_attention(q, self.k_cache, self.v_cache, context.cu_seqlens_q, context.seq_lens,
                                              context.block_tables, self.scale, max_q_len=context.max_q_len, **scales)
        return self.ops.decode_attention(q, self.k_cache, self.v_cache, context.seq_lens, context.block_tables,
                                         self.scale, max_seq_len=context.max_seq_len, **scales)


def kv_bytes_per_token(model: nn.Module, dtype: torch.dtype) -> int:
    """Cache bytes one token takes over every attention layer of model, scales included."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    scale_bytes = 4 if dtype == torch.float8_e4m3fn else 0
    return sum(2 * m.num_kv_heads * (m.head_dim * dtype.itemsize + scale_bytes) for m in layers)


def allocate_kv_caches(model: nn.Module, num_blocks: int, block_size: int, dtype, device, fill: float | None = None):
    """Give every attention layer of model its [num_blocks, block_size, Hkv, D] caches of `dtype`
    and, for float8_e4m3fn, their [num_blocks, block_size, Hkv] float32 scales (uninitialized, or
    filled with `fill`). An fp8 V cache is key-major (kernels/kv_cache.py): its e4m3 tiles then
    reach the PV dot without a byte-wise transpose. The scales are head-major (kernels/fp8.py), so
    an attention tile reads one head's scales of a block as one run."""
    fp8 = dtype == torch.float8_e4m3fn

    def filled(t):
        return t if fill is None else t.fill_(fill)

    for module in model.modules():
        if isinstance(module, Attention):
            shape = (num_blocks, block_size, module.num_kv_heads, module.head_dim)
            module.k_cache = filled(empty_kv_cache(*shape, dtype, device))
            module.v_cache = filled(empty_kv_cache(*shape, dtype, device, key_major=fp8))
            if fp8:
                module.k_scale = filled(empty_kv_scales(*shape[:3], device, head_major=True))
                module.v_scale = filled(empty_kv_scales(*shape[:3], device, head_major=True))
            else:
                module.k_scale = module.v_scale = None
