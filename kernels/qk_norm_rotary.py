"""Fused Qwen3 attention prologue: per-head q/k RMSNorm + neox rotary + KV-cache store in one launch.

One pass over the packed QKV GEMM output replaces rms_norm (q), rms_norm (k), rotary_embedding and
store_kv_cache, with exactly their rounding points (kernels/reference.py composes those four). An e4m3
cache stores K quantized from its rotated float32 value, V from its loaded value (kernels/fp8.py).
"""
import torch
import triton
import triton.language as tl

from tritonllm.kernels import tuning
from tritonllm.kernels.checks import FLOATS, INDICES, check_dtype, check_rows, check_writable
from tritonllm.kernels.fp8 import (check_kv_scales, e4m3_scale, from_e4m3, scale_offsets, scale_strides, store_held,
                                   to_e4m3)
from tritonllm.kernels.kv_cache import check_store_caches, check_store_copies, slot_offsets
from tritonllm.kernels.tuning import INTERPRET, Tunable, dtype_name, pow2


@triton.jit
def _load_halves(ptrs, mask, HALF: tl.constexpr):
    """The values at ptrs and at ptrs + HALF: heads' two rotary halves ([TOKENS, H, BLOCK_HALF]), or a norm weight's."""
    return tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + HALF, mask=mask, other=0.0)


