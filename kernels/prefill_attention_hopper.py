"""Hopper (sm_90) path of prefill_attention: a persistent, warp-specialized Gluon kernel.

The same work as kernels/prefill_attention.py's kernel (a work item is a KV head, a sequence and a
tile of BLOCK_Q new tokens, the G query heads of the KV head packed into its BLOCK_M rows; the key
tiles every row sees, then the diagonal), scheduled by hand for Hopper's asynchronous units:

- persistent: one program per SM takes work items from a global counter until none is left,
  longest first (highest query tile first, as the portable kernel's grid is ordered); short
  sequences no longer pay a launch's worth of setup per tile, the loads of the next item start
  while the current one finishes, and items of unequal cost (varlen batches) balance as they come;
- a producer warp claims the items (skipping tiles past a query) and hands each to the consumers
  through a two-entry ring in shared memory; it walks the block tables and brings each BLOCK_N-key
  tile of K and V into a ring of NUM_STAGES shared-memory slots with TMA bulk copies, one copy per
  cache block the tile covers (so block 16 and block 256 take the same path), signalling a `ready`
  mbarrier per slot (kernels/prefill_hopper_schedule.py: the work items and this producer);
- one or two consumer warpgroups of 64 rows, each a partition of its own (neither waits on the
  other's softmax), run both dots as asynchronous wgmma from shared memory (Q, K, V) and registers
  (P), pipelined as FlashAttention-3 does within a warpgroup: tile i's QK^T and tile i-1's PV are
  in flight while tile i's softmax runs. K and V slots are freed apart (their `free` mbarriers):
  K once every warpgroup's scores are done, V once every warpgroup's PV dot is.

The portable Triton kernel stays the path for other GPUs, the interpreter, float32 and e4m3
caches (prefill_attention chooses).
"""
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tritonllm.kernels import tuning
from tritonllm.kernels.prefill_hopper_schedule import _load_kv_partition, _next_item, _work_item

# Triton 3.9 named the cp.async copy async_load too.
_cp_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared


@gluon.jit
def _mask(scores, i, num_full, pos, BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr):
    """Raw scores of key tile i; on the diagonal (i >= num_full) key j counts for a row only at or
    before its position (pos < seq_len, so this also drops keys a copy brought from past the
    sequence)."""
    if i >= num_full:
        keys = i * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, S_LAYOUT))
        scores = gl.where(keys[None, :] <= pos[:, None], scores, float("-inf"))
    return scores


@gluon.jit
def _ready_v(v_bufs, ready_v, count, n0, seq_len, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
             IO_LAYOUT: gl.constexpr):
    """The V slot of the count-th tile loaded (keys n0 ..) once its copy has landed. Rows past the
    sequence hold whatever the cache block held: p is 0 there, 0 * NaN is not, so they are zeroed in
    place first (both warpgroups write the same zeros)."""
    v_buf = v_bufs.index(count % NUM_STAGES)
    mbarrier.wait(ready_v.index(count % NUM_STAGES), (count // NUM_STAGES) & 1)
    if n0 + BLOCK_N > seq_len:
        v = v_buf.load(IO_LAYOUT)
        rows = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, IO_LAYOUT))
        v_buf.store(gl.where((rows < seq_len)[:, None], v, gl.zeros_like(v)))
        fence_async_shared()
    return v_buf


@gluon.jit
def _item_rows(rows, q0, kv_head, q_len, GROUP: gl.constexpr, BLOCK_Q: gl.constexpr):
    """Row r of an item is token q0 + r // GROUP of head kv_head * GROUP + r % GROUP; rows past
    BLOCK_Q * GROUP or q_len are idle (not stored)."""
    token = q0 + rows // GROUP
    return token, kv_head * GROUP + rows % GROUP, (rows < BLOCK_Q * GROUP) & (token < q_len)


@gluon.jit
def _prefetch_q(q_ptr, q_smem, w, rows, offs_d, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch, num_q_tiles,
                stride_q_token, stride_q_head, GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr):
    """Start copying item w's query rows into q_smem (cp.async, one group; idle rows read as zeros)."""
    kv_head, q_start, q_len, q0, seq_len, num_full, num_tiles, seq = _work_item(
        w, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch, num_q_tiles, BLOCK_Q, BLOCK_N)
    token, head, row_mask = _item_rows(rows, q0, kv_head, q_len, GROUP, BLOCK_Q)
    q_rows = (q_start + token).to(gl.int64) * stride_q_token + head * stride_q_head
    _cp_async(q_smem, q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None])
    async_copy.commit_group()


