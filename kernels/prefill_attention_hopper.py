"""Hopper (sm_90) path of prefill_attention: a warp-specialized Gluon kernel.

The same grid, row packing and causal split as kernels/prefill_attention.py (one program per KV
head, sequence and tile of BLOCK_Q new tokens, the G query heads of the KV head packed into the
BLOCK_M rows), written for Hopper's asynchronous units instead of leaving the schedule to the
compiler:

- a producer warp walks the block table and brings each BLOCK_N-key tile of K and V into a ring
  of NUM_STAGES shared-memory slots with TMA bulk copies, one copy per cache block the tile
  covers (so block 16 and block 256 take the same path), signalling a `ready` mbarrier per slot;
- the consumer warps (one or two warpgroups, 64 rows each) run both dots as asynchronous wgmma
  straight from shared memory (Q, K, V) and from registers (P), pipelined as FlashAttention-3
  does within a warpgroup (tile i's QK^T and tile i-1's PV in flight during tile i's softmax),
  and free a slot by arriving on its `empty` mbarrier once the PV dot that read it is done.

The producer runs NUM_STAGES tiles ahead, so the consumers never wait on a load that was not
started long before; the two warpgroups of a 128-row tile softmax and multiply independently,
so one's exponentials overlap the other's dots. The portable Triton kernel stays the path for
other GPUs, the interpreter, float32 and e4m3 caches (prefill_attention chooses).
"""
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tritonllm.kernels import tuning

