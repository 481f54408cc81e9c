"""E4M3 (torch.float8_e4m3fn) KV-cache rows: the quantization helpers the store and attention kernels share.

A row x of D values (float32) is stored as q = e4m3(x / scale), scale = max|x| / 448 (1.0 for an
all-zero row), rounded to nearest even and saturated to +-448; its value is float(q) * scale.

Triton's interpreter converts exact e4m3 values correctly both ways, but rounds float32 -> e4m3
wrongly (half up on the first dropped bit, no carry into the exponent, no saturation, values below
the normal range flushed) and decodes the NaN patterns 0x7F / 0xFF as +-480. Under INTERPRET the
helpers round in float32 arithmetic before the conversion and mark the NaN patterns themselves,
so CPU runs check the math the GPU's plain conversions do.
"""
import torch
import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def e4m3_scale(amax):
    """The float32 scale of rows whose largest magnitude is amax: amax / 448, or 1.0 where that is 0
    (an all-zero row, or one below float32's smallest scale: 0 / 0 would store NaN codes)."""
    scale = tl.div_rn(amax, E4M3_MAX)
    return tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def _round_e4m3(x):
    # x float32 within +-448, rounded to the e4m3 grid: 3 mantissa bits, exponents down to -6 (below
    # that a fixed step of 2^-9). |x| / step is exact and below 16, so adding and subtracting
    # 1.5 * 2^23 rounds it to an integer, ties to even. The sign is put back from the bits, -0 included
    # (by a multiply: Triton 3.6's interpreter negates 0.0 to +0).
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = ((tl.abs(x) / step + 12582912.0) - 12582912.0) * step
    return tl.where(bits < 0, -1.0, 1.0) * rounded


@triton.jit
def to_e4m3(x, scale, INTERPRET: tl.constexpr):
    """x / scale (float32, correctly rounded division) as tl.float8e4nv: nearest even, saturated to +-448.

    scale broadcasts against x (one per row). On the GPU the quotient is x times scale's reciprocal,
    corrected once by a fused multiply-add (Markstein), which rounds it as a division would: one
    division a row instead of one an element. Where the correction is 0 (x = +-0) or NaN (x = +-inf)
    the product stands, so -0 stays -0 and inf saturates; the conversion saturates by itself."""
    if INTERPRET:
        y = tl.div_rn(x, scale)
        codes = _round_e4m3(tl.minimum(tl.maximum(y, -E4M3_MAX), E4M3_MAX)).to(tl.float8e4nv)
        # NaN stays NaN (0x7F), as in the GPU's conversion: the interpreter's turns it into +-384.
        return tl.where(y == y, codes, tl.full(y.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True))
    r = tl.div_rn(1.0, scale)
    y = x * r
    e = tl.fma(-y, scale, x)
    return tl.where(tl.abs(e) > 0.0, tl.fma(e, r, y), y).to(tl.float8e4nv)


@triton.jit
def from_e4m3(q, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """The values of a tl.float8e4nv tile in `dtype` (float32, float16 or bfloat16: exact), NaN patterns NaN.

    The row scale is not applied."""
    if INTERPRET:
        # Through float32 (exact for every e4m3 value): the interpreter has no bfloat16 constants.
        x = tl.where((q.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), q.to(tl.float32)).to(dtype)
    else:
        x = q.to(dtype)
    return x


@triton.jit
def store_held(ptrs, values, mask, INTERPRET: tl.constexpr):
    """tl.store(ptrs, values, mask=mask) of float32 words or e4m3 bytes, each written by the threads
    that hold it, with no move into another layout first.

    tl.store routes values through shared memory (and a barrier) into the layout whose addresses
    coalesce best. A scale (one word a head, replicated over the head's lanes) or a key-major V's
    bytes (a block apart) gain nothing from that move. Replicas write the same value to the same
    address. The interpreter takes tl.store."""
    if INTERPRET:
        tl.store(ptrs, values, mask=mask)
    elif values.dtype == tl.float32:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }", "=r,l,r,r",
            [ptrs, values.to(tl.int32, bitcast=True), mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b8 [$1], $2; mov.b32 $0, 0; }", "=r,l,r,r",
            [ptrs, values.to(tl.uint8, bitcast=True).to(tl.int32), mask.to(tl.int32)], dtype=tl.int32,
            is_pure=False, pack=1)


