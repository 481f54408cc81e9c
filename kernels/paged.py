"""The paged-attention core that prefill_attention.py and decode_attention.py share.

A paged KV cache is [num_blocks, block_size, Hkv, D]; a sequence's block table maps its logical
blocks to physical ones. `_attend_tile` is prefill's online-softmax step of a tile of query rows
over BLOCK_N keys read through the table (or through TMA descriptors); decode has its own,
transposed step (decode_attention.py) over the same helpers: `_key_blocks` where a tile's keys
lie, `_key_major_keys` their offsets in a key-major V (kernels/kv_cache.py), `_load_scales` and
`_relative_v_scales` an e4m3 tile's scales. `check_paged_inputs` holds the shape checks of both
wrappers.

An e4m3 cache (torch.float8_e4m3fn, kernels/fp8.py) holds K/V rows with a float32 scale per
(slot, KV head) in k_scale / v_scale [num_blocks, block_size, Hkv]: the fp8 tile is converted to
q's dtype (exact; the kernels pass a bfloat16 q as float16, fp8.fp8_dot_operand) for the dots,
each key's K scale multiplies its column of scores and its V scale its column of probabilities
before the PV dot.
"""
import numbers

import torch
import triton
import triton.language as tl

from tritonllm.kernels import tuning
from tritonllm.kernels.checks import FLOATS, check_block_size, check_dtype, check_rows, check_writable
from tritonllm.kernels.fp8 import block_scale_offsets, check_kv_scales, from_e4m3
from tritonllm.kernels.kv_cache import check_cache_layouts

LOG2E = 1.4426950408889634
MAX_GRID_YZ = 65535  # CUDA caps a grid's second and third dimensions here


def qk_scale_of(scale, head_dim: int) -> float:
    """The kernels' score multiplier: scale (None: head_dim ** -0.5) times log2(e); TypeError unless scale
    is a real number (a tensor would be read from the device, or not at all)."""
    if scale is None:
        scale = head_dim**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    return float(scale) * LOG2E


