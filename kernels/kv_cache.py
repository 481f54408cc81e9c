"""Store new K/V rows into the paged KV cache, copy blocks out of it, and the cache layouts the kernels take.

A cache is [num_blocks, block_size, Hkv, D]; slot = block * block_size + offset. In memory it is
either contiguous (a cache row of Hkv * D values per slot) or, for V, key-major: each block laid
out as [Hkv, D, block_size], so a head's values run over the block's keys. Indexing means the same
in both. The PV dot reduces over keys: from a key-major V an e4m3 tile reaches the tensor cores
without a byte-wise transpose (sm_90 has no 8-bit ldmatrix.trans; bench/NOTES-decode-attention.md).
"""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.checks import FLOATS, INDICES, check_block_size, check_dtype, check_rows
from tritonllm.kernels.fp8 import (block_scale_offsets, check_kv_scales, e4m3_scale, from_e4m3, scale_offsets,
                                  scale_strides, to_e4m3)
from tritonllm.kernels.tuning import INTERPRET, Tunable, dtype_name, pow2


def empty_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device=None, *, key_major: bool = False) -> torch.Tensor:
    """An uninitialized cache [num_blocks, block_size, Hkv, D]: contiguous, or key-major (memory
    [num_blocks, Hkv, D, block_size], the same shape through permuted strides)."""
    if not key_major:
        return torch.empty(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return torch.empty(num_blocks, num_kv_heads, head_dim, block_size, dtype=dtype, device=device).permute(0, 3, 1, 2)


def is_key_major(cache: torch.Tensor) -> bool:
    """Whether a [num_blocks, block_size, Hkv, D] cache has empty_kv_cache's key-major strides."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    return cache.stride() == (num_kv_heads * head_dim * block_size, 1, head_dim * block_size, block_size)


def check_cache_layouts(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Check that v_cache has k_cache's shape and dtype and either its strides or, beside a contiguous k_cache,
    the key-major ones; returns whether v_cache is key-major. Raises ValueError naming v_cache."""
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)} and dtype {k_cache.dtype}, "
                         f"got {tuple(v_cache.shape)} {v_cache.dtype}")
    if v_cache.stride() == k_cache.stride():
        return False
    if is_key_major(v_cache) and k_cache.is_contiguous():
        return True
    raise ValueError(f"v_cache must have the strides of k_cache {k_cache.stride()}, or be key-major "
                     f"(kernels/kv_cache.empty_kv_cache) beside a contiguous k_cache; got {v_cache.stride()}")


def key_major_copy(cache: torch.Tensor) -> torch.Tensor:
    """A copy of a [num_blocks, block_size, Hkv, D] cache in the key-major layout (same values)."""
    return empty_kv_cache(*cache.shape, cache.dtype, cache.device, key_major=True).copy_(cache)


def check_store_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, head_dim: int) -> bool:
    """The cache checks of the kernels that store rows: k_cache a contiguous [num_blocks, block_size,
    num_heads, head_dim], v_cache as check_cache_layouts takes it; returns whether v_cache is key-major."""
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_heads, head_dim) or not k_cache.is_contiguous():
        raise ValueError(f"k_cache must be a contiguous [num_blocks, block_size, {num_heads}, {head_dim}], "
                         f"got {tuple(k_cache.shape)} strides {k_cache.stride()}")
    check_dtype("k_cache", k_cache, FLOATS + (torch.float8_e4m3fn,))  # v_cache: check_cache_layouts makes it k's
    return check_cache_layouts(k_cache, v_cache)


