"""Decode attention over an e4m3 cache as a one-warp Gluon kernel that stages nothing in shared memory.

Prototype (bench/NOTES-attention.md, twenty-second session): the same work and split scheme as
kernels/decode_attention.py's one-warp e4m3 programs, but K and V are loaded from global memory
straight into the mma_v2 operand layouts. A DotOperandLayout with k_width 16 (K) or BLOCK_N / 4
(V^T) gives each lane that many consecutive elements along the dot's K dimension, so the e4m3
bytes come as vector loads; both operands of a dot share the k_width, so the order in which the
MMA consumes K is the same on both sides and the sum is unchanged. The Triton kernel copies the
tiles to shared memory (cp.async) and reads them back into those layouts, and the sixteenth
session's ncu had its warps waiting on that shared memory most of the time. Latency is hidden by
occupancy alone: without shared memory, registers bound the programs an SM.

decode_attention launches it for a config with GLUON = 1 where `supports` holds (a CUDA GPU of
sm_80 or later, bf16/fp16 q over an e4m3 cache with a key-major V, blocks of at least 16 keys, D
64 or 128), with the same arguments, grid and split scratch as its Triton kernel; elsewhere that
config runs the Triton kernel.
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# One warp's mma.sync tiles: the dots' accumulators and, through DotOperandLayout, their operands.
MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])


@gluon.jit
def _gluon_split_len(  # decode_attention._split_len's rule (the merge kernel relies on it): Gluon cannot call it
        seq_len, NUM_SPLITS: gl.constexpr, SPLIT_MIN: gl.constexpr, BLOCK_N: gl.constexpr):
    splits = gl.maximum(gl.minimum(gl.cdiv(seq_len, SPLIT_MIN), NUM_SPLITS), 1)
    return gl.maximum(gl.cdiv(gl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N, BLOCK_N)


@gluon.jit
def _gluon_tile(acc, m_i, l_i, v_ref, qt, k_cache, v_cache, k_scale_ptr, v_scale_ptr, block_table_row, head_offset,
                n0, seq_len, qk_scale, stride_cache_block, stride_cache_token, stride_scale_block,
                stride_scale_token, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_H: gl.constexpr, MASKED: gl.constexpr, MMA: gl.constexpr):
    """scores^T = K q^T and acc^T += V^T p^T over keys n0 .. n0 + BLOCK_N - 1 (decode_attention._decode_tile)."""
    k_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=16)
    # The PV dot's K is the tile's keys: 4 lanes of V_WIDTH consecutive keys each span it exactly.
    V_WIDTH: gl.constexpr = min(BLOCK_N // 4, 16)
    v_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=V_WIDTH)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=V_WIDTH)
    rows: gl.constexpr = gl.SliceLayout(1, MMA)
    # K [BLOCK_N, D]: a lane's 16 consecutive D bytes of a key row are one vector load.
    k_keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, k_layout))
    k_blocks = gl.load(block_table_row + k_keys // BLOCK_SIZE, mask=k_keys < seq_len, other=0).to(gl.int64)
    k_rows = k_blocks * stride_cache_block + (k_keys % BLOCK_SIZE) * stride_cache_token + head_offset
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, k_layout))
    if MASKED:
        k = gl.load(k_cache + k_rows[:, None] + offs_d[None, :], mask=(k_keys < seq_len)[:, None], other=0.0)
    else:
        k = gl.load(k_cache + k_rows[:, None] + offs_d[None, :])
    # V^T [D, BLOCK_N] from the key-major V: a lane's V_WIDTH consecutive keys of a D row, one vector load.
    # Unmasked (padding keys read block 0); their columns are zeroed below.
    run: gl.constexpr = min(BLOCK_N, BLOCK_SIZE)
    v_keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, v_layout))
    v_blocks = gl.load(block_table_row + v_keys // BLOCK_SIZE, mask=v_keys < seq_len, other=0).to(gl.int64)
    v_cols = gl.max_contiguous(gl.multiple_of(v_blocks * stride_cache_block + v_keys % BLOCK_SIZE, run), run)
    v_rows = (gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, v_layout)) * BLOCK_SIZE) + head_offset * BLOCK_SIZE
    v = gl.load(v_cache + v_rows[:, None] + v_cols[None, :])

    keys = n0 + gl.arange(0, BLOCK_N, layout=rows)
    in_seq = keys < seq_len
    # K's rows are the scores' rows, lane for lane: the block ids move without data movement.
    scale_offsets = gl.convert_layout(k_blocks, rows) * stride_scale_block + (keys % BLOCK_SIZE) * stride_scale_token
    if MASKED:
        k_scales = gl.load(k_scale_ptr + scale_offsets, mask=in_seq, other=0.0)
        v_scales = gl.load(v_scale_ptr + scale_offsets, mask=in_seq, other=0.0)
    else:
        k_scales = gl.load(k_scale_ptr + scale_offsets)
        v_scales = gl.load(v_scale_ptr + scale_offsets)

    scores = mma_v2(k.to(gl.float16), qt, gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=MMA))
    scores = scores * (k_scales * qk_scale)[:, None]
    if MASKED:
        scores = gl.where(in_seq[:, None], scores, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, 0))
    p = gl.exp2(scores - m_new[None, :])
    alpha = gl.exp2(m_i - m_new)
    v_max = gl.max(v_scales, 0)
    v_max = gl.where(v_max == 0.0, 1.0, v_max)
    p_v = gl.convert_layout((p * (v_scales / v_max)[:, None]).to(gl.float16), p_layout)
    v = v.to(gl.float16)
    if MASKED:
        v = gl.where((v_keys < seq_len)[None, :], v, 0.0)
    acc = mma_v2(v, p_v, acc * (alpha * (v_ref / v_max))[None, :])
    l_i = l_i * alpha + gl.sum(p, 0)
    return acc, m_new, l_i, v_max


@gluon.jit(do_not_specialize=["stride_block_table"])
def _decode_attention_gluon_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, o_ptr, acc_ptr, m_ptr, l_ptr, seq_lens_ptr,
    block_tables_ptr, qk_scale, num_q_heads,
    stride_q_batch, stride_q_head, stride_o_batch, stride_o_head,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_block_table,
    stride_scale_block, stride_scale_token, stride_scale_head,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, NUM_SPLITS: gl.constexpr, SPLIT_MIN: gl.constexpr, MMA: gl.constexpr,
):
    split = gl.program_id(0)
    kv_head = gl.program_id(1)
    seq = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + seq)
    split_len = _gluon_split_len(seq_len, NUM_SPLITS, SPLIT_MIN, BLOCK_N)
    start = split * split_len
    if NUM_SPLITS > 1:
        if start >= seq_len:
            return
    end = gl.minimum(start + split_len, seq_len)

    # q^T [D, BLOCK_H] as the B operand of the K dot (k_width 16, as K's), a bfloat16 q as float16.
    qt_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=16)
    q_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, qt_layout))
    q_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, qt_layout))
    q_offsets = seq.to(gl.int64) * stride_q_batch + (kv_head * GROUP + q_h) * stride_q_head
    qt = gl.load(q_ptr + q_offsets[None, :] + q_d[:, None], mask=(q_h < GROUP)[None, :], other=0.0).to(gl.float16)
    block_table_row = block_tables_ptr + seq.to(gl.int64) * stride_block_table
    head_offset = kv_head * stride_cache_head
    k_scale_ptr += kv_head * stride_scale_head
    v_scale_ptr += kv_head * stride_scale_head

    heads: gl.constexpr = gl.SliceLayout(0, MMA)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=heads)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=heads)
    acc = gl.zeros([HEAD_DIM, BLOCK_H], gl.float32, layout=MMA)
    v_ref = gl.to_tensor(1.0)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i, v_ref = _gluon_tile(acc, m_i, l_i, v_ref, qt, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                           v_scale_ptr, block_table_row, head_offset, n0, seq_len, qk_scale,
                                           stride_cache_block, stride_cache_token, stride_scale_block,
                                           stride_scale_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_H, False, MMA)
    for n0 in range(full_end, end, BLOCK_N):
        acc, m_i, l_i, v_ref = _gluon_tile(acc, m_i, l_i, v_ref, qt, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                           v_scale_ptr, block_table_row, head_offset, n0, seq_len, qk_scale,
                                           stride_cache_block, stride_cache_token, stride_scale_block,
                                           stride_scale_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_H, True, MMA)
    acc = acc * v_ref

    o_h = gl.arange(0, BLOCK_H, layout=heads)
    o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, MMA))
    head = kv_head * GROUP + o_h
    if NUM_SPLITS == 1:
        out = acc / gl.where(l_i == 0.0, 1.0, l_i)[None, :]
        o_offsets = seq.to(gl.int64) * stride_o_batch + head * stride_o_head
        gl.store(o_ptr + o_offsets[None, :] + o_d[:, None], out.to(o_ptr.dtype.element_ty),
                 mask=(o_h < GROUP)[None, :])
    else:
        slot = (seq.to(gl.int64) * num_q_heads + head) * NUM_SPLITS + split
        gl.store(acc_ptr + slot[None, :] * HEAD_DIM + o_d[:, None], acc, mask=(o_h < GROUP)[None, :])
        gl.store(m_ptr + slot, m_i, mask=o_h < GROUP)
        gl.store(l_ptr + slot, l_i, mask=o_h < GROUP)


@functools.cache
def _has_mma_v2(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def supports(q: torch.Tensor, fp8: bool, v_key_major: bool, block_size: int) -> bool:
    """Whether the Gluon kernel takes these decode inputs (else GLUON configs run the Triton kernel)."""
    return (q.is_cuda and fp8 and v_key_major and block_size >= 16 and q.dtype in (torch.bfloat16, torch.float16)
            and q.shape[2] in (64, 128) and _has_mma_v2(q.device.index))


def decode_attention_gluon(grid: tuple, args: tuple, shape: dict, config: dict) -> None:
    """Launch the Gluon kernel over `grid` with decode_attention's Triton kernel arguments: `args` its
    positional ones (q, caches, scales, out, split scratch, lengths, tables, scale, strides), `shape`
    GROUP, HEAD_DIM, BLOCK_SIZE and BLOCK_H; config: BLOCK_N (16, 32 or 64), NUM_SPLITS, SPLIT_MIN,
    optional maxnreg (num_warps and num_stages are ignored: one warp, no pipeline). Writes o, or the
    splits' scratch that decode_attention's merge kernel combines, in place."""
    config = {key: value for key, value in config.items() if key not in ("num_warps", "num_stages", "GLUON")}
    _decode_attention_gluon_kernel[grid](*args, **shape, MMA=MMA, num_warps=1, **config)
