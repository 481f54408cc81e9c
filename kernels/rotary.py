"""Neox-style rotary position embedding (rotate_half), as in HF Qwen3, applied in place."""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.checks import FLOATS, INDICES, check_dtype, check_rows, check_writable
from tritonllm.kernels.tuning import Tunable, dtype_name, pow2


@triton.jit
def _rotate_heads(x_ptr, head_stride, cos, sin,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first = x_ptr + heads * head_stride + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, x1 * cos - x2 * sin, mask=mask)
    tl.store(first + HALF, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr, q_ptr, k_ptr, cos_sin_ptr,
    q_token_stride, q_head_stride, k_token_stride, k_head_stride, cos_sin_stride,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + position * cos_sin_stride + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + position * cos_sin_stride + HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr + token * q_token_stride, q_head_stride, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr + token * k_token_stride, k_head_stride, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def _space(dtype, row_bucket, tokens_bucket):
    return [{"num_warps": warps, "num_stages": 1} for warps in (1, 2, 4, 8, 16) if warps * 32 * 4 <= max(128, row_bucket)]


def _default(dtype, row_bucket, tokens_bucket):
    return {"num_warps": min(8, max(1, row_bucket // 1024)), "num_stages": 1}


_TUNING = Tunable("rotary_embedding", _space, _default)


def rotary_embedding_bucket(dtype: torch.dtype, num_q_heads: int, num_k_heads: int, head_dim: int,
                            n_tokens: int) -> tuple:
    """The tuning bucket of rotary_embedding on q [n_tokens, num_q_heads, head_dim] and k [n_tokens,
    num_k_heads, head_dim] of `dtype`: the padded elements a token's program rotates, and the tokens."""
    padded = (pow2(num_q_heads) + pow2(num_k_heads)) * 2 * pow2(head_dim // 2)
    return dtype_name(dtype), pow2(padded), pow2(n_tokens)


def rotary_embedding(positions, q, k, cos_sin_cache):
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by their token's position; returns (q, k).

    positions [T] int32/int64; cos_sin_cache [max_pos, D] float32 with cos in [:, :D/2] and sin in
    [:, D/2:]. q and k may be strided views (of a packed qkv tensor) with a contiguous last dim;
    the math is float32 with one rounding to q's dtype.
    """
    for name, t, dims in (("q", q, 3), ("k", k, 3), ("cos_sin_cache", cos_sin_cache, 2)):
        if t.dim() != dims:
            raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    n_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even (cos and sin take half of it each), got {head_dim}")
    if k.shape[0] != n_tokens or k.shape[2] != head_dim or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"q [T, Hq, D] and k [T, Hkv, D] need one T and D and contiguous rows, got {tuple(q.shape)}, {tuple(k.shape)}")
    if cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}] with contiguous rows, got {tuple(cos_sin_cache.shape)}")
    check_dtype("q", q, FLOATS)
    check_dtype("k", k, FLOATS)
    check_writable("q", q)
    check_writable("k", k)
    check_dtype("cos_sin_cache", cos_sin_cache, (torch.float32,))
    check_rows(n_tokens, INDICES, positions=positions)
    if n_tokens == 0 or head_dim == 0:
        return q, k
    half = head_dim // 2
    block_qh, block_kh = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(k.shape[1])
    block_half = triton.next_power_of_2(half)

    def launch(config):
        _rotary_embedding_kernel[(n_tokens,)](
            positions, q, k, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1], HALF=half,
            BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_HALF=block_half, **config,
        )

    bucket = rotary_embedding_bucket(q.dtype, num_q_heads, k.shape[1], head_dim, n_tokens)
    launch(_TUNING.config(bucket, launch, restore=(q, k)))
    return q, k
