"""Prototype: stream-K decode attention. Each KV head's tiles of all rows, concatenated in row order,
are cut into equal runs, one run a program, over a grid of about PROGRAMS_PER_SM programs an SM:
one wave, equal work. A run that covers a whole row writes o; a row cut between runs is merged
by a second launch from the (at most two) partials each program leaves."""
import torch
import triton
import triton.language as tl

from tritonllm.kernels import tuning
from tritonllm.kernels.decode_attention import _decode_tile, num_sms
from tritonllm.kernels.fp8 import fp8_dot_operand, scale_strides
from tritonllm.kernels.paged import LOG2E, check_paged_inputs, dot_precision


@triton.jit
def _runs(seq_lens_ptr, batch, num_programs, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(seq_lens_ptr + offs_b, mask=offs_b < batch, other=0)
    tiles = tl.cdiv(lens, BLOCK_N)
    ends = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    per_program = tl.maximum(tl.cdiv(total, num_programs), MIN_TILES)
    return offs_b, lens, tiles, ends, total, per_program


@triton.jit
def _lean_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, o_ptr, acc_ptr, m_ptr, l_ptr, seq_lens_ptr,
    block_tables_ptr, qk_scale, num_q_heads, batch, num_programs,
    stride_q_batch, stride_q_head, stride_o_batch, stride_o_head,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_block_table,
    stride_scale_block, stride_scale_token, stride_scale_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, MIN_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, FP8: tl.constexpr, V_KEY_MAJOR: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_b, lens, tiles, ends, total, per_program = _runs(seq_lens_ptr, batch, num_programs, BLOCK_B, BLOCK_N,
                                                          MIN_TILES)
    start = pid * per_program
    end = tl.minimum(start + per_program, total)
    row = tl.sum((ends <= start).to(tl.int32), 0)
    # The batch-wide vectors end here: rows after the first are followed one scalar load each.
    row_end = tl.sum(tl.where(offs_b == row, ends, 0), 0)
    seq_len = tl.sum(tl.where(offs_b == row, lens, 0), 0)
    row_begin = row_end - tl.cdiv(seq_len, BLOCK_N)

    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows
    row_mask = rows < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    head_offset = kv_head * stride_cache_head
    if FP8:
        k_scale_ptr += kv_head * stride_scale_head
        v_scale_ptr += kv_head * stride_scale_head
    t = start
    while t < end:
        seg_end = tl.minimum(end, row_end)
        if seg_end > t:
            q_rows = row.to(tl.int64) * stride_q_batch + head * stride_q_head
            q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0)
            if INTERPRET:
                q = q.to(tl.float32)
            elif FP8:
                q = fp8_dot_operand(q)
            qt = tl.trans(q)
            block_table_row = block_tables_ptr + row.to(tl.int64) * stride_block_table
            key_begin = (t - row_begin) * BLOCK_N
            key_end = tl.minimum((seg_end - row_begin) * BLOCK_N, seq_len)
            full_end = tl.minimum(key_end, seq_len // BLOCK_N * BLOCK_N)
            m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)
            v_ref = tl.full([], 1.0, tl.float32)
            for n0 in range(key_begin, full_end, BLOCK_N):
                acc, m_i, l_i, v_ref = _decode_tile(acc, m_i, l_i, v_ref, qt, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                                    v_scale_ptr, block_table_row, head_offset, n0, seq_len, qk_scale,
                                                    stride_cache_block, stride_cache_token, stride_scale_block,
                                                    stride_scale_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False,
                                                    DOT_PRECISION, INTERPRET, FP8, V_KEY_MAJOR)
            for n0 in range(tl.maximum(full_end, key_begin), key_end, BLOCK_N):
                acc, m_i, l_i, v_ref = _decode_tile(acc, m_i, l_i, v_ref, qt, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                                    v_scale_ptr, block_table_row, head_offset, n0, seq_len, qk_scale,
                                                    stride_cache_block, stride_cache_token, stride_scale_block,
                                                    stride_scale_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True,
                                                    DOT_PRECISION, INTERPRET, FP8, V_KEY_MAJOR)
            acc = tl.trans(acc * v_ref)
            if (t == row_begin) & (seg_end == row_end):
                out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
                o_rows = row.to(tl.int64) * stride_o_batch + head * stride_o_head
                tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                         mask=row_mask[:, None])
            else:
                which = (t != start).to(tl.int64)
                slot = (pid.to(tl.int64) * 2 + which) * num_q_heads + head
                tl.store(acc_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_mask[:, None])
                tl.store(m_ptr + slot, m_i, mask=row_mask)
                tl.store(l_ptr + slot, l_i, mask=row_mask)
        t = tl.maximum(seg_end, t)
        row += 1
        seq_len = tl.load(seq_lens_ptr + row, mask=row < batch, other=0)
        row_begin = row_end
        row_end += tl.cdiv(seq_len, BLOCK_N)