@gluon.jit
def _attend_partition(q_ptr, o_ptr, q_bufs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items, item_ready,
                      item_free, qk_scale, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch, num_q_tiles,
                      stride_q_token, stride_q_head, stride_o_token, stride_o_head, WARPGROUP: gl.constexpr,
                      GROUP: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                      NUM_STAGES: gl.constexpr):
    """Rows 64 * WARPGROUP .. + 63 of each work item's tile, on one warpgroup: attention over the
    item's key tiles as the ring delivers them, then the output rows stored."""
    # wgmma accumulators of the scores and the output, 16 rows a warp; a 16-byte-vector layout for
    # the loads and stores through pointers.
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    IO_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(0, O_LAYOUT, 2)
    rows = WARPGROUP * 64 + gl.arange(0, 64, gl.SliceLayout(1, IO_LAYOUT))
    s_rows = WARPGROUP * 64 + gl.arange(0, 64, gl.SliceLayout(1, S_LAYOUT))
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, IO_LAYOUT))
    count = 0  # tiles consumed so far, in the producer's order
    j = 0  # items taken so far
    num_items = num_q_tiles * num_kv_heads * batch
    w = _next_item(items, item_ready, j)
    if w < num_items:
        _prefetch_q(q_ptr, q_bufs.index(2 * WARPGROUP), w, rows, offs_d, cu_seqlens_q_ptr, seq_lens_ptr,
                    num_kv_heads, batch, num_q_tiles, stride_q_token, stride_q_head, GROUP, BLOCK_Q, BLOCK_N)
    while w < num_items:
        kv_head, q_start, q_len, q0, seq_len, num_full, num_tiles, seq = _work_item(
            w, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch, num_q_tiles, BLOCK_Q, BLOCK_N)
        token, head, row_mask = _item_rows(rows, q0, kv_head, q_len, GROUP, BLOCK_Q)
        # The query rows were copied in while the previous item finished (or before the first).
        q_smem = q_bufs.index(2 * WARPGROUP + j % 2)
        async_copy.wait_group(0)
        fence_async_shared()
        # Idle rows past q_len see the sequence's last key, so no row's mask reaches past seq_len.
        pos = gl.minimum(seq_len - q_len + q0 + s_rows // GROUP, seq_len - 1)

        # Tile 0 (every row sees key 0: the running max is finite from here on, no NaN arises).
        mbarrier.wait(ready_k.index(count % NUM_STAGES), (count // NUM_STAGES) & 1)
        scores = warpgroup_mma(q_smem, k_bufs.index(count % NUM_STAGES).permute((1, 0)),
                               gl.zeros([64, BLOCK_N], gl.float32, S_LAYOUT), use_acc=False)
        mbarrier.arrive(free_k.index(count % NUM_STAGES), count=1)
        # Every warp of the warpgroup took part in that dot, so all have read the item's entry.
        mbarrier.arrive(item_free.index(j % 2), count=1)
        # The running max m_i stays in raw score units: qk_scale > 0 commutes with max, and the
        # exponent's scale and shift are then one fused multiply-add an element.
        scores = _mask(scores, 0, num_full, pos, BLOCK_N, S_LAYOUT)
        m_i = gl.max(scores, 1)
        p = gl.exp2(scores * qk_scale - (m_i * qk_scale)[:, None])
        l_i = gl.sum(p, 1)
        # P travels between iterations as the PV dot's bf16/fp16 operand: half the registers of p.
        p_op = gl.convert_layout(p.to(q_smem.dtype), P_LAYOUT)
        acc = gl.zeros([64, HEAD_DIM], gl.float32, O_LAYOUT)
        for i in range(1, num_tiles):
            slot = (count + i) % NUM_STAGES
            k_buf = k_bufs.index(slot)
            mbarrier.wait(ready_k.index(slot), ((count + i) // NUM_STAGES) & 1)
            # A fresh zero accumulator: one kept across the loop holds a tile's worth of registers.
            scores = warpgroup_mma(q_smem, k_buf.permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, S_LAYOUT),
                                   use_acc=False, is_async=True)
            v_buf = _ready_v(v_bufs, ready_v, count + i - 1, (i - 1) * BLOCK_N, seq_len, BLOCK_N, NUM_STAGES,
                             IO_LAYOUT)
            acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
            # wgmma groups complete in order: one outstanding means the scores are done.
            scores = warpgroup_mma_wait(1, deps=(scores, q_smem, k_buf))[0]
            mbarrier.arrive(free_k.index(slot), count=1)
            scores = _mask(scores, i, num_full, pos, BLOCK_N, S_LAYOUT)
            m_new = gl.maximum(m_i, gl.max(scores, 1))
            p = gl.exp2(scores * qk_scale - (m_new * qk_scale)[:, None])
            alpha = gl.exp2((m_i - m_new) * qk_scale)
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc = warpgroup_mma_wait(0, deps=(acc, v_buf))[0]
            mbarrier.arrive(free_v.index((count + i - 1) % NUM_STAGES), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
            p_op = gl.convert_layout(p.to(q_smem.dtype), P_LAYOUT)
        count += num_tiles
        # The next item (the producer hands it out once this one's copies are issued, so this waits
        # little): its query rows come in under this item's last dot and store. The other buffer's
        # last reader, the item before this one, is done.
        w_next = _next_item(items, item_ready, j + 1)
        if w_next < num_items:
            _prefetch_q(q_ptr, q_bufs.index(2 * WARPGROUP + (j + 1) % 2), w_next, rows, offs_d, cu_seqlens_q_ptr,
                        seq_lens_ptr, num_kv_heads, batch, num_q_tiles, stride_q_token, stride_q_head, GROUP, BLOCK_Q,
                        BLOCK_N)
        v_buf = _ready_v(v_bufs, ready_v, count - 1, (num_tiles - 1) * BLOCK_N, seq_len, BLOCK_N, NUM_STAGES,
                         IO_LAYOUT)
        acc = warpgroup_mma(p_op, v_buf, acc)
        mbarrier.arrive(free_v.index((count - 1) % NUM_STAGES), count=1)
        out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT))[:, None]
        out = gl.convert_layout(out.to(o_ptr.dtype.element_ty), IO_LAYOUT)
        o_rows = (q_start + token).to(gl.int64) * stride_o_token + head * stride_o_head
        gl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out, mask=row_mask[:, None])
        j += 1
        w = w_next


# The batch, its query tiles and its widest table change every step: one compile for all of them.
@gluon.jit(do_not_specialize=["stride_block_table", "batch", "num_q_tiles"])
def _prefill_attention_hopper_kernel(
    q_ptr, k_desc, v_desc, o_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, counter_ptr, qk_scale,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head, stride_block_table, num_kv_heads, batch, num_q_tiles,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_Q: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, Q_SMEM_LAYOUT: gl.constexpr,
):
    WARPGROUPS: gl.constexpr = BLOCK_M // 64
    # Two query buffers per warpgroup (2 * warpgroup + item % 2): an item's rows come in while the item
    # before it finishes.
    q_bufs = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [2 * WARPGROUPS, 64, HEAD_DIM], Q_SMEM_LAYOUT)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready_k = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ready_v = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free_k = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free_v = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_k.index(s), count=1)
        mbarrier.init(ready_v.index(s), count=1)
        # A slot is free once every warpgroup is done with it.
        mbarrier.init(free_k.index(s), count=WARPGROUPS)
        mbarrier.init(free_v.index(s), count=WARPGROUPS)
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(item_ready.index(s), count=1)
        mbarrier.init(item_free.index(s), count=WARPGROUPS)
    fence_async_shared()

    # Tuples of arguments are written out in the call: Gluon keeps constexprs only that way.
    if WARPGROUPS == 1:
        gl.warp_specialize([
            (_attend_partition, (q_ptr, o_ptr, q_bufs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items,
                                 item_ready, item_free, qk_scale, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch,
                                 num_q_tiles, stride_q_token, stride_q_head, stride_o_token, stride_o_head, 0, GROUP,
                                 BLOCK_Q, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_load_kv_partition, (k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items,
                                  item_ready, item_free, counter_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
                                  stride_block_table, num_kv_heads, batch, num_q_tiles, HEAD_DIM, BLOCK_SIZE, BLOCK_Q,
                                  BLOCK_N, NUM_STAGES)),
        ], [1], [24])
    else:
        gl.warp_specialize([
            (_attend_partition, (q_ptr, o_ptr, q_bufs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items,
                                 item_ready, item_free, qk_scale, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch,
                                 num_q_tiles, stride_q_token, stride_q_head, stride_o_token, stride_o_head, 0, GROUP,
                                 BLOCK_Q, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_attend_partition, (q_ptr, o_ptr, q_bufs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items,
                                 item_ready, item_free, qk_scale, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch,
                                 num_q_tiles, stride_q_token, stride_q_head, stride_o_token, stride_o_head, 1, GROUP,
                                 BLOCK_Q, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_load_kv_partition, (k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items,
                                  item_ready, item_free, counter_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
                                  stride_block_table, num_kv_heads, batch, num_q_tiles, HEAD_DIM, BLOCK_SIZE, BLOCK_Q,
                                  BLOCK_N, NUM_STAGES)),
        ], [4, 1], [240, 24])


def _hopper_space(dtype_name, head_dim, group, block_size, q_len, cache_dtype_name=None):
    configs = []
    for block_m in (64, 128):
        for block_n in (64, 128):
            for num_stages in (2, 3, 4):
                # Two Q buffers plus the K/V ring in shared memory, with room for the reductions' scratch.
                if block_m >= group and 2 * head_dim * (2 * block_m + 2 * num_stages * block_n) <= 200 * 1024:
                    configs.append({"BLOCK_M": block_m, "BLOCK_N": block_n, "NUM_STAGES": num_stages})
    return configs


def _hopper_default(dtype_name, head_dim, group, block_size, q_len, cache_dtype_name=None):
    # Two consumer warpgroups share each K/V tile unless the query is too short to fill 128 rows.
    # On the H200 at D 128, 128-key tiles (2 slots fit) win from 4k query rows, 64-key tiles below.
    if q_len >= 4096 and head_dim <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_STAGES": 2}
    return {"BLOCK_M": 64 if q_len * group <= 64 else 128, "BLOCK_N": 64, "NUM_STAGES": 4}


HOPPER_TUNABLE = tuning.Tunable("prefill_attention_hopper", _hopper_space, _hopper_default)


@functools.cache
def _is_sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def supports(q, k_cache, v_cache, group, v_key_major, fp8) -> bool:
    """Whether the Hopper path takes these inputs: an sm_90 GPU, bf16/fp16 q and cache, contiguous
    16-byte-aligned caches in the plain (not key-major) layout, q 16-byte aligned with strides of
    multiples of 16 elements (its cp.async copies move 16 bytes, and only such strides let Triton
    prove it), D 64 or 128, blocks of 16 keys or more (whole 128-byte swizzle
    atoms), a GQA group (Hq / Hkv) of at most 64."""
    if not q.is_cuda or fp8 or v_key_major or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not _is_sm90(q.device.index):
        return False
    return (q.shape[2] in (64, 128) and k_cache.shape[1] >= 16 and group <= 64
            and q.data_ptr() % 16 == 0 and q.stride(0) % 16 == 0 and q.stride(1) % 16 == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.data_ptr() % 16 == 0 and v_cache.data_ptr() % 16 == 0)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a GPU (132 for CPU tensors: the sm_90 compile checks)."""
    if device.type != "cuda":
        return 132
    return tuning.sm_count(torch.cuda.current_device() if device.index is None else device.index)


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
    batch, num_q_tiles = seq_lens.shape[0], triton.cdiv(max_q_len, block_q)
    # Persistent: one program per SM (a program fills one: its warps take the whole register file),
    # taking work items from a counter that starts at 0.
    grid = (min(num_kv_heads * batch * num_q_tiles, _sm_count(q.device)),)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    _prefill_attention_hopper_kernel[grid](
        q, k_desc, v_desc, out, cu_seqlens_q, seq_lens, block_tables, counter, qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), num_kv_heads, batch,
        num_q_tiles, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q, Q_SMEM_LAYOUT=q_layout,
        **config,
        num_warps=4)
    return out