@triton.jit
def slot_offsets(slots, cols, ROW: tl.constexpr, BLOCK_SIZE: tl.constexpr, KEY_MAJOR: tl.constexpr):
    """int64 element offsets of column `cols` (head * D + d, < ROW = Hkv * D) of cache slots `slots`
    (int64, broadcast against cols) in a contiguous or (KEY_MAJOR, blocks of BLOCK_SIZE) key-major cache."""
    if KEY_MAJOR:
        return (slots // BLOCK_SIZE) * (ROW * BLOCK_SIZE) + cols * BLOCK_SIZE + slots % BLOCK_SIZE
    return slots * ROW + cols


@triton.jit
def _store_e4m3_rows(x, cache_ptrs, store_mask, scale_ptrs, scale_mask, INTERPRET: tl.constexpr):
    """Rows x [TOKENS, BLOCK_H, BLOCK_D] (float32) quantized per (token, head) into the cache, scales beside."""
    scale = e4m3_scale(tl.max(tl.abs(x), axis=2))
    tl.store(cache_ptrs, to_e4m3(x, scale[:, :, None], INTERPRET), mask=store_mask)
    tl.store(scale_ptrs, scale, mask=scale_mask)


@triton.jit(do_not_specialize=["n_tokens"])
def _store_kv_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, n_tokens,
    k_token_stride, k_head_stride, v_token_stride, v_head_stride, stride_scale_block, stride_scale_token,
    stride_scale_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_ROW: tl.constexpr, TOKENS: tl.constexpr,
    FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
    V_BLOCK_SIZE: tl.constexpr, V_KEY_MAJOR: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):
    # Each program copies TOKENS rows of Hkv * D elements; a cache row is contiguous.
    tokens = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    slots = tl.load(slot_ptr + tokens, mask=tokens < n_tokens, other=-1).to(tl.int64)
    if FP8:
        # [TOKENS, BLOCK_H, BLOCK_D] tiles: each (token, head) row gets its own scale. slot < 0
        # skips the row's values and scale.
        heads = tl.arange(0, BLOCK_H)
        heads3, dims3 = heads[None, :, None], tl.arange(0, BLOCK_D)[None, None, :]
        in_row = (heads3 < NUM_HEADS) & (dims3 < HEAD_DIM)
        load_mask = (tokens < n_tokens)[:, None, None] & in_row
        store_mask = (slots >= 0)[:, None, None] & in_row
        cols3 = heads3 * HEAD_DIM + dims3
        k_offsets = slot_offsets(slots[:, None, None], cols3, NUM_HEADS * HEAD_DIM, 1, False)
        v_offsets = slot_offsets(slots[:, None, None], cols3, NUM_HEADS * HEAD_DIM, V_BLOCK_SIZE, V_KEY_MAJOR)
        scale_offs = scale_offsets(slots[:, None], heads[None, :], stride_scale_block, stride_scale_token,
                                   stride_scale_head, SCALE_BLOCK)
        scale_mask = (slots >= 0)[:, None] & (heads < NUM_HEADS)[None, :]
        # Both loads before the first store, which the compiler cannot move them past (they might alias).
        rows = tokens[:, None, None]
        k = tl.load(k_ptr + rows * k_token_stride + heads3 * k_head_stride + dims3, mask=load_mask, other=0.0)
        v = tl.load(v_ptr + rows * v_token_stride + heads3 * v_head_stride + dims3, mask=load_mask, other=0.0)
        _store_e4m3_rows(k.to(tl.float32), k_cache_ptr + k_offsets, store_mask, k_scale_ptr + scale_offs, scale_mask,
                         INTERPRET)
        _store_e4m3_rows(v.to(tl.float32), v_cache_ptr + v_offsets, store_mask, v_scale_ptr + scale_offs, scale_mask,
                         INTERPRET)
        return
    cols = tl.arange(0, BLOCK_ROW)
    heads, dims = cols // HEAD_DIM, cols % HEAD_DIM
    in_row = (cols < NUM_HEADS * HEAD_DIM)[None, :]
    # The loads do not wait for the slots: only the stores need them.
    load_mask = (tokens < n_tokens)[:, None] & in_row
    k = tl.load(k_ptr + tokens[:, None] * k_token_stride + (heads * k_head_stride + dims)[None, :], mask=load_mask, other=0.0)
    v = tl.load(v_ptr + tokens[:, None] * v_token_stride + (heads * v_head_stride + dims)[None, :], mask=load_mask, other=0.0)
    # slot < 0 marks a row that must not be stored (padding).
    store_mask = (slots >= 0)[:, None] & in_row
    k_offsets = slot_offsets(slots[:, None], cols[None, :], NUM_HEADS * HEAD_DIM, 1, False)
    v_offsets = slot_offsets(slots[:, None], cols[None, :], NUM_HEADS * HEAD_DIM, V_BLOCK_SIZE, V_KEY_MAJOR)
    tl.store(k_cache_ptr + k_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=store_mask)
    tl.store(v_cache_ptr + v_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=store_mask)


def _space(dtype, block_row, tokens_bucket):
    return [
        {"TOKENS": tokens, "num_warps": warps, "num_stages": 1}
        for tokens in (1, 2, 4, 8)
        for warps in (1, 2, 4, 8)
        if tokens <= tokens_bucket and warps * 32 * 4 <= tokens * block_row
    ]