@triton.jit
def _flat_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, o_ptr, acc_ptr, m_ptr, l_ptr, seq_lens_ptr,
    block_tables_ptr, qk_scale, num_q_heads, batch, num_programs,
    stride_q_batch, stride_q_head, stride_o_batch, stride_o_head,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_block_table,
    stride_scale_block, stride_scale_token, stride_scale_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, MIN_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, FP8: tl.constexpr, V_KEY_MAJOR: tl.constexpr,
):
    # One loop over the program's tiles, rows found from the tile index alone (no loop-carried row
    # state), so the pipeliner prefetches across row boundaries.
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_b, lens, tiles, ends, total, per_program = _runs(seq_lens_ptr, batch, num_programs, BLOCK_B, BLOCK_N,
                                                          MIN_TILES)
    begins = ends - tiles
    start = pid * per_program
    end = tl.minimum(start + per_program, total)
    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows
    row_mask = rows < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    head_offset = kv_head * stride_cache_head
    if FP8:
        k_scale_ptr += kv_head * stride_scale_head
        v_scale_ptr += kv_head * stride_scale_head
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)
    v_ref = tl.full([], 1.0, tl.float32)
    for i in range(start, end):
        contain = (begins <= i) & (i < ends)
        row = tl.sum(tl.where(contain, offs_b, 0), 0)
        row_begin = tl.sum(tl.where(contain, begins, 0), 0)
        row_end = tl.sum(tl.where(contain, ends, 0), 0)
        seq_len = tl.sum(tl.where(contain, lens, 0), 0)
        fresh = (i == row_begin) | (i == start)
        m_i = tl.where(fresh, float("-inf"), m_i)
        l_i = tl.where(fresh, 0.0, l_i)
        q_rows = row.to(tl.int64) * stride_q_batch + head * stride_q_head
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0)
        if INTERPRET:
            q = q.to(tl.float32)
        elif FP8:
            q = fp8_dot_operand(q)
        block_table_row = block_tables_ptr + row.to(tl.int64) * stride_block_table
        acc, m_i, l_i, v_ref = _decode_tile(acc, m_i, l_i, v_ref, tl.trans(q), k_cache_ptr, v_cache_ptr, k_scale_ptr,
                                            v_scale_ptr, block_table_row, head_offset, (i - row_begin) * BLOCK_N,
                                            seq_len, qk_scale, stride_cache_block, stride_cache_token,
                                            stride_scale_block, stride_scale_token, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
                                            True, DOT_PRECISION, INTERPRET, FP8, V_KEY_MAJOR)
        if (i == row_end - 1) | (i == end - 1):
            out = tl.trans(acc * v_ref)
            if (row_begin >= start) & (i == row_end - 1):
                out = out / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
                o_rows = row.to(tl.int64) * stride_o_batch + head * stride_o_head
                tl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                         mask=row_mask[:, None])
            else:
                slot = (pid.to(tl.int64) * 2 + (row_begin > start).to(tl.int64)) * num_q_heads + head
                tl.store(acc_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_mask[:, None])
                tl.store(m_ptr + slot, m_i, mask=row_mask)
                tl.store(l_ptr + slot, l_i, mask=row_mask)


