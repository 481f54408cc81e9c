"""Causal prefill attention over the paged KV cache: plain prefill, prefix-cache hits, chunked prefill.

One program per (KV head, sequence, tile of BLOCK_Q new tokens). The G = Hq / Hkv query heads that
share a KV head are packed into the BLOCK_M = BLOCK_Q * G rows of one tile (row r = token r // G,
head kv * G + r % G), so each K/V tile is loaded once for all G heads and tl.dot sees a BLOCK_M of
64 or 128 (wgmma on Hopper). Keys that every row of the tile sees run in a loop without masks; the
keys on the diagonal run in a second loop with the causal mask; nothing past the last row's
position is read. Online softmax in float32 with exp2 and scale * log2(e) folded in.

Where each key tile lies inside one cache block (BLOCK_N <= block_size) on a GPU with TMA, K and
V tiles arrive as TMA bulk copies through tensor descriptors: one block-table lookup a tile, no
per-element address math, and the copies pipeline ahead of the dots. The tile step itself
(`_attend_tile`) is kernels/paged.py's.

An e4m3 cache (k_scale / v_scale given) takes the same paths: its TMA descriptors copy 1-byte
tiles, which are converted to q's dtype in registers for the bf16/fp16 wgmma, and the per-key
scales arrive as [BLOCK_N] pointer loads beside them.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tritonllm.kernels import tuning
from tritonllm.kernels.checks import check_rows
from tritonllm.kernels.fp8 import fp8_dot_operand, scale_strides
from tritonllm.kernels.paged import (MAX_GRID_YZ, _attend_tile, cache_bucket, check_paged_inputs, dot_precision,
                                     qk_scale_of)
from tritonllm.kernels.prefill_attention_hopper import HOPPER_TUNABLE, prefill_attention_hopper, supports

PATHS = ("auto", "portable", "hopper")
# "auto" takes the Hopper kernel from this much causal work a call (new tokens x longest query).
# Below it a call's GPU time is short and the Hopper launch's larger host time, which such
# host-bound steps pay in full, costs more than the kernel saves (bench/NOTES-prefill-attention.md).
HOPPER_MIN_WORK = 1 << 22


def enough_work_for_hopper(num_tokens: int, max_q_len: int) -> bool:
    """Whether a call of num_tokens new tokens, the longest query max_q_len, is long enough for "auto"
    to take the Hopper kernel (where it applies)."""
    return num_tokens * max_q_len >= HOPPER_MIN_WORK


@triton.jit(do_not_specialize=["stride_block_table"])  # the step's widest table: one compile for all
def _prefill_attention_kernel(
    q_ptr, k_cache, v_cache, k_scale_ptr, v_scale_ptr, o_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_block_table,
    stride_scale_block, stride_scale_token, stride_scale_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr, FP8: tl.constexpr,
    V_KEY_MAJOR: tl.constexpr,
):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    # Highest tiles first: they see the most keys, so the longest programs start earliest.
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q0 = tile * BLOCK_Q
    if q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys cached before the first new token

    rows = tl.arange(0, BLOCK_M)
    token = q0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    # BLOCK_M need not be a multiple of GROUP: rows past BLOCK_Q * GROUP are idle.
    row_mask = (rows < BLOCK_Q * GROUP) & (token < q_len)
    # Idle rows past q_len see the sequence's last key, so no row's mask reaches past seq_len.
    pos = tl.minimum(context + token, seq_len - 1)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + token).to(tl.int64) * stride_q_token + head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    elif FP8:
        q = fp8_dot_operand(q)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    head_offset = kv_head * stride_cache_head
    if FP8:
        k_scale_ptr += kv_head * stride_scale_head
        v_scale_ptr += kv_head * stride_scale_head

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    v_ref = tl.full([], 1.0, tl.float32)  # acc's unit (kernels/paged.py)
    # Keys [0, full_end) are visible to every row: the first row sits at position context + q0.
    full_end = (context + q0 + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i, v_ref = _attend_tile(acc, m_i, l_i, v_ref, q, k_cache, v_cache, k_scale_ptr, v_scale_ptr,
                                            block_table_row, head_offset, n0, seq_len, pos, qk_scale,
                                            stride_cache_block, stride_cache_token, stride_scale_block,
                                            stride_scale_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION,
                                            INTERPRET, TMA, FP8, V_KEY_MAJOR)
    # The diagonal: up to the last row's position (rows past q_len are idle, hence the clamp).
    diag_end = tl.minimum(seq_len, context + q0 + BLOCK_Q)
    for n0 in range(full_end, diag_end, BLOCK_N):
        acc, m_i, l_i, v_ref = _attend_tile(acc, m_i, l_i, v_ref, q, k_cache, v_cache, k_scale_ptr, v_scale_ptr,
                                            block_table_row, head_offset, n0, seq_len, pos, qk_scale,
                                            stride_cache_block, stride_cache_token, stride_scale_block,
                                            stride_scale_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION,
                                            INTERPRET, TMA, FP8, V_KEY_MAJOR)
    out = acc * (v_ref / l_i)[:, None]
    o_rows = (q_start + token).to(tl.int64) * stride_o_token + head * stride_o_head
    tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])


def _prefill_space(dtype_name, head_dim, group, block_size, q_len, cache_dtype_name=None):
    configs = []
    for block_m, num_warps in ((64, 4), (128, 4), (128, 8)):
        for block_n in (32, 64, 128):
            for num_stages in (2, 3):  # 4 never won a tuning run (bench/NOTES-prefill-attention.md)
                if block_m >= group:
                    configs.append({"BLOCK_M": block_m, "BLOCK_N": block_n,
                                    "num_warps": num_warps, "num_stages": num_stages})
    return configs


def _prefill_default(dtype_name, head_dim, group, block_size, q_len, cache_dtype_name=None):
    # Heads over 128 take 32-key tiles (16 in float32): wider ones need more than the 99 KB of shared
    # memory a block has on sm_86 and sm_89 (tests/kernels/test_compile.py).
    big_head = head_dim > 128
    if dtype_name == "float32":
        # Exact float32 products run on FMA, whose operands live in registers: small tiles, 8 warps.
        return {"BLOCK_M": max(32, triton.next_power_of_2(group)), "BLOCK_N": 16 if big_head else 32, "num_warps": 8,
                "num_stages": 2}
    # One warpgroup (4 warps) per tile of 128 rows for wgmma; at about 98 KB of shared memory two
    # programs share an SM and overlap each other's softmax and dots (8 warps lost in tuning, with
    # and without TMA: bench/NOTES-prefill-attention.md). Short queries and big heads take BLOCK_M 64.
    if cache_dtype_name is not None:
        # Over an e4m3 cache, 128 rows on 4 warps spill the converted K/V tiles; 64 rows do not. Each
        # tile of keys is converted once per program, so wide key tiles pay off from 64-token queries
        # (the prefill graphs' steps; bench/NOTES-prefill-attention.md).
        block_n = 32 if q_len <= 16 or big_head else 128
        return {"BLOCK_M": max(64, triton.next_power_of_2(group)), "BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}
    block_m = max(64 if big_head or q_len * group <= 64 else 128, triton.next_power_of_2(group))
    return {"BLOCK_M": block_m, "BLOCK_N": 128 if head_dim <= 64 else 32 if big_head else 64,
            "num_warps": 4 if block_m <= 128 else 8, "num_stages": 2 if big_head else 3}


PREFILL_TUNABLE = tuning.Tunable("prefill_attention", _prefill_space, _prefill_default)


def prefill_attention_bucket(dtype: torch.dtype, head_dim: int, group: int, block_size: int, max_q_len: int,
                             cache_dtype: torch.dtype | None = None, hopper: bool = False) -> tuple:
    """The tuning bucket of prefill_attention: q dtype, D, Hq / Hkv, cache block size, longest query
    (a power of two, at most 1024 for the portable kernel and 16384 for the Hopper one), then the
    cache dtype where it is not q's (float8_e4m3fn; None means q's)."""
    # Past 1k query rows the portable kernel's grid is long whatever the length: one bucket serves
    # them all. The persistent Hopper kernel's best key tile still grows with the length.
    longest = 16384 if hopper else 1024
    bucket = tuning.dtype_name(dtype), head_dim, group, block_size, min(tuning.pow2(max_q_len), longest)
    return bucket + cache_bucket(dtype, cache_dtype)


def _cache_descriptors(k_cache, v_cache, block_n, v_key_major):
    """TMA descriptors for BLOCK_N x D tiles of K (and V) viewed as [cache rows, Hkv * D], or None.
    A key-major V is viewed as [num_blocks * Hkv * D, block_size], its tiles D x BLOCK_N.

    None where a tile may span cache blocks (BLOCK_N > block_size), the caches are not contiguous
    (or key-major) or not 16-byte aligned, or the GPU has no TMA (before Hopper); the kernel then
    loads through pointers. CPU tensors (the interpreter, sm_90 compile checks) take the TMA path.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_n > block_size or not (k_cache.is_contiguous() and (v_key_major or v_cache.is_contiguous())):
        return None
    if k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        return None
    if k_cache.is_cuda and not tuning.has_tma(k_cache.device.index):
        return None
    shape = [num_blocks * block_size, num_kv_heads * head_dim]
    k_desc = TensorDescriptor(k_cache.view(shape), shape, [shape[1], 1], [block_n, head_dim])
    if not v_key_major:
        return k_desc, TensorDescriptor(v_cache.view(shape), shape, [shape[1], 1], [block_n, head_dim])
    v_shape = [num_blocks * num_kv_heads * head_dim, block_size]
    v_rows = v_cache.permute(0, 2, 3, 1).reshape(v_shape)  # the key-major memory itself, no copy
    return k_desc, TensorDescriptor(v_rows, v_shape, [block_size, 1], [head_dim, block_n])


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale=None, *,
                      max_q_len: int | None = None, out: torch.Tensor | None = None, config: dict | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, path: str = "auto"):
    """Causal attention of the new tokens of B sequences over the paged KV cache.

    q: [T, Hq, D] float32/float16/bfloat16, the new tokens of the B sequences packed one after the
    other (contiguous in D). k_cache, v_cache: [num_blocks, block_size, Hkv, D] (v_cache with
    k_cache's strides, or key-major beside a contiguous k_cache: kernels/kv_cache.py) of q's dtype, or
    float8_e4m3fn with k_scale, v_scale: float32 [num_blocks, block_size, Hkv] contiguous or
    head-major (kernels/fp8.empty_kv_scales), the scale of each stored row (its value is
    cache_row.float() * scale); the new tokens' K/V already stored; block_size a power of two; D a
    power of two >= 16; Hq a multiple of Hkv.
    cu_seqlens_q: [B + 1] int32, sequence b owns q rows cu[b] .. cu[b+1] - 1; B <= 65535.
    seq_lens: [B] int32, cached plus new tokens. block_tables: [B, max_blocks] int32, physical
    block of each logical block; entries past a sequence's length are never read.
    Query i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to every key at
    or before it. scale defaults to D ** -0.5; math in float32.

    max_q_len: at least the longest query (it sizes the grid, capped at T; a larger value only adds
    programs that exit at once); if None, one `.max().item()` reads it (a host sync, which a CUDA graph
    capture cannot take: the engine's prefill graphs pass it). out: optional [T, Hq, D] output buffer
    written in place. config: launch config overriding the tuned/default one (tests, benchmarks).
    path: "hopper" runs the warp-specialized Gluon kernel (kernels/prefill_attention_hopper.py; an
    sm_90 GPU, bf16/fp16 q and cache, plain layout), "portable" the Triton kernel of this file,
    "auto" (the default) the Hopper kernel wherever it applies and the call has at least
    HOPPER_MIN_WORK new tokens x max_q_len, else the portable one.
    Returns o [T, Hq, D] in q's dtype (`out` if given); nothing else is modified.
    """
    group, block_size, fp8, v_key_major = check_paged_inputs(q, k_cache, v_cache, seq_lens, block_tables, out,
                                                             k_scale, v_scale)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    applies = path != "portable" and supports(q, k_cache, v_cache, group, v_key_major, fp8)
    if path == "hopper" and not applies:
        raise ValueError("path='hopper' needs an sm_90 GPU, bf16/fp16 q and cache in the plain layout, q 16-byte "
                         "aligned with strides of multiples of 16 elements, D 64 or 128, block_size >= 16 and "
                         "Hq / Hkv <= 64")
    batch = seq_lens.shape[0]
    check_rows(batch + 1, (torch.int32,), cu_seqlens_q=cu_seqlens_q)
    if batch > MAX_GRID_YZ:
        raise ValueError(f"seq_lens holds {batch} sequences, at most {MAX_GRID_YZ} (the grid's second dimension)")
    out = torch.empty_like(q) if out is None else out
    if batch == 0 or q.shape[0] == 0 or q.shape[1] == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
        if max_q_len <= 0:
            return out
    elif max_q_len < 1:  # with queries, a bound below 1 would launch no program and leave out unwritten
        raise ValueError(f"max_q_len must be >= 1 (the longest query), got {max_q_len}")
    max_q_len = min(max_q_len, q.shape[0])  # no query is longer than all of them: a loose bound adds no programs
    hopper = applies and (path == "hopper" or enough_work_for_hopper(q.shape[0], max_q_len))
    head_dim = q.shape[2]
    num_kv_heads = k_cache.shape[2]
    qk_scale = qk_scale_of(scale, head_dim)

    def launch_portable(cfg):
        cfg = dict(cfg)
        block_q = cfg["BLOCK_M"] // group
        grid = (num_kv_heads, batch, triton.cdiv(max_q_len, block_q))
        if grid[2] > MAX_GRID_YZ:
            raise ValueError(f"a query of max_q_len {max_q_len} tokens needs {grid[2]} tiles of {block_q}, more than "
                             f"the grid's {MAX_GRID_YZ}: give the query in chunks or a config with a larger BLOCK_M")
        descriptors = _cache_descriptors(k_cache, v_cache, cfg["BLOCK_N"], v_key_major)
        _prefill_attention_kernel[grid](
            q, *(descriptors or (k_cache, v_cache)), k_scale, v_scale, out, cu_seqlens_q, seq_lens, block_tables,
            qk_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            *scale_strides(k_scale),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q,
            DOT_PRECISION=dot_precision(q.dtype), INTERPRET=tuning.INTERPRET, TMA=descriptors is not None,
            FP8=fp8, V_KEY_MAJOR=v_key_major, **cfg)

    def launch_hopper(cfg):
        prefill_attention_hopper(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, qk_scale, group,
                                 max_q_len, cfg)

    launch, tunable = (launch_hopper, HOPPER_TUNABLE) if hopper else (launch_portable, PREFILL_TUNABLE)
    bucket = prefill_attention_bucket(q.dtype, head_dim, group, block_size, max_q_len, k_cache.dtype, hopper)
    if config is None:
        config = tunable.config(bucket, launch)
    elif set(config) != set(tunable.default(*bucket)):
        raise ValueError(f"config of the {'hopper' if hopper else 'portable'} path takes the keys "
                         f"{sorted(tunable.default(*bucket))}, got {sorted(config)}")
    if config["BLOCK_M"] < group:
        raise ValueError(f"config BLOCK_M ({config['BLOCK_M']}) must be at least the GQA group ({group})")
    launch(config)
    return out