@triton.jit
def _norm_rotate(raw1, raw2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr, ROUND: tl.constexpr):
    """Heads given as their two halves [TOKENS, H, BLOCK_HALF] (0 where masked), the norm weight's
    halves w1, w2 [BLOCK_HALF] in float32: HF Qwen3 RMSNorm over the head dim, then neox rotary.
    Returns the two rotated halves rounded once to the input dtype, or in float32 unless ROUND."""
    dtype = raw1.dtype
    x1, x2 = raw1.to(tl.float32), raw2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)) / HEAD_DIM + eps)[:, :, None]
    # HF: the normalized value is cast to the model dtype before the weight multiply, and the
    # product is rounded to the model dtype (rms_norm's output, rotary_embedding's input).
    y1 = (w1[None, None, :] * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2[None, None, :] * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    r1, r2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
    if ROUND:
        r1, r2 = r1.to(dtype), r2.to(dtype)
    return r1, r2


@triton.jit
def _store_e4m3_heads(x1, x2, ptrs1, ptrs2, mask, scale_ptrs, scale_mask, DIRECT: tl.constexpr,
                      DIRECT_CODES: tl.constexpr, INTERPRET: tl.constexpr, run=False, run_ptrs1=None, run_ptrs2=None,
                      run_mask=None):
    """Heads given as float32 halves [TOKENS, H, BLOCK_HALF] (0 where masked) quantized per (token,
    head) into the cache at ptrs1 / ptrs2 (first / second halves), their scales [TOKENS, H] at scale_ptrs.
    DIRECT: the scales, and the codes too where DIRECT_CODES (a key-major V), go through store_held.
    Where run (a flag: the tokens' slots are one run), the codes go to run_ptrs1 / run_ptrs2 under
    run_mask instead: the same addresses, as pointers and a mask whose contiguity over the tokens the
    compiler can see, so that a thread stores a row's codes of all the tokens at once.
    Returns the stored halves' values (code times scale, float32), as a reader of the cache gets them."""
    scale = e4m3_scale(tl.maximum(tl.max(tl.abs(x1), axis=2), tl.max(tl.abs(x2), axis=2)))
    if DIRECT:
        store_held(scale_ptrs, scale, scale_mask, INTERPRET)
    else:
        tl.store(scale_ptrs, scale, mask=scale_mask)
    scale = scale[:, :, None]
    q1, q2 = to_e4m3(x1, scale, INTERPRET), to_e4m3(x2, scale, INTERPRET)
    if run:
        tl.store(run_ptrs1, q1, mask=run_mask)
        tl.store(run_ptrs2, q2, mask=run_mask)
    elif DIRECT and DIRECT_CODES:
        store_held(ptrs1, q1, mask, INTERPRET)
        store_held(ptrs2, q2, mask, INTERPRET)
    else:
        tl.store(ptrs1, q1, mask=mask)
        tl.store(ptrs2, q2, mask=mask)
    return from_e4m3(q1, tl.float32, INTERPRET) * scale, from_e4m3(q2, tl.float32, INTERPRET) * scale


@triton.jit
def _aligned_run(slot_ptr, group, slots, RUN: tl.constexpr):
    """(run, first): whether the slots [RUN] of tokens group * RUN onward (the first exists) are one run
    from a multiple of RUN (a prompt's rows), and the first of them (int64)."""
    first = tl.load(slot_ptr + group.to(tl.int64) * RUN).to(tl.int64)
    run = (first >= 0) & (first % RUN == 0) & (tl.sum((slots == first + tl.arange(0, RUN)).to(tl.int32), 0) == RUN)
    return run, first


@triton.jit
def _store_v_group(index, qkv_ptr, v_cache_ptr, v_scale_ptr, slot_ptr, copy_slot_ptr, v_copy_ptr, n_tokens,
                   qkv_token_stride, stride_scale_block, stride_scale_token, stride_scale_head,
                   NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, V_GROUP: tl.constexpr, V_BLOCK_SIZE: tl.constexpr, COPY: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """V of KV head index % Hkv for tokens (index // Hkv) * V_GROUP onward into an e4m3 key-major V
    cache (blocks of V_BLOCK_SIZE, a multiple of V_GROUP), with its scales and, where COPY, its copies.

    Where the group's slots are one run from a multiple of V_GROUP (a prompt's rows), each (head, d)
    row's V_GROUP codes lie side by side in one block and a thread stores several at once; other
    groups store code by code."""
    group, head = index // NUM_KV_HEADS, index % NUM_KV_HEADS
    tokens = (group * V_GROUP + tl.arange(0, V_GROUP)).to(tl.int64)
    token_mask = tokens < n_tokens
    slots = tl.load(slot_ptr + tokens, mask=token_mask, other=-1).to(tl.int64)
    row_mask = token_mask & (slots >= 0)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    mask = row_mask[:, None] & dim_mask[None, :]
    cols = head * HEAD_DIM + dims
    v = tl.load(qkv_ptr + tokens[:, None] * qkv_token_stride + (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM + cols[None, :],
                mask=mask, other=0.0).to(tl.float32)
    scale = e4m3_scale(tl.max(tl.abs(v), axis=1))
    tl.store(v_scale_ptr + scale_offsets(slots, head, stride_scale_block, stride_scale_token, stride_scale_head,
                                         V_BLOCK_SIZE), scale, mask=row_mask)
    codes = to_e4m3(v, scale[:, None], INTERPRET)
    keys = tl.arange(0, V_GROUP)
    run, first = _aligned_run(slot_ptr, group, slots, V_GROUP)
    if run:
        start = v_cache_ptr + slot_offsets(first, 0, NUM_KV_HEADS * HEAD_DIM, V_BLOCK_SIZE, True)
        start = tl.multiple_of(start, V_GROUP)
        tl.store(start + (cols * V_BLOCK_SIZE)[None, :] + keys[:, None], codes, mask=(keys >= 0)[:, None] & dim_mask)
    else:
        offsets = slot_offsets(slots[:, None], cols[None, :], NUM_KV_HEADS * HEAD_DIM, V_BLOCK_SIZE, True)
        tl.store(v_cache_ptr + offsets, codes, mask=mask)
    if COPY:
        copy_slots = tl.load(copy_slot_ptr + tokens, mask=token_mask, other=-1).to(tl.int64)
        values = from_e4m3(codes, tl.float32, INTERPRET) * scale[:, None]
        tl.store(v_copy_ptr + copy_slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + cols[None, :],
                 values.to(v_copy_ptr.dtype.element_ty), mask=mask & (copy_slots >= 0)[:, None])


@triton.jit(do_not_specialize=["n_tokens", "eps"])
def _qk_norm_rotary_store_kernel(
    positions_ptr, qkv_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr,
    k_scale_ptr, v_scale_ptr, copy_slot_ptr, k_copy_ptr, v_copy_ptr,
    n_tokens, qkv_token_stride, cos_sin_stride, q_out_token_stride, q_out_head_stride, eps,
    stride_scale_block, stride_scale_token, stride_scale_head,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, TOKENS: tl.constexpr,
    FP8: tl.constexpr, INTERPRET: tl.constexpr, V_BLOCK_SIZE: tl.constexpr, V_KEY_MAJOR: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, COPY: tl.constexpr, DIRECT_STORES: tl.constexpr, V_GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Each program handles TOKENS tokens: all their q, k and v heads. Tensors are
    # [TOKENS, heads, BLOCK_HALF]; a head is processed as its two rotary halves. With V_GROUP, V goes
    # to programs of its own past those, one a KV head and V_GROUP tokens (_store_v_group).
    if V_GROUP > 0:
        if tl.program_id(0) >= tl.cdiv(n_tokens, TOKENS):
            _store_v_group(tl.program_id(0) - tl.cdiv(n_tokens, TOKENS), qkv_ptr, v_cache_ptr, v_scale_ptr, slot_ptr,
                           copy_slot_ptr, v_copy_ptr, n_tokens, qkv_token_stride, stride_scale_block,
                           stride_scale_token, stride_scale_head, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_D,
                           V_GROUP, V_BLOCK_SIZE, COPY, INTERPRET)
            return
    tokens = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    token_mask = tokens < n_tokens
    positions = tl.load(positions_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    # slot < 0 marks a row whose K/V must not be stored (padding); q is still produced.
    slots = tl.load(slot_ptr + tokens, mask=token_mask, other=-1).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < HALF

    cos_sin_ptrs = cos_sin_ptr + positions[:, None] * cos_sin_stride + dims[None, :]
    cos_sin_mask = token_mask[:, None] & dim_mask[None, :]
    cos = tl.load(cos_sin_ptrs, mask=cos_sin_mask, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(cos_sin_ptrs + HALF, mask=cos_sin_mask, other=0.0).to(tl.float32)[:, None, :]

    rows = qkv_ptr + tokens[:, None, None] * qkv_token_stride  # [TOKENS, 1, 1]
    token_mask3 = token_mask[:, None, None]
    dims3 = dims[None, None, :]
    dim_mask3 = dim_mask[None, None, :]
    q_heads = tl.arange(0, BLOCK_QH)[None, :, None]
    q_mask = token_mask3 & (q_heads < NUM_Q_HEADS) & dim_mask3
    # Rows with slot < 0 have no K/V to store, and are not even read.
    kv_heads = tl.arange(0, BLOCK_KH)[None, :, None]
    kv_mask = token_mask3 & (slots >= 0)[:, None, None] & (kv_heads < NUM_KV_HEADS) & dim_mask3

    # Every load before the first store: the compiler cannot move a load past a store that may
    # alias it, and q, k and v loaded one after another's store would cost three memory round trips.
    q1, q2 = _load_halves(rows + q_heads * HEAD_DIM + dims3, q_mask, HALF)
    k1, k2 = _load_halves(rows + (NUM_Q_HEADS + kv_heads) * HEAD_DIM + dims3, kv_mask, HALF)
    if V_GROUP == 0:
        v1, v2 = _load_halves(rows + (NUM_Q_HEADS + NUM_KV_HEADS + kv_heads) * HEAD_DIM + dims3, kv_mask, HALF)
    qw1, qw2 = _load_halves(q_weight_ptr + dims, dim_mask, HALF)
    kw1, kw2 = _load_halves(k_weight_ptr + dims, dim_mask, HALF)
    if COPY:
        copy_slots = tl.load(copy_slot_ptr + tokens, mask=token_mask, other=-1).to(tl.int64)

    cols = kv_heads * HEAD_DIM + dims3
    if FP8:
        # A scale per (token, head) at [slot, head], for K and for V.
        heads = tl.arange(0, BLOCK_KH)[None, :]
        scale_offs = scale_offsets(slots[:, None], heads, stride_scale_block, stride_scale_token, stride_scale_head,
                                   SCALE_BLOCK)
        scale_mask = (token_mask & (slots >= 0))[:, None] & (heads < NUM_KV_HEADS)

    # v (as is) into its cache slot first: it needs nothing of q or k, and into a key-major e4m3 V
    # (a byte every block_size bytes) its stores take the longest to complete.
    if V_GROUP == 0:
        v_ptrs1 = v_cache_ptr + slot_offsets(slots[:, None, None], cols, NUM_KV_HEADS * HEAD_DIM, V_BLOCK_SIZE,
                                             V_KEY_MAJOR)
        v_ptrs2 = v_cache_ptr + slot_offsets(slots[:, None, None], cols + HALF, NUM_KV_HEADS * HEAD_DIM, V_BLOCK_SIZE,
                                             V_KEY_MAJOR)
        if FP8:
            # In a key-major V a token's codes lie a block apart. Where the program's tokens fill one
            # aligned run of a block's slots (a prompt's rows), a thread stores each (head, d) row's TOKENS
            # codes at once: 1/TOKENS of the L2 write requests of one byte a store.
            run, run_ptrs1, run_mask = False, v_ptrs1, kv_mask
            if V_KEY_MAJOR and TOKENS > 1 and V_BLOCK_SIZE % TOKENS == 0:  # an aligned run stays in its block
                keys = tl.arange(0, TOKENS)
                run, first = _aligned_run(slot_ptr, tl.program_id(0), slots, TOKENS)
                start = v_cache_ptr + slot_offsets(first, 0, NUM_KV_HEADS * HEAD_DIM, V_BLOCK_SIZE, True)
                run_ptrs1 = tl.multiple_of(start, TOKENS) + cols * V_BLOCK_SIZE + keys[:, None, None]
                run_mask = (keys >= 0)[:, None, None] & (kv_heads < NUM_KV_HEADS) & dim_mask3
            v1, v2 = _store_e4m3_heads(v1.to(tl.float32), v2.to(tl.float32), v_ptrs1, v_ptrs2, kv_mask,
                                       v_scale_ptr + scale_offs, scale_mask, DIRECT_STORES, V_KEY_MAJOR,
                                       INTERPRET, run, run_ptrs1, run_ptrs1 + HALF * V_BLOCK_SIZE, run_mask)
        else:
            v1, v2 = v1.to(v_cache_ptr.dtype.element_ty), v2.to(v_cache_ptr.dtype.element_ty)
            tl.store(v_ptrs1, v1, mask=kv_mask)
            tl.store(v_ptrs2, v2, mask=kv_mask)

    # q: normed + roped into q_out.
    q1, q2 = _norm_rotate(q1, q2, qw1.to(tl.float32), qw2.to(tl.float32), cos, sin, eps, HEAD_DIM, True)
    q_out = q_out_ptr + tokens[:, None, None] * q_out_token_stride + q_heads * q_out_head_stride + dims3
    tl.store(q_out, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_out + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    # k (normed + roped) into its cache slot.
    k_offsets = slot_offsets(slots[:, None, None], cols, NUM_KV_HEADS * HEAD_DIM, 1, False)
    k1, k2 = _norm_rotate(k1, k2, kw1.to(tl.float32), kw2.to(tl.float32), cos, sin, eps, HEAD_DIM, not FP8)
    if FP8:
        # K from its rotated float32 value, unrounded.
        k1, k2 = _store_e4m3_heads(k1, k2, k_cache_ptr + k_offsets, k_cache_ptr + k_offsets + HALF, kv_mask,
                                   k_scale_ptr + scale_offs, scale_mask, DIRECT_STORES, False, INTERPRET)
    else:
        k1, k2 = k1.to(k_cache_ptr.dtype.element_ty), k2.to(k_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + k_offsets, k1, mask=kv_mask)
        tl.store(k_cache_ptr + k_offsets + HALF, k2, mask=kv_mask)
    if COPY:
        # The stored rows again, as values in the copies' dtype at their copy slots (plain layout).
        copy_mask = kv_mask & (copy_slots >= 0)[:, None, None]
        copy_offsets = copy_slots[:, None, None] * (NUM_KV_HEADS * HEAD_DIM) + cols
        dtype = k_copy_ptr.dtype.element_ty
        tl.store(k_copy_ptr + copy_offsets, k1.to(dtype), mask=copy_mask)
        tl.store(k_copy_ptr + copy_offsets + HALF, k2.to(dtype), mask=copy_mask)
        if V_GROUP == 0:
            tl.store(v_copy_ptr + copy_offsets, v1.to(dtype), mask=copy_mask)
            tl.store(v_copy_ptr + copy_offsets + HALF, v2.to(dtype), mask=copy_mask)


def _space(dtype, row_bucket, tokens_bucket, cache_dtype=None):
    # row_bucket: the padded elements of one token's q, k and v heads. At least 8 elements a thread.
    # Into an e4m3 cache, each config also with DIRECT_STORES (store_held).
    direct = (False, True) if cache_dtype == "float8_e4m3fn" else (False,)
    return [{"TOKENS": tokens, "num_warps": warps, "num_stages": 1, "DIRECT_STORES": d}
            for tokens in (1, 2, 4) for warps in (1, 2, 4, 8) for d in direct
            if tokens <= tokens_bucket and tokens * row_bucket <= 16384
            and (warps == 1 or warps * 32 * 8 <= tokens * row_bucket)]


def _default(dtype, row_bucket, tokens_bucket, cache_dtype=None):
    # One token a program (16/8 heads x 128: 4096 elements, 4 warps); small rows (TP shards) share
    # a program when there are many tokens. Into an e4m3 cache (V key-major: a token's V bytes a
    # block apart) many tokens go 4 to a program, for runs of 4 adjacent bytes, and store their
    # scales and V bytes where they are held (store_held), with no barrier for a move through shared
    # memory; with fewer tokens a program the move measured faster (bench/NOTES-elementwise.md).
    if cache_dtype == "float8_e4m3fn" and tokens_bucket >= 1024:
        tokens = max(1, min(4, 16384 // row_bucket))
        return {"TOKENS": tokens, "num_warps": min(8, max(1, tokens * row_bucket // 2048)), "num_stages": 1,
                "DIRECT_STORES": tokens == 4}
    tokens = max(1, min(4, 2048 // row_bucket)) if tokens_bucket >= 1024 else 1
    return {"TOKENS": tokens, "num_warps": min(8, max(1, tokens * row_bucket // 1024)), "num_stages": 1,
            "DIRECT_STORES": False}


_TUNING = Tunable("qk_norm_rotary_store", _space, _default)


def qk_norm_rotary_store_bucket(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                                n_tokens: int, cache_dtype: torch.dtype | None = None) -> tuple:
    """The tuning bucket of qk_norm_rotary_store on a qkv of `dtype` holding n_tokens tokens: the
    padded elements of one token's q, k and v heads, the tokens, and for an e4m3 cache its dtype."""
    padded = (pow2(num_heads) + 2 * pow2(num_kv_heads)) * 2 * pow2(head_dim // 2)
    bucket = dtype_name(dtype), pow2(padded), pow2(n_tokens)
    return bucket + (dtype_name(cache_dtype),) if cache_dtype == torch.float8_e4m3fn else bucket


def qk_norm_rotary_store(positions, qkv, q_weight, k_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping,
                         num_heads, num_kv_heads, out=None, *, k_scale=None, v_scale=None, k_copy=None, v_copy=None,
                         copy_slots=None):
    """Qwen3's attention prologue on the packed QKV GEMM output, in one launch; returns q [T, Hq, D].

    qkv [T, (Hq + 2*Hkv) * D] float32/float16/bfloat16: per token the Hq q heads, then the Hkv k
    heads, then the Hkv v heads; any row stride, last dim contiguous. q_weight, k_weight [D] contiguous
    float32/float16/bfloat16; eps float; positions [T] int32/int64; cos_sin_cache [max_pos, D] float32 (cos in
    [:, :D/2], sin in [:, D/2:], rows contiguous); k_cache, v_cache [num_blocks, block_size, Hkv, D]
    (k_cache contiguous, v_cache contiguous or key-major: kernels/kv_cache.py); slot_mapping [T] int32/int64 (slot = block * block_size + offset); num_heads = Hq,
    num_kv_heads = Hkv. D even (a power of two, 64 or 128, for Qwen3).

    Per token t, exactly as reference.rms_norm then reference.rotary_embedding then
    reference.store_kv_cache: q and k heads get HF Qwen3 RMSNorm over D (normalized value rounded
    to qkv's dtype, times the weight, rounded) then neox rotary at positions[t] (float32, one
    rounding to qkv's dtype). In place: k (normed + roped) and v (unchanged) are written to slot
    slot_mapping[t] of k_cache / v_cache (cast to the cache dtype); slot < 0 skips row t's K/V
    write (q is still produced). Nothing else is modified: qkv is only read. Returns q [T, Hq, D]
    of qkv's dtype, a new contiguous tensor, or `out` ([T, Hq, D], qkv's dtype, last dim
    contiguous) when given.

    A torch.float8_e4m3fn cache needs k_scale, v_scale [num_blocks, block_size, Hkv] float32,
    contiguous or head-major (kernels/fp8.empty_kv_scales): each (token, head) row of k (rotated,
    in float32, before rounding to qkv's dtype) and of v is stored as e4m3(row / scale), scale =
    max|row| / 448 (1.0 for a zero row), and its scale is written at [slot, head] (kernels/fp8.py);
    slot < 0 skips the scales too.

    Copies (optional, all three or none): k_copy, v_copy [G, block_size, Hkv, D] of qkv's dtype,
    contiguous (the plain layout), and copy_slots [T] int32/int64. Each stored row of k and v is also
    written, as the cache now holds it (for e4m3, code times scale in float32, then rounded), to slot
    copy_slots[t] of the copies, exactly as gather_kv_blocks would copy it out; copy_slots[t] < 0 (or
    slot_mapping[t] < 0) skips. Prefill over an e4m3 cache runs on such copies (layers/attention.py).
    """
    if qkv.dim() != 2 or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, (Hq + 2*Hkv) * D] with a contiguous last dim, got {tuple(qkv.shape)} strides {qkv.stride()}")
    n_tokens, width = qkv.shape
    heads = num_heads + 2 * num_kv_heads
    head_dim = width // heads
    if num_heads <= 0 or num_kv_heads <= 0 or head_dim * heads != width or head_dim % 2:
        raise ValueError(f"qkv width {width} is not (Hq + 2*Hkv) * D with Hq={num_heads}, Hkv={num_kv_heads}, D even")
    check_rows(head_dim, FLOATS, q_weight=q_weight, k_weight=k_weight)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}] with contiguous rows, got {tuple(cos_sin_cache.shape)}")
    check_dtype("qkv", qkv, FLOATS)
    check_dtype("cos_sin_cache", cos_sin_cache, (torch.float32,))
    v_key_major = check_store_caches(k_cache, v_cache, num_kv_heads, head_dim)
    check_rows(n_tokens, INDICES, positions=positions, slot_mapping=slot_mapping)
    fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    copy = check_store_copies(k_copy, v_copy, copy_slots, k_cache.shape[1:], qkv.dtype, n_tokens)
    if out is None:
        out = torch.empty(n_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (n_tokens, num_heads, head_dim) or out.dtype != qkv.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be [{n_tokens}, {num_heads}, {head_dim}] {qkv.dtype} with a contiguous last dim, "
                         f"got {tuple(out.shape)} {out.dtype}")
    check_writable("out", out)
    if n_tokens == 0:
        return out
    half = head_dim // 2
    block_qh, block_kh = triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
    block_half = triton.next_power_of_2(half)

    def launch(config):
        # Prefill into an e4m3 key-major V in blocks of 32 or more keys: V goes to programs of 32 tokens
        # and a KV head, where a prompt's (head, d) row of codes fills a 32-byte sector in one store.
        v_group = 32 if fp8 and v_key_major and config["TOKENS"] > 1 and k_cache.shape[1] % 32 == 0 else 0
        v_programs = triton.cdiv(n_tokens, v_group) * num_kv_heads if v_group else 0
        grid = triton.cdiv(n_tokens, config["TOKENS"]) + v_programs
        _qk_norm_rotary_store_kernel[(grid,)](
            positions, qkv, q_weight, k_weight, cos_sin_cache, k_cache, v_cache, slot_mapping, out, k_scale, v_scale,
            copy_slots, k_copy, v_copy,
            n_tokens, qkv.stride(0), cos_sin_cache.stride(0), out.stride(0), out.stride(1), eps,
            *scale_strides(k_scale),
            NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
            BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_HALF=block_half, FP8=fp8, INTERPRET=INTERPRET,
            V_BLOCK_SIZE=k_cache.shape[1] if v_key_major else 1, V_KEY_MAJOR=v_key_major,
            SCALE_BLOCK=k_cache.shape[1] if fp8 else 1, COPY=copy, V_GROUP=v_group,
            BLOCK_D=triton.next_power_of_2(head_dim), **config,
        )

    # The launch only writes q_out and cache slots it fully determines: repeating it is harmless.
    bucket = qk_norm_rotary_store_bucket(qkv.dtype, num_heads, num_kv_heads, head_dim, n_tokens, k_cache.dtype)
    launch(_TUNING.config(bucket, tuning.tuning_launcher(launch, qkv.is_cuda, n_tokens)))
    return out