@triton.jit
def _lean_merge_kernel(acc_ptr, m_ptr, l_ptr, seq_lens_ptr, o_ptr, num_q_heads, batch, num_programs,
                       stride_o_batch, stride_o_head, HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr,
                       BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, BLOCK_D: tl.constexpr,
                       CHUNK: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_b, lens, tiles, ends, total, per_program = _runs(seq_lens_ptr, batch, num_programs, BLOCK_B, BLOCK_N,
                                                          MIN_TILES)
    pick = offs_b == seq
    row_end = tl.sum(tl.where(pick, ends, 0), 0)
    row_begin = row_end - tl.sum(tl.where(pick, tiles, 0), 0)
    o_offsets = seq.to(tl.int64) * stride_o_batch + head * stride_o_head + offs_d
    if row_end == row_begin:
        tl.store(o_ptr + o_offsets, tl.zeros([BLOCK_D], tl.float32).to(o_ptr.dtype.element_ty))
    else:
        p_first = row_begin // per_program
        p_last = (row_end - 1) // per_program
        if p_last > p_first:
            m_run = tl.full([], float("-inf"), tl.float32)
            l_run = tl.zeros([], tl.float32)
            acc_run = tl.zeros([BLOCK_D], tl.float32)
            for p0 in range(p_first, p_last + 1, CHUNK):
                ps = p0 + tl.arange(0, CHUNK)
                valid = ps <= p_last
                slot = ((ps * per_program < row_begin).to(tl.int64) + ps * 2) * num_q_heads + head
                m = tl.load(m_ptr + slot, mask=valid, other=float("-inf"))
                m_new = tl.maximum(m_run, tl.max(m, 0))
                a_run = tl.math.exp2(m_run - m_new)
                w = tl.math.exp2(m - m_new)
                l_run = l_run * a_run + tl.sum(w * tl.load(l_ptr + slot, mask=valid, other=0.0), 0)
                part = tl.load(acc_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)
                acc_run = acc_run * a_run + tl.sum(part * w[:, None], 0)
                m_run = m_new
            out = acc_run / tl.where(l_run == 0.0, 1.0, l_run)
            tl.store(o_ptr + o_offsets, out.to(o_ptr.dtype.element_ty))


def lean_decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale=None, *, config, out=None,
                          k_scale=None, v_scale=None, max_seq_len=None):
    group, block_size, fp8, v_key_major = check_paged_inputs(q, k_cache, v_cache, seq_lens, block_tables, out,
                                                             k_scale, v_scale)
    batch, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q) if out is None else out
    num_kv_heads = k_cache.shape[2]
    qk_scale = (head_dim**-0.5 if scale is None else scale) * LOG2E
    cfg = dict(config)
    per_sm = cfg.pop("PROGRAMS_PER_SM")
    min_tiles = cfg.pop("MIN_TILES", 1)
    kernel = _flat_kernel if cfg.pop("FLAT", 0) else _lean_kernel
    num_programs = triton.cdiv(per_sm * num_sms(), num_kv_heads)
    acc = q.new_empty((num_programs * 2 * num_q_heads, head_dim), dtype=torch.float32)
    m = q.new_empty((num_programs * 2 * num_q_heads,), dtype=torch.float32)
    l = torch.empty_like(m)
    block_b = max(2, triton.next_power_of_2(batch))
    kernel[(num_programs, num_kv_heads)](
        q, k_cache, v_cache, k_scale, v_scale, out, acc, m, l, seq_lens, block_tables, qk_scale, num_q_heads, batch,
        num_programs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), *scale_strides(k_scale),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_H=max(8, triton.next_power_of_2(group)),
        BLOCK_B=block_b, MIN_TILES=min_tiles, DOT_PRECISION=dot_precision(q.dtype), INTERPRET=tuning.INTERPRET,
        FP8=fp8, V_KEY_MAJOR=v_key_major, **cfg)
    block_d = min(64, head_dim)
    _lean_merge_kernel[(batch, num_q_heads, head_dim // block_d)](
        acc, m, l, seq_lens, out, num_q_heads, batch, num_programs, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_B=block_b, BLOCK_N=cfg["BLOCK_N"], MIN_TILES=min_tiles, BLOCK_D=block_d, CHUNK=16)
    return out
