"""Decode attention (one new token per sequence) over the paged KV cache, split-KV flash-decoding.

Decode is bound by reading K/V. One program per (sequence, KV head, split) handles the G query
heads of its KV head over one contiguous segment of the keys, so each K/V byte is read once. Its
dots are transposed (`_decode_tile`): keys are the MMA's M, the G heads its N padded to BLOCK_H >= 8
(fewer instructions a key than heads as M padded to 16). The grid is fixed by the shapes (CUDA-graph
capturable): NUM_SPLITS splits per (sequence, KV head), chosen on the host from B, Hkv, the context
bound and the SM count; a sequence uses min(NUM_SPLITS, cdiv(len, SPLIT_MIN)) of them (computed on
the GPU), the others exit at once. Splits run fastest and sequences slowest, so a batch ordered
longest row first (the engine's) starts its longest programs first and fills the last wave with
short ones. Splits write an unnormalized accumulator, row max and row sum to float32 scratch that a
second launch merges; with NUM_SPLITS == 1 the first launch writes o. An e4m3 cache (k_scale /
v_scale given) halves the K/V bytes, each tile also reading its keys' scales (kernels/paged.py);
there a program is one warp by default: the conversions cost instructions, and one-warp tiles
reduce over keys with shuffles instead of barriers while more programs an SM keep loads in flight.
"""
import torch
import triton
import triton.language as tl

from tritonllm.kernels import tuning
from tritonllm.kernels.fp8 import block_scale_offsets, fp8_dot_operand, from_e4m3, scale_strides
from tritonllm.kernels.paged import (MAX_GRID_YZ, _key_blocks, _key_major_keys, _load_scales, _relative_v_scales,
                                    cache_bucket, check_paged_inputs, dot_precision, qk_scale_of)

PROGRAMS_PER_SM = 3  # resident programs per SM that hide memory latency without extra splits
FP8_PROGRAMS_PER_SM = 6  # one-warp programs over an e4m3 cache: twice as many an SM keep bytes in flight
ONE_WARP_MAX_BATCH = 8  # up to this many rows the bf16 tuning space also holds one-warp tiles
MAX_BATCH = MAX_GRID_YZ  # sequences are the grid's third dimension
MERGE_BLOCK_D = 64  # head-dim columns a merge program takes


