"""prefill_attention_hopper over an e4m3 cache: the same consumers, fed by a converting producer.

The bf16 kernel's producer is one warp of TMA copies. Here a warpgroup takes its place: it claims
and hands out the work items as that warp does, but brings each tile's e4m3 codes and float32
scales into a two-slot staging ring with cp.async (the next tile's copies in flight while it
converts the current one), then writes the tile dequantized (codes x scale, rounded once to q's
dtype, as gather_kv_blocks' copies hold them) into the consumers' K/V ring, V transposed from the
cache's key-major layout into rows. The consumers (kernels/prefill_attention_hopper._attend_partition)
run unchanged on those slots: the prefill reads the cache in place, with no bf16 copies of its
blocks. Scales must be head-major (kernels/fp8.empty_kv_scales), V key-major.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from tritonllm.kernels.prefill_attention_hopper import _attend_partition, _sm_count
from tritonllm.kernels.prefill_hopper_schedule import _publish_item, _work_item

_cp_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
# Registers a thread of the converting warpgroup, and of the second consumer warpgroup beside it:
# three warpgroups share the 512 a thread slot an SM holds (the first consumer takes the rest).
CONVERT_REGS = gl.constexpr(80)
ATTEND_REGS = gl.constexpr(216)
STAGING = gl.constexpr(4)  # staging slots: tiles of codes in flight while one is converted


@gluon.jit
def _stage_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_stages, v_stages, ks_stages, vs_stages, slot, tile,
                num_tiles, block_table_row, seq_len, kv_head, stride_k_block, stride_k_token, stride_v_block,
                stride_scale_block, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """Start copying the e4m3 codes and scales of key tile `tile` into staging slot `slot`: one
    cp.async group, empty past the item's last tile (so every tile waits for the same count). Keys
    past the sequence copy block 0: the consumers mask their scores, the converter zeroes their V."""
    if tile >= num_tiles:
        async_copy.commit_group()
        return
    n0 = tile * BLOCK_N
    k_stage, v_stage, ks_stage, vs_stage = (k_stages.index(slot), v_stages.index(slot), ks_stages.index(slot),
                                            vs_stages.index(slot))
    K_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [512 // HEAD_DIM, HEAD_DIM // 16], [4, 1], [1, 0])
    V_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [512 // BLOCK_N, BLOCK_N // 16], [4, 1], [1, 0])
    S_LAYOUT: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
    keys = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, K_LAYOUT))
    block = gl.load(block_table_row + keys // BLOCK_SIZE, mask=keys < seq_len, other=0).to(gl.int64)
    rows = gl.multiple_of(block * stride_k_block + (keys % BLOCK_SIZE) * stride_k_token + kv_head * HEAD_DIM, 16)
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, K_LAYOUT))
    _cp_async(k_stage, k_ptr + rows[:, None] + offs_d[None, :])
    # A head's V in a block is [D, BLOCK_SIZE] keys-contiguous: the tile is [D, BLOCK_N] of 16-key runs.
    keys = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, V_LAYOUT))
    block = gl.load(block_table_row + keys // BLOCK_SIZE, mask=keys < seq_len, other=0).to(gl.int64)
    # Runs of 16 keys from a multiple of 16 (blocks hold 16 or more), so cp.async moves 16 bytes at once
    # (the hints must sit in this function: a helper's return value loses them).
    cols = gl.max_contiguous(gl.multiple_of(block * stride_v_block + kv_head * HEAD_DIM * BLOCK_SIZE
                                            + keys % BLOCK_SIZE, 16), 16)
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(1, V_LAYOUT))
    _cp_async(v_stage, v_ptr + (offs_d * BLOCK_SIZE)[:, None] + cols[None, :])
    keys = n0 + gl.arange(0, BLOCK_N, S_LAYOUT)
    block = gl.load(block_table_row + keys // BLOCK_SIZE, mask=keys < seq_len, other=0).to(gl.int64)
    scales = gl.max_contiguous(gl.multiple_of(block * stride_scale_block + kv_head * BLOCK_SIZE + keys % BLOCK_SIZE,
                                              16), 16)
    _cp_async(ks_stage, k_scale_ptr + scales)
    _cp_async(vs_stage, v_scale_ptr + scales)
    async_copy.commit_group()


@gluon.jit
def _convert_tile(k_stage, v_stage, ks_stage, vs_stage, k_buf, v_buf, n0, seq_len, HEAD_DIM: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """Dequantize one staged tile into the consumers' float16 slots: K [BLOCK_N, D] and V [D, BLOCK_N]
    (key-major as cached: the PV dot takes it transposed), each code times its key's scale in float16
    (e4m3 converts to it exactly; two instructions a pair of values). V columns past the sequence are
    zeroed (p is 0 there, 0 * NaN is not)."""
    K_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [512 // HEAD_DIM, HEAD_DIM // 16], [4, 1], [1, 0])
    V_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 16], [512 // BLOCK_N, BLOCK_N // 16], [4, 1], [1, 0])
    # Every load before the first store: the compiler cannot move a shared load past a shared store.
    k = k_stage.load(K_LAYOUT)
    v = v_stage.load(V_LAYOUT)
    k_scale = ks_stage.load(gl.SliceLayout(1, K_LAYOUT)).to(gl.float16)
    keys = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(0, V_LAYOUT))
    v_scale = gl.where(keys < seq_len, vs_stage.load(gl.SliceLayout(0, V_LAYOUT)), 0.0).to(gl.float16)
    k_buf.store(k.to(gl.float16) * k_scale[:, None])
    v = v.to(gl.float16) * v_scale[None, :]
    v_buf.store(gl.where((keys < seq_len)[None, :], v, 0.0))


@gluon.jit
def _convert_kv_partition(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_stages, v_stages, ks_stages, vs_stages, k_bufs,
                          v_bufs, ready_k, ready_v, free_k, free_v, items, item_ready, item_free, counter_ptr,
                          cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, stride_block_table, stride_k_block,
                          stride_k_token, stride_v_block, stride_scale_block, num_kv_heads, batch, num_q_tiles,
                          HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_Q: gl.constexpr,
                          BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    num_items = num_q_tiles * num_kv_heads * batch
    count = 0  # tiles written so far: ring slot count % NUM_STAGES, staging slot count % STAGING
    j = 0  # items handed out so far
    w = gl.atomic_add(counter_ptr, 1, sem="relaxed")
    while w < num_items:
        w_next = gl.atomic_add(counter_ptr, 1, sem="relaxed")
        kv_head, q_start, q_len, q0, seq_len, num_full, num_tiles, seq = _work_item(
            w, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch, num_q_tiles, BLOCK_Q, BLOCK_N)
        if num_tiles > 0:
            _publish_item(items, item_ready, item_free, j, w)
            j += 1
            block_table_row = block_tables_ptr + seq.to(gl.int64) * stride_block_table
            for t in gl.static_range(STAGING - 1):
                _stage_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_stages, v_stages, ks_stages, vs_stages,
                            (count + t) % STAGING, t, num_tiles, block_table_row, seq_len, kv_head, stride_k_block,
                            stride_k_token, stride_v_block, stride_scale_block, HEAD_DIM, BLOCK_SIZE, BLOCK_N)
            for i in range(num_tiles):
                # The slot converted last is free (the barrier after it): STAGING - 1 tiles in flight.
                _stage_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_stages, v_stages, ks_stages, vs_stages,
                            (count + STAGING - 1) % STAGING, i + STAGING - 1, num_tiles, block_table_row, seq_len,
                            kv_head, stride_k_block, stride_k_token, stride_v_block, stride_scale_block, HEAD_DIM,
                            BLOCK_SIZE, BLOCK_N)
                async_copy.wait_group(STAGING - 1)
                gl.thread_barrier()  # every thread's copies of this tile have landed
                slot = count % NUM_STAGES
                mbarrier.wait(free_k.index(slot), ((count // NUM_STAGES) & 1) ^ 1)
                mbarrier.wait(free_v.index(slot), ((count // NUM_STAGES) & 1) ^ 1)
                staged = count % STAGING
                _convert_tile(k_stages.index(staged), v_stages.index(staged), ks_stages.index(staged),
                              vs_stages.index(staged), k_bufs.index(slot), v_bufs.index(slot), i * BLOCK_N,
                              seq_len, HEAD_DIM, BLOCK_N)
                fence_async_shared()
                # Every thread's stores are done (and the staging slot read) before the consumers go.
                gl.thread_barrier()
                mbarrier.arrive(ready_k.index(slot), count=1)
                mbarrier.arrive(ready_v.index(slot), count=1)
                count += 1
        w = w_next
    _publish_item(items, item_ready, item_free, j, num_items)


# The batch, its query tiles and its widest table change every step: one compile for all of them.
@gluon.jit(do_not_specialize=["stride_block_table", "batch", "num_q_tiles"])
def _prefill_attention_hopper_fp8_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, o_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    counter_ptr, qk_scale, stride_q_token, stride_q_head, stride_o_token, stride_o_head, stride_block_table,
    stride_k_block, stride_k_token, stride_v_block, stride_scale_block, num_kv_heads, batch, num_q_tiles,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_Q: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, Q_SMEM_LAYOUT: gl.constexpr,
    Q16_SMEM_LAYOUT: gl.constexpr, K_SMEM_LAYOUT: gl.constexpr, V_SMEM_LAYOUT: gl.constexpr,
):
    WARPGROUPS: gl.constexpr = BLOCK_M // 64
    q_bufs = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [WARPGROUPS, 64, HEAD_DIM], Q_SMEM_LAYOUT)
    # The dots run in float16: the query rows are converted into these once an item.
    q16_bufs = gl.allocate_shared_memory(gl.float16, [WARPGROUPS, 64, HEAD_DIM], Q16_SMEM_LAYOUT)
    k_bufs = gl.allocate_shared_memory(gl.float16, [NUM_STAGES, BLOCK_N, HEAD_DIM], K_SMEM_LAYOUT)
    v_bufs = gl.allocate_shared_memory(gl.float16, [NUM_STAGES, HEAD_DIM, BLOCK_N], V_SMEM_LAYOUT)
    PLAIN: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    k_stages = gl.allocate_shared_memory(gl.float8e4nv, [STAGING, BLOCK_N, HEAD_DIM], PLAIN)
    v_stages = gl.allocate_shared_memory(gl.float8e4nv, [STAGING, HEAD_DIM, BLOCK_N], PLAIN)
    ks_stages = gl.allocate_shared_memory(gl.float32, [STAGING, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    vs_stages = gl.allocate_shared_memory(gl.float32, [STAGING, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready_k = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ready_v = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free_k = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    free_v = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_k.index(s), count=1)
        mbarrier.init(ready_v.index(s), count=1)
        mbarrier.init(free_k.index(s), count=WARPGROUPS)
        mbarrier.init(free_v.index(s), count=WARPGROUPS)
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(item_ready.index(s), count=1)
        mbarrier.init(item_free.index(s), count=WARPGROUPS)
    fence_async_shared()

    if WARPGROUPS == 1:
        gl.warp_specialize([
            (_attend_partition, (q_ptr, o_ptr, q_bufs, q16_bufs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items,
                                 item_ready, item_free, qk_scale, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch,
                                 num_q_tiles, stride_q_token, stride_q_head, stride_o_token, stride_o_head, 0, GROUP,
                                 BLOCK_Q, BLOCK_N, HEAD_DIM, NUM_STAGES, True)),
            (_convert_kv_partition, (k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_stages, v_stages, ks_stages, vs_stages,
                                     k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items, item_ready, item_free,
                                     counter_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, stride_block_table,
                                     stride_k_block, stride_k_token, stride_v_block, stride_scale_block, num_kv_heads,
                                     batch, num_q_tiles, HEAD_DIM, BLOCK_SIZE, BLOCK_Q, BLOCK_N, NUM_STAGES)),
        ], [4], [CONVERT_REGS])
    else:
        gl.warp_specialize([
            (_attend_partition, (q_ptr, o_ptr, q_bufs, q16_bufs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items,
                                 item_ready, item_free, qk_scale, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch,
                                 num_q_tiles, stride_q_token, stride_q_head, stride_o_token, stride_o_head, 0, GROUP,
                                 BLOCK_Q, BLOCK_N, HEAD_DIM, NUM_STAGES, True)),
            (_attend_partition, (q_ptr, o_ptr, q_bufs, q16_bufs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items,
                                 item_ready, item_free, qk_scale, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch,
                                 num_q_tiles, stride_q_token, stride_q_head, stride_o_token, stride_o_head, 1, GROUP,
                                 BLOCK_Q, BLOCK_N, HEAD_DIM, NUM_STAGES, True)),
            (_convert_kv_partition, (k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, k_stages, v_stages, ks_stages, vs_stages,
                                     k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items, item_ready, item_free,
                                     counter_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, stride_block_table,
                                     stride_k_block, stride_k_token, stride_v_block, stride_scale_block, num_kv_heads,
                                     batch, num_q_tiles, HEAD_DIM, BLOCK_SIZE, BLOCK_Q, BLOCK_N, NUM_STAGES)),
        ], [4, 4], [ATTEND_REGS, CONVERT_REGS])


def prefill_attention_hopper_fp8(q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, seq_lens, block_tables, out,
                                 qk_scale, group, max_q_len, config):
    """Launch the kernel over an e4m3 cache: inputs as kernels/prefill_attention.prefill_attention's
    (checked there and by `supports`), V key-major, scales head-major; qk_scale with log2(e) folded
    in, group = Hq / Hkv; config as prefill_attention_hopper's. Writes `out` in place and returns it."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    block_m = config["BLOCK_M"]
    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([64, head_dim], element)
    q16_layout = gl.NVMMASharedLayout.get_default_for([64, head_dim], gl.float16)
    k_layout = gl.NVMMASharedLayout.get_default_for([config["BLOCK_N"], head_dim], gl.float16)
    v_layout = gl.NVMMASharedLayout.get_default_for([head_dim, config["BLOCK_N"]], gl.float16)
    batch, num_q_tiles = seq_lens.shape[0], triton.cdiv(max_q_len, block_m // group)
    grid = (min(num_kv_heads * batch * num_q_tiles, _sm_count(q.device)),)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    _prefill_attention_hopper_fp8_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, out, cu_seqlens_q, seq_lens, block_tables, counter, qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), k_scale.stride(0), num_kv_heads, batch, num_q_tiles, GROUP=group,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_m // group, Q_SMEM_LAYOUT=q_layout,
        Q16_SMEM_LAYOUT=q16_layout, K_SMEM_LAYOUT=k_layout, V_SMEM_LAYOUT=v_layout, **config, num_warps=4)
    return out