def _default(dtype, block_row, tokens_bucket):
    tokens = min(4, tokens_bucket)
    return {"TOKENS": tokens, "num_warps": min(8, max(1, tokens * block_row // 1024)), "num_stages": 1}


_TUNING = Tunable("store_kv_cache", _space, _default)


def store_kv_cache_bucket(dtype: torch.dtype, num_heads: int, head_dim: int, n_tokens: int) -> tuple:
    """The tuning bucket of store_kv_cache on k, v [n_tokens, num_heads, head_dim] of `dtype`."""
    return dtype_name(dtype), pow2(num_heads * head_dim), pow2(n_tokens)


def store_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    """Write k[t], v[t] into slot slot_mapping[t] of k_cache, v_cache; a slot < 0 skips row t.

    k, v [T, Hkv, D] float32/float16/bfloat16 (last dim contiguous, token and head strides free);
    k_cache, v_cache [num_blocks, block_size, Hkv, D], slot = block * block_size + offset; k_cache
    contiguous, v_cache contiguous or key-major (empty_kv_cache); slot_mapping [T] int32 or int64.
    Modifies the caches in place; values are cast to the cache dtype. A torch.float8_e4m3fn cache
    needs k_scale, v_scale [num_blocks, block_size, Hkv] float32, contiguous or head-major
    (kernels/fp8.empty_kv_scales): each (token, head) row is stored as e4m3(row / scale), scale =
    max|row| / 448 (1.0 for a zero row), and its scale is written at [slot, head] (kernels/fp8.py).
    """
    if k.dim() != 3:
        raise ValueError(f"k must be [T, Hkv, D], got shape {tuple(k.shape)}")
    n_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"k and v must both be [T, Hkv, D] with contiguous rows, got {tuple(k.shape)} and {tuple(v.shape)}")
    check_dtype("k", k, FLOATS)
    check_dtype("v", v, FLOATS)
    v_key_major = check_store_caches(k_cache, v_cache, num_heads, head_dim)
    check_rows(n_tokens, INDICES, slot_mapping=slot_mapping)
    fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if n_tokens == 0:
        return
    block_row = triton.next_power_of_2(num_heads * head_dim)
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)

    def launch(config):
        _store_kv_cache_kernel[(triton.cdiv(n_tokens, config["TOKENS"]),)](
            k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, n_tokens,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), *scale_strides(k_scale),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_ROW=block_row, FP8=fp8, BLOCK_H=block_h, BLOCK_D=block_d,
            # V_BLOCK_SIZE only shapes key-major addresses: 1 otherwise, so block sizes share a compile.
            INTERPRET=INTERPRET, V_BLOCK_SIZE=k_cache.shape[1] if v_key_major else 1, V_KEY_MAJOR=v_key_major,
            SCALE_BLOCK=k_cache.shape[1] if fp8 else 1, **config,
        )

    launch(_TUNING.config(store_kv_cache_bucket(k.dtype, num_heads, head_dim, n_tokens), launch))


def check_block_copies(name: str, copies: torch.Tensor, block_shape: torch.Size, dtype: torch.dtype,
                       min_blocks: int = 0) -> None:
    """Check a buffer of cache-block copies: contiguous [G >= min_blocks, *block_shape] of dtype (the
    plain layout gather_kv_blocks writes); ValueError naming it otherwise."""
    if (copies.dim() != 4 or copies.shape[0] < min_blocks or copies.shape[1:] != block_shape or copies.dtype != dtype
            or not copies.is_contiguous()):
        count = f"G >= {min_blocks}" if min_blocks else "G"
        raise ValueError(f"{name} must be a contiguous [{count}, {', '.join(map(str, block_shape))}] {dtype}, "
                         f"got {tuple(copies.shape)} {copies.dtype}")


def check_store_copies(k_copy, v_copy, copy_slots, block_shape, dtype, n_tokens) -> bool:
    """Check a store's optional copies of the rows it stores (qk_norm_rotary_store); True when given."""
    given = [x is not None for x in (k_copy, v_copy, copy_slots)]
    if not any(given):
        return False
    if not all(given):
        raise ValueError("k_copy, v_copy and copy_slots go together: pass all three or none")
    check_block_copies("k_copy", k_copy, block_shape, dtype)
    check_block_copies("v_copy", v_copy, block_shape, dtype)
    if v_copy.shape != k_copy.shape:
        raise ValueError(f"v_copy must have k_copy's shape {tuple(k_copy.shape)}, got {tuple(v_copy.shape)}")
    check_rows(n_tokens, INDICES, copy_slots=copy_slots)
    return True