@triton.jit
def _split_len(seq_len, NUM_SPLITS: tl.constexpr, SPLIT_MIN: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of one sequence: a multiple of BLOCK_N, about SPLIT_MIN or more, at most NUM_SPLITS splits."""
    splits = tl.maximum(tl.minimum(tl.cdiv(seq_len, SPLIT_MIN), NUM_SPLITS), 1)
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N, BLOCK_N)


@triton.jit
def _key_major_v_tile(v_cache, block_table_row, block, in_block, head_offset, n0, seq_len, stride_cache_block,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """V^T [D, BLOCK_N] of keys n0 .. n0 + BLOCK_N - 1 from a key-major V (block, in_block: _key_blocks').

    A head's D x BLOCK_SIZE values in a block are one contiguous run. Where a tile spans several
    blocks it is loaded as [blocks, D * BLOCK_SIZE] runs, so a warp reads consecutive D rows of one
    block: loaded as [D, BLOCK_N] the lanes would spread over the blocks, each taking a BLOCK_SIZE
    piece of a row, and small blocks would use half of every 32-byte sector each request fetches.
    """
    if BLOCK_N <= BLOCK_SIZE:
        key_offsets = _key_major_keys(block, in_block, stride_cache_block, BLOCK_SIZE, BLOCK_N)
        v = tl.load(v_cache + key_offsets[None, :] + head_offset * BLOCK_SIZE
                    + (tl.arange(0, HEAD_DIM) * BLOCK_SIZE)[:, None])
    else:
        BLOCKS: tl.constexpr = BLOCK_N // BLOCK_SIZE
        offs_b = tl.arange(0, BLOCKS)
        blocks = tl.load(block_table_row + n0 // BLOCK_SIZE + offs_b, mask=n0 + offs_b * BLOCK_SIZE < seq_len,
                         other=0).to(tl.int64)
        runs = tl.load(v_cache + (blocks * stride_cache_block + head_offset * BLOCK_SIZE)[:, None]
                       + tl.arange(0, HEAD_DIM * BLOCK_SIZE)[None, :])
        v = tl.reshape(tl.permute(tl.reshape(runs, (BLOCKS, HEAD_DIM, BLOCK_SIZE)), (1, 0, 2)), (HEAD_DIM, BLOCK_N))
    return v


@triton.jit
def _decode_tile(acc, m_i, l_i, v_ref, qt, k_cache, v_cache, k_scale_ptr, v_scale_ptr, block_table_row, head_offset,
                 n0, seq_len, qk_scale, stride_cache_block, stride_cache_token, stride_scale_block,
                 stride_scale_token, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, FP8: tl.constexpr,
                 V_KEY_MAJOR: tl.constexpr):
    """One online-softmax step of the heads over keys n0 .. n0 + BLOCK_N - 1, with the dots transposed.

    scores^T [BLOCK_N, BLOCK_H] = K . q^T and acc^T [D, BLOCK_H] += V^T . p^T: the keys are the MMA's
    M and the few heads its N, which pads to 8 where an M pads to 16, and a key-major V is V^T as
    stored. qt is q^T [D, BLOCK_H]; m_i, l_i [BLOCK_H] and v_ref as kernels/paged._attend_tile's.
    MASKED: keys at or past seq_len count for nothing (only a sequence's last tile is partial).
    """
    keys = n0 + tl.arange(0, BLOCK_N)
    in_seq = keys < seq_len
    block, in_block = _key_blocks(block_table_row, n0, seq_len, BLOCK_SIZE, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_offsets = (block * stride_cache_block + in_block * stride_cache_token)[:, None] + head_offset + offs_d[None, :]
    if MASKED:
        k = tl.load(k_cache + k_offsets, mask=in_seq[:, None], other=0.0)
    else:
        k = tl.load(k_cache + k_offsets)
    row_scale = qk_scale
    if FP8:
        k = from_e4m3(k, qt.dtype, INTERPRET)
        scale_offsets = block_scale_offsets(block, in_block, stride_scale_block, stride_scale_token)
        row_scale = (_load_scales(k_scale_ptr, scale_offsets, in_seq, MASKED) * qk_scale)[:, None]
    elif INTERPRET:
        k = k.to(tl.float32)  # the interpreter's tl.dot multiplies raw bfloat16 bits
    scores = tl.dot(k, qt, input_precision=DOT_PRECISION) * row_scale
    if MASKED:
        scores = tl.where(in_seq[:, None], scores, float("-inf"))
    # Every split holds at least one key by its first tile, so m_new is finite and no NaN arises.
    m_new = tl.maximum(m_i, tl.max(scores, 0))
    p = tl.math.exp2(scores - m_new[None, :])
    alpha = tl.math.exp2(m_i - m_new)
    if V_KEY_MAJOR:
        # Unmasked even past the sequence's end (as kernels/paged._attend_tile): padding keys read
        # block 0, and their columns are zeroed below.
        v = _key_major_v_tile(v_cache, block_table_row, block, in_block, head_offset, n0, seq_len,
                              stride_cache_block, HEAD_DIM, BLOCK_SIZE, BLOCK_N)
    elif MASKED:
        v = tl.load(v_cache + tl.trans(k_offsets), mask=in_seq[None, :], other=0.0)
    else:
        v = tl.load(v_cache + tl.trans(k_offsets))
    if FP8:
        v = from_e4m3(v, qt.dtype, INTERPRET)
    elif INTERPRET:
        v = v.to(tl.float32)
    if V_KEY_MAJOR and MASKED:
        v = tl.where(in_seq[None, :], v, 0.0)  # p is 0 there, 0 * NaN is not
    if FP8:
        # The V scales go on p's rows (keys), relative to the tile's largest; acc in units of v_ref.
        v_rel, v_max = _relative_v_scales(v_scale_ptr, scale_offsets, in_seq, MASKED)
        p_v = p * v_rel[:, None]
        acc = tl.dot(v, p_v.to(v.dtype), acc * (alpha * (v_ref / v_max))[None, :], input_precision=DOT_PRECISION)
        v_ref = v_max
    else:
        acc = tl.dot(v, p.to(v.dtype), acc * alpha[None, :], input_precision=DOT_PRECISION)
    l_i = l_i * alpha + tl.sum(p, 0)
    return acc, m_new, l_i, v_ref


@triton.jit(do_not_specialize=["stride_block_table"])  # eager steps: the widest table varies
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, o_ptr, acc_ptr, m_ptr, l_ptr, seq_lens_ptr,
    block_tables_ptr, qk_scale, num_q_heads,
    stride_q_batch, stride_q_head, stride_o_batch, stride_o_head,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_block_table,
    stride_scale_block, stride_scale_token, stride_scale_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_MIN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, FP8: tl.constexpr, V_KEY_MAJOR: tl.constexpr,
):
    # Split fastest, sequence slowest: programs start in row order, a row's all together.
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, NUM_SPLITS, SPLIT_MIN, BLOCK_N)
    start = split * split_len
    if NUM_SPLITS > 1:
        if start >= seq_len:
            return  # an unused split: the merge reads only the splits that hold keys
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows
    row_mask = rows < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = seq.to(tl.int64) * stride_q_batch + head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    elif FP8:
        q = fp8_dot_operand(q)
    qt = tl.trans(q)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    head_offset = kv_head * stride_cache_head
    if FP8:
        k_scale_ptr += kv_head * stride_scale_head
        v_scale_ptr += kv_head * stride_scale_head

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)  # transposed: see _decode_tile
    v_ref = tl.full([], 1.0, tl.float32)  # acc's unit (kernels/paged.py)
    # start and split_len are multiples of BLOCK_N, so only the sequence's last tile is partial.
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i, v_ref = _decode_tile(acc, m_i, l_i, v_ref, qt, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                            v_scale_ptr, block_table_row, head_offset, n0, seq_len, qk_scale,
                                            stride_cache_block, stride_cache_token, stride_scale_block,
                                            stride_scale_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION,
                                            INTERPRET, FP8, V_KEY_MAJOR)
    for n0 in range(full_end, end, BLOCK_N):
        acc, m_i, l_i, v_ref = _decode_tile(acc, m_i, l_i, v_ref, qt, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                            v_scale_ptr, block_table_row, head_offset, n0, seq_len, qk_scale,
                                            stride_cache_block, stride_cache_token, stride_scale_block,
                                            stride_scale_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION,
                                            INTERPRET, FP8, V_KEY_MAJOR)
    acc = tl.trans(acc * v_ref)

    if NUM_SPLITS == 1:
        # seq_len 0 (a padding row of a captured batch) leaves l = 0 and acc = 0: write zeros.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = seq.to(tl.int64) * stride_o_batch + head * stride_o_head
        tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        slot = (seq.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + split
        tl.store(acc_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask[:, None])
        tl.store(m_ptr + slot, m_i, mask=row_mask)
        tl.store(l_ptr + slot, l_i, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    acc_ptr, m_ptr, l_ptr, seq_lens_ptr, o_ptr, num_q_heads, stride_o_batch, stride_o_head,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT_MIN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # A program a (sequence, head, BLOCK_D columns): whole rows spilled registers at 198 splits.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The same split rule as the attention launch: splits at or past `used` were never written.
    used = tl.cdiv(seq_len, _split_len(seq_len, NUM_SPLITS, SPLIT_MIN, BLOCK_N))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    valid = offs_s < used
    slot = (seq.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(m_ptr + slot, mask=valid, other=float("-inf"))
    l = tl.load(l_ptr + slot, mask=valid, other=0.0)
    acc = tl.load(acc_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)
    m_max = tl.max(m, 0)
    # No split used (seq_len 0): weights become exp2(-inf) = 0 and the output zeros.
    weight = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(weight * l, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    o_offsets = seq.to(tl.int64) * stride_o_batch + head * stride_o_head + offs_d
    tl.store(o_ptr + o_offsets, out.to(o_ptr.dtype.element_ty))


def num_sms() -> int:
    """SMs of the current GPU; 1 under the interpreter, where every program runs serially."""
    if tuning.INTERPRET or not torch.cuda.is_available():
        return 1
    return tuning.sm_count(torch.cuda.current_device())


def default_num_splits(batch, num_kv_heads, context, split_min, sms, programs_per_sm=PROGRAMS_PER_SM):
    """Splits per (sequence, KV head): about programs_per_sm programs per SM, >= split_min keys each."""
    wanted = triton.cdiv(programs_per_sm * sms, batch * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(context, split_min)))


def _decode_space(dtype_name, head_dim, group, num_kv_heads, block_size, batch, context, cache_dtype_name=None):
    default = _decode_default(dtype_name, head_dim, group, num_kv_heads, block_size, batch, context, cache_dtype_name)

    def around(n):  # the split counts tried about n
        return sorted({max(1, n // 2), n, n * 2})

    splits = around(default["NUM_SPLITS"])
    # One-warp programs of 16 keys a tile, capped at 128 registers so that 16 fit an SM's registers
    # (an e4m3 tile's stages take 10.7 KiB of shared memory); their splits may be as short as 64 keys.
    short_tile = {"BLOCK_N": 16, "num_warps": 1, "maxnreg": 128, "SPLIT_MIN": 64}
    if default["num_warps"] > 1:
        # Bandwidth-bound: what matters is bytes in flight per SM (tile size) and the split count;
        # the stage count barely moves the time (bench/NOTES-decode-attention.md).
        four_warps = [default | {"BLOCK_N": block_n, "NUM_SPLITS": num_splits, "num_stages": 3}
                      for block_n in (32, 64, 128) for num_splits in splits]
        if dtype_name == "float32" or batch > ONE_WARP_MAX_BATCH:
            return four_warps
        # A few rows: many short one-warp programs (the e4m3 cache's short tile) keep more loads in flight.
        n = default_num_splits(batch, num_kv_heads, context, 64, num_sms(), FP8_PROGRAMS_PER_SM)
        return four_warps + [default | short_tile | {"NUM_SPLITS": num_splits, "num_stages": stages}
                             for stages in (4, 5) for num_splits in around(n)]
    # e4m3: one-warp tiles of 16 or 32 keys, and the four-warp 128-key tiles they replaced (barriers for
    # their cross-warp reductions). A one-warp program waits on its own instruction chain more than on
    # memory, so programs an SM set its speed; where fewer share an SM, a fifth stage keeps bytes in flight.
    one_warp = [default | {"BLOCK_N": block_n, "NUM_SPLITS": num_splits, "num_stages": stages} | extra
                for block_n, stages, extra in ((16, 4, {}), (32, 2, {}), (32, 3, {}), (32, 4, {}),
                                               (32, 2, {"maxnreg": 128}), (16, 4, short_tile), (16, 5, short_tile))
                for num_splits in splits]
    four_warps = [default | {"BLOCK_N": 128, "NUM_SPLITS": num_splits, "num_warps": 4, "num_stages": stages,
                             "SPLIT_MIN": 256}
                  for num_splits in sorted({max(1, n // 2) for n in splits[-2:]}) for stages in (2, 3)]
    return one_warp + four_warps


def _decode_default(dtype_name, head_dim, group, num_kv_heads, block_size, batch, context, cache_dtype_name=None):
    if dtype_name == "float32":  # FMA dot (exact products): operands in registers, more warps
        config = {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "SPLIT_MIN": 256}
    elif cache_dtype_name is None:  # q's dtype
        config = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "SPLIT_MIN": 256}
    else:  # a one-warp program's tile is short: shorter splits keep small batches parallel
        config = {"BLOCK_N": 32, "num_warps": 1, "num_stages": 3, "SPLIT_MIN": 128}
    programs_per_sm = FP8_PROGRAMS_PER_SM if config["num_warps"] == 1 else PROGRAMS_PER_SM
    num_splits = default_num_splits(batch, num_kv_heads, context, config["SPLIT_MIN"], num_sms(), programs_per_sm)
    return config | {"NUM_SPLITS": num_splits}


DECODE_TUNABLE = tuning.Tunable("decode_attention", _decode_space, _decode_default)


def decode_attention_bucket(dtype: torch.dtype, head_dim: int, group: int, num_kv_heads: int, block_size: int,
                            batch: int, context: int, cache_dtype: torch.dtype | None = None) -> tuple:
    """The tuning bucket of decode_attention: q dtype, D, Hq / Hkv, Hkv, cache block size, B and the
    context bound (max_seq_len, or the block table's capacity), then the cache dtype where it is
    not q's (float8_e4m3fn; None means q's)."""
    bucket = (tuning.dtype_name(dtype), head_dim, group, num_kv_heads, block_size, tuning.pow2(batch),
              tuning.pow2(context))
    return bucket + cache_bucket(dtype, cache_dtype)


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale=None, *,
                     max_seq_len: int | None = None, out: torch.Tensor | None = None, config: dict | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None):
    """Attention of one new token per sequence over the paged KV cache; CUDA-graph capturable.

    q: [B, Hq, D] float32/float16/bfloat16 (contiguous in D). k_cache, v_cache: [num_blocks,
    block_size, Hkv, D] (v_cache with k_cache's strides, or key-major beside a contiguous k_cache:
    kernels/kv_cache.py) of q's dtype, or float8_e4m3fn with k_scale, v_scale: float32 [num_blocks,
    block_size, Hkv] contiguous or head-major (kernels/fp8.empty_kv_scales), the scale of each stored
    row (its value is cache_row.float() * scale); the new token's K/V already stored; block_size a
    power of two; D a power of two >= 16; Hq a multiple of Hkv. seq_lens: [B] int32, sequence b
    attends to keys [0, seq_lens[b]); a length of 0 (a padding row) gives zeros; B <= 65535, and
    rows ordered longest first finish soonest (the GPU starts them in order). block_tables: [B,
    max_blocks] int32; entries past a sequence's length are never read. scale defaults to D ** -0.5;
    math in float32.

    No host sync and a grid fixed by (B, Hq, Hkv, D, block_size, dtypes, context bound): the split
    count is chosen from the context bound, `max_seq_len` if given (the engine's max_model_len),
    else block_tables.shape[1] * block_size. Any seq_lens up to the table's capacity are correct
    whatever the bound; the bound only steers the split count. Float32 scratch for the splits is
    allocated per call with a shape fixed by B (the caching allocator serves it under capture).
    out: optional [B, Hq, D] output buffer written in place. config: launch config overriding the
    tuned/default one (tests, benchmarks). Returns o [B, Hq, D] in q's dtype (`out` if given).
    """
    group, block_size, fp8, v_key_major = check_paged_inputs(q, k_cache, v_cache, seq_lens, block_tables, out,
                                                             k_scale, v_scale)
    batch, num_q_heads, head_dim = q.shape
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [B = {batch}], got shape {tuple(seq_lens.shape)}")
    if batch > MAX_BATCH:
        raise ValueError(f"q's batch must be at most {MAX_BATCH} (the grid's third dimension), got {batch}")
    out = torch.empty_like(q) if out is None else out
    if batch == 0 or num_q_heads == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    context = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    qk_scale = qk_scale_of(scale, head_dim)

    def launch(cfg):
        cfg = dict(cfg)
        num_splits = cfg["NUM_SPLITS"]
        if num_splits > 1:
            scratch = q.new_empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32)
            m = q.new_empty((batch, num_q_heads, num_splits), dtype=torch.float32)
            l = torch.empty_like(m)
        else:
            scratch = m = l = out  # not touched with one split
        _decode_attention_kernel[(num_splits, num_kv_heads, batch)](
            q, k_cache, v_cache, k_scale, v_scale, out, scratch, m, l, seq_lens, block_tables, qk_scale, num_q_heads,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            *scale_strides(k_scale),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_H=max(8, triton.next_power_of_2(group)),
            DOT_PRECISION=dot_precision(q.dtype), INTERPRET=tuning.INTERPRET, FP8=fp8,
            V_KEY_MAJOR=v_key_major, **cfg)
        if num_splits > 1:
            block_d = min(MERGE_BLOCK_D, head_dim)
            _merge_splits_kernel[(batch, num_q_heads, head_dim // block_d)](
                scratch, m, l, seq_lens, out, num_q_heads, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
                SPLIT_MIN=cfg["SPLIT_MIN"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d)

    bucket = decode_attention_bucket(q.dtype, head_dim, group, num_kv_heads, block_size, batch, context, k_cache.dtype)
    if config is None:
        config = DECODE_TUNABLE.config(bucket, tuning.graph_replay(launch) if q.is_cuda else launch)
    elif set(config) - {"maxnreg"} not in DECODE_TUNABLE.bucket_key_sets(bucket):
        raise ValueError(f"config takes the keys {sorted(DECODE_TUNABLE.default(*bucket))} (and maxnreg), got "
                         f"{sorted(config)}")
    launch(config)
    return out
