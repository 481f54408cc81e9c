"""Store new K/V rows into the paged KV cache."""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.tuning import Tunable, dtype_name, pow2


@triton.jit
def _store_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_token_stride, k_head_stride, v_token_stride, v_head_stride,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # slot < 0 marks a row that must not be stored (padding).
    mask = (slot >= 0) & (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    cache_offsets = slot * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(k_ptr + token * k_token_stride + heads[:, None] * k_head_stride + dims[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + token * v_token_stride + heads[:, None] * v_head_stride + dims[None, :], mask=mask, other=0.0)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _space(dtype, row_bucket, tokens_bucket):
    return [{"num_warps": warps, "num_stages": 1} for warps in (1, 2, 4, 8) if warps * 32 * 4 <= max(128, row_bucket)]


def _default(dtype, row_bucket, tokens_bucket):
    return {"num_warps": min(8, max(1, row_bucket // 512)), "num_stages": 1}


_TUNING = Tunable("store_kv_cache", _space, _default)


def store_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k[t], v[t] into slot slot_mapping[t] of k_cache, v_cache; a slot < 0 skips row t.

    k, v [T, Hkv, D] (last dim contiguous, token and head strides free); k_cache, v_cache
    [num_blocks, block_size, Hkv, D] contiguous, slot = block * block_size + offset; slot_mapping
    [T] int32 or int64. Modifies the caches in place; values are cast to the cache dtype.
    """
    n_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"k and v must both be [T, Hkv, D] with contiguous rows, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape[2:] != (num_heads, head_dim) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"caches must be contiguous [num_blocks, block_size, {num_heads}, {head_dim}], got {tuple(k_cache.shape)}")
    if slot_mapping.shape != (n_tokens,):
        raise ValueError(f"slot_mapping must have shape ({n_tokens},), got {tuple(slot_mapping.shape)}")
    if n_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)

    def launch(config):
        _store_kv_cache_kernel[(n_tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, **config,
        )

    launch(_TUNING.config((dtype_name(k.dtype), block_h * block_d, pow2(n_tokens)), launch))