# Triton 3.8 named the TMA global-to-shared copy async_load; 3.9 removed the older name.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.jit
def _load_kv_partition(k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, empty, block_table_row, kv_head, seq_len,
                       num_tiles, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr):
    # A tile covers BLOCK_N // CHUNK cache blocks (or lies inside one): one TMA copy per block.
    CHUNK: gl.constexpr = min(BLOCK_N, BLOCK_SIZE)
    column = kv_head * HEAD_DIM
    for i in range(num_tiles):
        slot = i % NUM_STAGES
        # Slots start free: the first pass waits on the phase before the barrier's first one.
        mbarrier.wait(empty.index(slot), ((i // NUM_STAGES) & 1) ^ 1)
        mbarrier.expect(ready_k.index(slot), k_desc.block_type.nbytes * (BLOCK_N // CHUNK))
        mbarrier.expect(ready_v.index(slot), v_desc.block_type.nbytes * (BLOCK_N // CHUNK))
        for c in gl.static_range(BLOCK_N // CHUNK):
            key = i * BLOCK_N + c * CHUNK
            # Table entries past the sequence are never read: such chunks copy block 0, whose
            # keys the consumers mask (scores) and zero (V) like any key past seq_len.
            block = gl.load(block_table_row + key // BLOCK_SIZE, mask=key < seq_len, other=0)
            row = block * BLOCK_SIZE + key % BLOCK_SIZE  # TMA coordinates are int32
            _tma_load(k_desc, [row, column], ready_k.index(slot), k_bufs.index(slot).slice(c * CHUNK, CHUNK))
            _tma_load(v_desc, [row, column], ready_v.index(slot), v_bufs.index(slot).slice(c * CHUNK, CHUNK))


@gluon.jit
def _scale_and_mask(scores, qk_scale, i, num_full, pos, BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr):
    """Scores of key tile i in log2 units; on the diagonal (i >= num_full) key j counts for a row only
    at or before its position (pos < seq_len, so this also drops keys a copy brought from past the
    sequence)."""
    scores = scores * qk_scale
    if i >= num_full:
        keys = i * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_LAYOUT))
        scores = gl.where(keys[None, :] <= pos[:, None], scores, float("-inf"))
    return scores


@gluon.jit
def _ready_v(v_bufs, ready_v, i, seq_len, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, IO_LAYOUT: gl.constexpr):
    """V of key tile i once its copy has landed. Rows past the sequence hold whatever the cache block
    held: p is 0 there, 0 * NaN is not, so they are zeroed in place first (both warpgroups write the
    same zeros)."""
    v_buf = v_bufs.index(i % NUM_STAGES)
    mbarrier.wait(ready_v.index(i % NUM_STAGES), (i // NUM_STAGES) & 1)
    if (i + 1) * BLOCK_N > seq_len:
        v = v_buf.load(IO_LAYOUT)
        rows = i * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, IO_LAYOUT))
        v_buf.store(gl.where((rows < seq_len)[:, None], v, gl.zeros_like(v)))
        fence_async_shared()
    return v_buf


@gluon.jit
def _attend_partition(q_ptr, o_ptr, q_bufs, k_bufs, v_bufs, ready_k, ready_v, empty, qk_scale, q_start, q_len, q0,
                      kv_head, seq_len, num_full, num_tiles, stride_q_token, stride_q_head, stride_o_token,
                      stride_o_head, WARPGROUP: gl.constexpr, GROUP: gl.constexpr, BLOCK_Q: gl.constexpr,
                      BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Rows 64 * WARPGROUP .. + 63 of the tile, on one warpgroup: attention over the num_tiles key
    tiles of the ring, then the output rows stored."""
    # wgmma accumulators of the scores and the output, 16 rows a warp; a 16-byte-vector layout for
    # the loads and stores through pointers.
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    IO_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
    # Row r is token q0 + r // GROUP of head kv_head * GROUP + r % GROUP; rows past BLOCK_Q * GROUP
    # or q_len are idle (zero queries, not stored).
    rows = WARPGROUP * 64 + gl.arange(0, 64, gl.SliceLayout(1, IO_LAYOUT))
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, IO_LAYOUT))
    token = q0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (token < q_len)
    q_rows = (q_start + token).to(gl.int64) * stride_q_token + head * stride_q_head
    q_smem = q_bufs.index(WARPGROUP)
    q_smem.store(gl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0))
    fence_async_shared()

    # Idle rows past q_len see the sequence's last key, so no row's mask reaches past seq_len.
    s_rows = WARPGROUP * 64 + gl.arange(0, 64, gl.SliceLayout(1, S_LAYOUT))
    pos = gl.minimum(seq_len - q_len + q0 + s_rows // GROUP, seq_len - 1)
    zero_scores = gl.zeros([64, BLOCK_N], gl.float32, S_LAYOUT)
    acc = gl.zeros([64, HEAD_DIM], gl.float32, O_LAYOUT)
    # Tile 0 (every row sees key 0, so the running max is finite from here on and no NaN arises).
    mbarrier.wait(ready_k.index(0), 0)
    scores = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_scores, use_acc=False)
    scores = _scale_and_mask(scores, qk_scale, 0, num_full, pos, BLOCK_N, S_LAYOUT)
    m_i = gl.max(scores, 1)
    p = gl.exp2(scores - m_i[:, None])
    l_i = gl.sum(p, 1)
    # Software-pipelined as FlashAttention-3 does within a warpgroup: tile i's QK^T and tile i-1's
    # PV dot run on the tensor cores while this warpgroup computes tile i's softmax.
    for i in range(1, num_tiles):
        p_op = gl.convert_layout(p.to(q_smem.dtype), gl.DotOperandLayout(0, O_LAYOUT, 2))
        slot = i % NUM_STAGES
        k_buf = k_bufs.index(slot)
        mbarrier.wait(ready_k.index(slot), (i // NUM_STAGES) & 1)
        scores = warpgroup_mma(q_smem, k_buf.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
        v_buf = _ready_v(v_bufs, ready_v, i - 1, seq_len, BLOCK_N, NUM_STAGES, IO_LAYOUT)
        acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
        # wgmma groups complete in order: one outstanding means the scores are done.
        scores, _, _ = warpgroup_mma_wait(1, deps=(scores, q_smem, k_buf))
        scores = _scale_and_mask(scores, qk_scale, i, num_full, pos, BLOCK_N, S_LAYOUT)
        m_new = gl.maximum(m_i, gl.max(scores, 1))
        p = gl.exp2(scores - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc, _ = warpgroup_mma_wait(0, deps=(acc, v_buf))
        mbarrier.arrive(empty.index((i - 1) % NUM_STAGES), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    p_op = gl.convert_layout(p.to(q_smem.dtype), gl.DotOperandLayout(0, O_LAYOUT, 2))
    v_buf = _ready_v(v_bufs, ready_v, num_tiles - 1, seq_len, BLOCK_N, NUM_STAGES, IO_LAYOUT)
    acc = warpgroup_mma(p_op, v_buf, acc)
    mbarrier.arrive(empty.index((num_tiles - 1) % NUM_STAGES), count=1)
    out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))[:, None]
    out = gl.convert_layout(out.to(o_ptr.dtype.element_ty), IO_LAYOUT)
    o_rows = (q_start + token).to(gl.int64) * stride_o_token + head * stride_o_head
    gl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out, mask=row_mask[:, None])


@gluon.jit
def _prefill_attention_hopper_kernel(
    q_ptr, k_desc, v_desc, o_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, qk_scale,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head, stride_block_table,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_Q: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, Q_SMEM_LAYOUT: gl.constexpr,
):
    kv_head = gl.program_id(0)
    seq = gl.program_id(1)
    # Highest tiles first: they see the most keys, so the longest programs start earliest.
    tile = gl.num_programs(2) - 1 - gl.program_id(2)
    q_start = gl.load(cu_seqlens_q_ptr + seq)
    q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q0 = tile * BLOCK_Q
    if q0 >= q_len:
        return
    seq_len = gl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys cached before the first new token
    # Tiles [0, num_full) are visible to every row (the first sits at context + q0); the rest, up
    # to the last row's position, are the diagonal.
    num_full = (context + q0 + 1) // BLOCK_N
    num_tiles = gl.cdiv(gl.minimum(seq_len, context + q0 + BLOCK_Q), BLOCK_N)

    WARPGROUPS: gl.constexpr = BLOCK_M // 64
    q_bufs = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [WARPGROUPS, 64, HEAD_DIM], Q_SMEM_LAYOUT)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready_k = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ready_v = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_k.index(s), count=1)
        mbarrier.init(ready_v.index(s), count=1)
        mbarrier.init(empty.index(s), count=WARPGROUPS)  # a slot is free once every warpgroup is done
    fence_async_shared()

    block_table_row = block_tables_ptr + seq.to(gl.int64) * stride_block_table
    # Tuples of arguments are written out in the call: Gluon keeps constexprs only that way.
    if WARPGROUPS == 1:
        gl.warp_specialize([
            (_attend_partition, (q_ptr, o_ptr, q_bufs, k_bufs, v_bufs, ready_k, ready_v, empty, qk_scale, q_start,
                                 q_len, q0, kv_head, seq_len, num_full, num_tiles, stride_q_token, stride_q_head,
                                 stride_o_token, stride_o_head, 0, GROUP, BLOCK_Q, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_load_kv_partition, (k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, empty, block_table_row, kv_head,
                                  seq_len, num_tiles, HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_STAGES)),
        ], [1], [24])
    else:
        # The second warpgroup is a partition of its own, so neither waits on the other's softmax.
        gl.warp_specialize([
            (_attend_partition, (q_ptr, o_ptr, q_bufs, k_bufs, v_bufs, ready_k, ready_v, empty, qk_scale, q_start,
                                 q_len, q0, kv_head, seq_len, num_full, num_tiles, stride_q_token, stride_q_head,
                                 stride_o_token, stride_o_head, 0, GROUP, BLOCK_Q, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_attend_partition, (q_ptr, o_ptr, q_bufs, k_bufs, v_bufs, ready_k, ready_v, empty, qk_scale, q_start,
                                 q_len, q0, kv_head, seq_len, num_full, num_tiles, stride_q_token, stride_q_head,
                                 stride_o_token, stride_o_head, 1, GROUP, BLOCK_Q, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_load_kv_partition, (k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, empty, block_table_row, kv_head,
                                  seq_len, num_tiles, HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_STAGES)),
        ], [4, 1], [240, 24])


def _hopper_space(dtype_name, head_dim, group, block_size, q_len, cache_dtype_name=None):
    configs = []
    for block_m in (64, 128):
        for block_n in (64, 128):
            for num_stages in (2, 3, 4):
                # Q plus the K/V ring in shared memory, with room for the reductions' scratch.
                if block_m >= group and 2 * head_dim * (block_m + 2 * num_stages * block_n) <= 200 * 1024:
                    configs.append({"BLOCK_M": block_m, "BLOCK_N": block_n, "NUM_STAGES": num_stages})
    return configs


def _hopper_default(dtype_name, head_dim, group, block_size, q_len, cache_dtype_name=None):
    # Two consumer warpgroups share each K/V tile unless the query is too short to fill 128 rows.
    # BLOCK_N 64 with 4 slots won every H200 tuning at D 128; BLOCK_N 128 spills the pipelined loop.
    return {"BLOCK_M": 64 if q_len * group <= 64 else 128, "BLOCK_N": 64, "NUM_STAGES": 4}


HOPPER_TUNABLE = tuning.Tunable("prefill_attention_hopper", _hopper_space, _hopper_default)


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supports(q, k_cache, v_cache, group, v_key_major, fp8) -> bool:
    """Whether the Hopper path takes these inputs: an sm_90 GPU, bf16/fp16 q and cache, contiguous
    16-byte-aligned caches in the plain (not key-major) layout, D 64 or 128, blocks of 16 keys or more
    (whole 128-byte swizzle atoms), a GQA group (Hq / Hkv) of at most 64."""
    if not q.is_cuda or fp8 or v_key_major or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not _is_sm90(q.device.index):
        return False
    return (q.shape[2] in (64, 128) and k_cache.shape[1] >= 16 and group <= 64
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


def prefill_attention_hopper(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, qk_scale, group,
                             max_q_len, config):
    """Launch the Hopper kernel: inputs as kernels/prefill_attention.prefill_attention's (checked
    there and by `supports`), qk_scale with log2(e) folded in, group = Hq / Hkv; config: BLOCK_M
    (64 rows a consumer warpgroup: 64 or 128), BLOCK_N, NUM_STAGES (slots of the K/V ring).
    Writes `out` in place and returns it."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    block_m, block_n = config["BLOCK_M"], config["BLOCK_N"]
    chunk = min(block_n, block_size)
    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    smem_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    shape = [num_blocks * block_size, num_kv_heads * head_dim]
    k_desc = TensorDescriptor(k_cache.view(shape), shape, [shape[1], 1], [chunk, head_dim], smem_layout)
    v_desc = TensorDescriptor(v_cache.view(shape), shape, [shape[1], 1], [chunk, head_dim], smem_layout)
    q_layout = gl.NVMMASharedLayout.get_default_for([64, head_dim], element)
    block_q = block_m // group
    grid = (num_kv_heads, seq_lens.shape[0], triton.cdiv(max_q_len, block_q))
    _prefill_attention_hopper_kernel[grid](
        q, k_desc, v_desc, out, cu_seqlens_q, seq_lens, block_tables, qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q, Q_SMEM_LAYOUT=q_layout, **config,
        num_warps=4)
    return out