@triton.jit
def _copy_block_rows(cache_ptr, scale_ptr, out_ptr, block, i, head, offs_t, stride_scale_block, stride_scale_token,
                     stride_scale_head, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_D: tl.constexpr, FP8: tl.constexpr, KEY_MAJOR: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows offs_t of one head of cache block `block` (int64) into copy i (int64) of out, in out's dtype."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < HEAD_DIM)[None, :]
    cols = (head * HEAD_DIM + offs_d)[None, :]
    slots = block * BLOCK_SIZE + offs_t
    src = slot_offsets(slots[:, None], cols, NUM_HEADS * HEAD_DIM, BLOCK_SIZE, KEY_MAJOR)
    x = tl.load(cache_ptr + src, mask=mask, other=0.0)
    if FP8:
        scales = tl.load(scale_ptr + block_scale_offsets(block, offs_t, stride_scale_block, stride_scale_token)
                         + head * stride_scale_head)
        x = from_e4m3(x, tl.float32, INTERPRET) * scales[:, None]
    dst = (i * BLOCK_SIZE + offs_t)[:, None] * (NUM_HEADS * HEAD_DIM) + cols
    tl.store(out_ptr + dst, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_kv_blocks_kernel(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, blocks_ptr, k_out_ptr, v_out_ptr,
                             stride_scale_block, stride_scale_token, stride_scale_head, NUM_HEADS: tl.constexpr,
                             HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr,
                             BLOCK_D: tl.constexpr, FP8: tl.constexpr, V_KEY_MAJOR: tl.constexpr,
                             INTERPRET: tl.constexpr):
    # Program (i, head, 2 chunk + kv): TOKENS slots of one head of block blocks[i] into copy i, of K
    # (kv 0) or V (kv 1): one launch for both.
    i = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    block = tl.load(blocks_ptr + i).to(tl.int64)
    offs_t = (tl.program_id(2) // 2) * TOKENS + tl.arange(0, TOKENS)  # TOKENS divides BLOCK_SIZE
    if tl.program_id(2) % 2 == 0:
        _copy_block_rows(k_cache_ptr, k_scale_ptr, k_out_ptr, block, i, head, offs_t, stride_scale_block,
                         stride_scale_token, stride_scale_head, NUM_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_D, FP8, False,
                         INTERPRET)
    else:
        _copy_block_rows(v_cache_ptr, v_scale_ptr, v_out_ptr, block, i, head, offs_t, stride_scale_block,
                         stride_scale_token, stride_scale_head, NUM_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_D, FP8,
                         V_KEY_MAJOR, INTERPRET)


def gather_kv_blocks(k_cache, v_cache, blocks, dtype, *, k_scale=None, v_scale=None, out=None):
    """Copies of cache blocks, in `dtype`: returns (k, v), each [N, block_size, Hkv, D] contiguous, new
    tensors, or `out` when given.

    k_cache, v_cache [num_blocks, block_size, Hkv, D] as store_kv_cache takes them (k_cache contiguous,
    v_cache contiguous or key-major), float32/float16/bfloat16, or float8_e4m3fn with k_scale, v_scale
    [num_blocks, block_size, Hkv] float32 (contiguous or head-major). blocks [N] int32/int64 block
    ids; dtype float32, float16 or bfloat16. Copy i holds block blocks[i]: each value, for an e4m3
    cache times its row's scale in float32, rounded to dtype. A copy is in the plain layout whatever
    the cache's. The caches are only read. Prefill over an e4m3 cache runs on such copies (layers/attention.py).

    out: optional (k, v), each [M, block_size, Hkv, D] contiguous of `dtype` with M >= N; in place,
    out[0][i], out[1][i] for i < N are written and the rest is left as it is.
    """
    check_rows(blocks.numel(), INDICES, blocks=blocks)  # 1-D, contiguous, int32/int64
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, D], got shape {tuple(k_cache.shape)}")
    _, block_size, num_heads, head_dim = k_cache.shape
    check_block_size(block_size)  # a copy is cut into runs of tokens that divide the block
    key_major = check_store_caches(k_cache, v_cache, num_heads, head_dim)
    fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if out is None:
        k, v = (torch.empty(blocks.shape[0], block_size, num_heads, head_dim, dtype=dtype, device=k_cache.device)
                for _ in range(2))
    else:
        k, v = out
        for name, c in (("out[0]", k), ("out[1]", v)):
            check_block_copies(name, c, k_cache.shape[1:], dtype, blocks.shape[0])
    if blocks.shape[0] == 0:
        return k, v
    block_d = triton.next_power_of_2(head_dim)
    # A copy: bound by bytes, so a fixed tile of up to 4096 values a program, no tuning.
    tokens = min(block_size, max(1, 4096 // block_d))
    grid = (blocks.shape[0], num_heads, 2 * (block_size // tokens))
    _gather_kv_blocks_kernel[grid](k_cache, v_cache, k_scale, v_scale, blocks, k, v, *scale_strides(k_scale),
                                   NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TOKENS=tokens,
                                   BLOCK_D=block_d, FP8=fp8, V_KEY_MAJOR=key_major, INTERPRET=INTERPRET, num_warps=4)
    return k, v