@triton.jit
def _key_blocks(block_table_row, n0, seq_len, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(physical block, offset in it) of keys n0 .. n0 + BLOCK_N - 1 (n0 a multiple of BLOCK_N):
    the block an int64 scalar where the tile lies in one block, else [BLOCK_N]; offsets [BLOCK_N]."""
    offs_n = tl.arange(0, BLOCK_N)
    if BLOCK_N <= BLOCK_SIZE:
        # The tile lies inside one cache block: one block-table lookup per tile.
        block = tl.load(block_table_row + n0 // BLOCK_SIZE).to(tl.int64)
        in_block = n0 % BLOCK_SIZE + offs_n
    else:
        # The tile spans several blocks: one lookup per key; table entries past the sequence may
        # be padding, so they are never read.
        keys = n0 + offs_n
        block = tl.load(block_table_row + keys // BLOCK_SIZE, mask=keys < seq_len, other=0).to(tl.int64)
        in_block = keys % BLOCK_SIZE
    return block, in_block


@triton.jit
def _load_scales(scale_ptr, offsets, in_seq, MASKED: tl.constexpr):
    """The [BLOCK_N] float32 scales of one KV head's keys (0 past the sequence when MASKED)."""
    if MASKED:
        scales = tl.load(scale_ptr + offsets, mask=in_seq, other=0.0)
    else:
        scales = tl.load(scale_ptr + offsets)
    return scales


@triton.jit
def _relative_v_scales(v_scale_ptr, scale_offsets, in_seq, MASKED: tl.constexpr):
    """A tile's V scales over their largest, and that largest (1.0 for an all-zero tile): the PV dot
    takes the ratios on p, so a float16 p keeps small scales out of subnormals."""
    v_scales = _load_scales(v_scale_ptr, scale_offsets, in_seq, MASKED)
    v_max = tl.max(v_scales, 0)
    v_max = tl.where(v_max == 0.0, 1.0, v_max)
    return v_scales / v_max, v_max


@triton.jit
def _key_major_keys(block, in_block, stride_cache_block, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] offsets of a tile's keys in a key-major V (add the head's and each D row's offsets).

    A key's D values lie BLOCK_SIZE apart; keys of one block are adjacent. The compiler cannot see
    that through the block-table gather: it is told, so the loads are vectors of keys."""
    run: tl.constexpr = min(BLOCK_N, BLOCK_SIZE)
    return tl.max_contiguous(tl.multiple_of(block * stride_cache_block + in_block, run), run)


@triton.jit
def _attend_tile(acc, m_i, l_i, v_ref, q, k_cache, v_cache, k_scale_ptr, v_scale_ptr, block_table_row, head_offset,
                 n0, seq_len, pos, qk_scale, stride_cache_block, stride_cache_token, stride_scale_block,
                 stride_scale_token, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
                 TMA: tl.constexpr, FP8: tl.constexpr, V_KEY_MAJOR: tl.constexpr):
    """One online-softmax step of the rows of q over keys n0 .. n0 + BLOCK_N - 1.

    m_i is the running row max in log2 units (scores times qk_scale = scale * log2(e)), l_i the
    running sum of exp2(score - m_i), acc the unnormalized output in units of the scalar v_ref
    (1.0 throughout unless FP8; returned updated: the caller multiplies acc by it at the end).
    MASKED: key j counts for a row only if j <= pos[row] (pos < seq_len), and keys at or past
    seq_len are not loaded; unmasked
    tiles must lie entirely inside every row's visible range. TMA: k_cache/v_cache are tensor
    descriptors over the cache as [cache rows, Hkv * D] with BLOCK_N <= BLOCK_SIZE, head_offset
    the head's first column; otherwise pointers, head_offset an element offset. FP8: the cache is
    e4m3 and k_scale_ptr / v_scale_ptr point at the KV head's scales, stride_scale_block apart per
    cache block and stride_scale_token per slot in it (unused otherwise). V_KEY_MAJOR: v_cache is
    key-major (kernels/kv_cache.py; the caches contiguous), a TMA descriptor over it
    [blocks * Hkv * D, BLOCK_SIZE] of D x BLOCK_N tiles.
    """
    keys = n0 + tl.arange(0, BLOCK_N)
    in_seq = (keys < seq_len)[:, None]
    if TMA:
        # One cache block holds the whole tile: one lookup, then one bulk copy each for K and V.
        block = tl.load(block_table_row + n0 // BLOCK_SIZE)
        row = block * BLOCK_SIZE + n0 % BLOCK_SIZE
        k = k_cache.load([row, head_offset])
        if FP8:
            scale_offsets = block_scale_offsets(block.to(tl.int64), n0 % BLOCK_SIZE + tl.arange(0, BLOCK_N),
                                                stride_scale_block, stride_scale_token)
    else:
        block, in_block = _key_blocks(block_table_row, n0, seq_len, BLOCK_SIZE, BLOCK_N)
        offsets = (block * stride_cache_block + in_block * stride_cache_token)[:, None] + head_offset \
            + tl.arange(0, HEAD_DIM)[None, :]
        if MASKED:
            k = tl.load(k_cache + offsets, mask=in_seq, other=0.0)
        else:
            k = tl.load(k_cache + offsets)
        if FP8:
            scale_offsets = block_scale_offsets(block, in_block, stride_scale_block, stride_scale_token)
    col_scale = qk_scale
    if FP8:
        # e4m3 converts exactly to q's dtype; each key's scale goes on its column of scores.
        k = from_e4m3(k, q.dtype, INTERPRET)
        col_scale = (_load_scales(k_scale_ptr, scale_offsets, keys < seq_len, MASKED) * qk_scale)[None, :]
    elif INTERPRET:
        # The interpreter's tl.dot multiplies raw bfloat16 bits: compute in float32 there.
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * col_scale
    if MASKED:
        # pos < seq_len, so this also drops any key a TMA tile read past the sequence.
        scores = tl.where(keys[None, :] <= pos[:, None], scores, float("-inf"))
    # Every row sees at least one key by its first tile, so m_new is finite and no NaN arises.
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.math.exp2(scores - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    if TMA and V_KEY_MAJOR:
        # The head's D x BLOCK_N tile of its block: rows (block * Hkv + head) * D, Hkv * D = stride_cache_token.
        v = tl.trans(v_cache.load([block * stride_cache_token + head_offset, n0 % BLOCK_SIZE]))
    elif TMA:
        v = v_cache.load([row, head_offset])
    elif V_KEY_MAJOR:
        key_offsets = _key_major_keys(block, in_block, stride_cache_block, BLOCK_SIZE, BLOCK_N)
        v_offsets = key_offsets[:, None] + head_offset * BLOCK_SIZE + (tl.arange(0, HEAD_DIM) * BLOCK_SIZE)[None, :]
        # No mask even on a tile past the sequence's end: a mask along the keys, the contiguous
        # dimension here, would split the vector copies into single bytes outside the pipeline.
        # Every key's address lies in an allocated block (padding keys read block 0); their rows are
        # zeroed below.
        v = tl.load(v_cache + v_offsets)
    elif MASKED:
        v = tl.load(v_cache + offsets, mask=in_seq, other=0.0)
    else:
        v = tl.load(v_cache + offsets)
    if FP8:
        v = from_e4m3(v, q.dtype, INTERPRET)
    elif INTERPRET:
        v = v.to(tl.float32)
    if (TMA or V_KEY_MAJOR) and MASKED:
        # Rows past the sequence hold whatever the block held before: p is 0 there, 0 * NaN is not.
        v = tl.where(in_seq, v, 0.0)
    if FP8:
        # sum_j p_j * v_scale_j * v_j: the V scales go on p's columns, relative to the tile's largest.
        # acc moves to units of that largest scale (v_ref) and the dot accumulates into it in place:
        # no second [rows, D] tile.
        v_rel, v_max = _relative_v_scales(v_scale_ptr, scale_offsets, keys < seq_len, MASKED)
        p_v = p * v_rel[None, :]
        acc = tl.dot(p_v.to(v.dtype), v, acc * (alpha * (v_ref / v_max))[:, None], input_precision=DOT_PRECISION)
        v_ref = v_max
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    # l after the PV dot keeps fewer values live across it (Triton tutorial 06).
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i, v_ref


def cache_bucket(dtype: torch.dtype, cache_dtype: torch.dtype | None) -> tuple:
    """The tail of an attention tuning bucket for the cache dtype: nothing where the cache holds q's
    dtype (so the keys tuned before e4m3 caches keep their meaning), else the cache dtype's name."""
    return () if cache_dtype in (None, dtype) else (tuning.dtype_name(cache_dtype),)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact float32 products (TF32 would break float32 parity with HF)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def supported_head_dim(head_dim: int) -> bool:
    """Head sizes the attention kernels take: tl.arange spans need powers of two, wgmma K >= 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def check_paged_inputs(q, k_cache, v_cache, seq_lens, block_tables, out, k_scale=None, v_scale=None):
    """Cheap shape checks shared by the attention wrappers; returns (group, block_size, fp8, v_key_major).

    fp8: the caches are float8_e4m3fn with their k_scale / v_scale (kernels/fp8.check_kv_scales);
    v_key_major: v_cache is key-major (kernels/kv_cache.check_cache_layouts).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, Hq, D], got shape {tuple(q.shape)}")
    check_dtype("q", q, FLOATS)
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hkv, D], got shape {tuple(k_cache.shape)}")
    v_key_major = check_cache_layouts(k_cache, v_cache)
    fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if not fp8 and (k_cache.dtype != q.dtype or v_cache.dtype != q.dtype):
        raise ValueError(f"k_cache/v_cache dtype {k_cache.dtype} differs from q dtype {q.dtype}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} differs from k_cache head_dim {head_dim}")
    if not supported_head_dim(head_dim):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if num_kv_heads < 1 or q.shape[1] % num_kv_heads:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k_cache heads ({num_kv_heads})")
    check_block_size(block_size)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and k_cache/v_cache must be contiguous in the last (head_dim) dimension")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [B], got shape {tuple(seq_lens.shape)}")
    batch = seq_lens.shape[0]
    check_rows(batch, (torch.int32,), seq_lens=seq_lens)
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks] with contiguous rows, got shape "
                         f"{tuple(block_tables.shape)} strides {block_tables.stride()}")
    check_dtype("block_tables", block_tables, (torch.int32,))
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be a {q.dtype} tensor of q's shape {tuple(q.shape)}, contiguous in head_dim")
    check_writable("out", out)
    return q.shape[1] // num_kv_heads, block_size, fp8, v_key_major