@triton.jit
def fp8_dot_operand(q):
    """q as the dots against converted e4m3 tiles take it: a bfloat16 q as float16 (exact in fp16's
    normal range, which bounds |q| by 65504), since e4m3 converts to float16 with one instruction a
    pair of values and to bfloat16 only through float16, two more; other dtypes unchanged."""
    if q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    return q


@triton.jit
def block_scale_offsets(block, in_block, stride_block, stride_token):
    """Element offsets of the scales of the cache rows at offset in_block of block `block` (broadcast
    together; int64 when block is), one KV head's, in scales [num_blocks, block_size, Hkv] of the given
    strides (contiguous or head-major); the caller adds head * stride_head."""
    return block * stride_block + in_block * stride_token


@triton.jit
def scale_offsets(slots, heads, stride_block, stride_token, stride_head, BLOCK_SIZE: tl.constexpr):
    """int64 element offsets of the scales of cache slots `slots` (int64) and KV heads `heads`, broadcast
    together, in scales [num_blocks, BLOCK_SIZE, Hkv] of the given strides (contiguous or head-major)."""
    return block_scale_offsets(slots // BLOCK_SIZE, slots % BLOCK_SIZE, stride_block, stride_token) \
        + heads * stride_head


def scale_strides(scale: torch.Tensor | None) -> tuple:
    """The kernels' three scale-stride arguments: scale's strides, or None for a cache without scales."""
    return scale.stride() if scale is not None else (None, None, None)


def empty_kv_scales(num_blocks: int, block_size: int, num_kv_heads: int, device=None, *,
                    head_major: bool = False) -> torch.Tensor:
    """Uninitialized float32 scales [num_blocks, block_size, Hkv] of an e4m3 cache: contiguous, or
    head-major (memory [num_blocks, Hkv, block_size], the same shape through permuted strides), where
    one head's scales in a block are adjacent and an attention tile reads them as one run."""
    if not head_major:
        return torch.empty(num_blocks, block_size, num_kv_heads, dtype=torch.float32, device=device)
    return torch.empty(num_blocks, num_kv_heads, block_size, dtype=torch.float32, device=device).transpose(1, 2)


def head_major_copy(scale: torch.Tensor) -> torch.Tensor:
    """A copy of scales [num_blocks, block_size, Hkv] in the head-major layout (same values)."""
    return empty_kv_scales(*scale.shape, scale.device, head_major=True).copy_(scale)


def _is_head_major(scale: torch.Tensor) -> bool:
    _, block_size, num_kv_heads = scale.shape
    return scale.stride() == (num_kv_heads * block_size, 1, block_size)


def check_kv_scales(k_cache, v_cache, k_scale, v_scale) -> bool:
    """Check the scales passed with caches [num_blocks, block_size, Hkv, D]; True for an e4m3 cache.

    A torch.float8_e4m3fn cache needs k_scale and v_scale, float32 [num_blocks, block_size, Hkv]
    like their cache, contiguous or head-major (empty_kv_scales), v_scale with k_scale's strides;
    any other cache takes neither. Raises ValueError naming the offending argument.
    """
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if (v_cache.dtype == torch.float8_e4m3fn) != fp8:
        raise ValueError(f"k_cache and v_cache must both be float8_e4m3fn or neither, "
                         f"got {k_cache.dtype} and {v_cache.dtype}")
    for name, scale, cache in (("k_scale", k_scale, k_cache), ("v_scale", v_scale, v_cache)):
        if not fp8:
            if scale is not None:
                raise ValueError(f"{name} is only for a float8_e4m3fn cache, got a {cache.dtype} cache")
            continue
        if scale is None:
            raise ValueError(f"{name} is required with a float8_e4m3fn cache")
        if scale.shape != cache.shape[:3] or scale.dtype != torch.float32 or not (
                scale.is_contiguous() or _is_head_major(scale)):
            raise ValueError(f"{name} must be a float32 {list(cache.shape[:3])}, contiguous or head-major "
                             f"(kernels/fp8.empty_kv_scales), got {list(scale.shape)} {scale.dtype} "
                             f"strides {scale.stride()}")
    if fp8 and v_scale.stride() != k_scale.stride():
        raise ValueError(f"v_scale must have k_scale's strides {k_scale.stride()}, got {v_scale.stride()}")
    return fp8
