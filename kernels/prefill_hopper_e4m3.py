"""Hopper (sm_90) prefill attention over an e4m3 KV cache, read in place.

The kernel of kernels/prefill_attention_hopper.py with a dequantizing stage between its producer
and its consumers:

- the producer warp copies each key tile as the cache stores it, by TMA, into staging rings of
  E4M3_STAGES slots: the e4m3 K rows, the key-major V's [D, keys] runs and the float32 scales of
  both (kernels/prefill_hopper_schedule.py, each in a ring of its own);
- a converter partition of four warps turns each staged tile into the K and V tiles of q's dtype
  that the consumers read, each value its code times its row's scale rounded once (the values
  gather_kv_blocks writes into block copies), V transposed to [keys, D] on the way;
- the consumer warpgroups are the bf16 kernel's, unchanged.

So no copy of the cache is written or read, and the conversion runs beside the dots rather than in
the warps that issue them.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from tritonllm.kernels.prefill_attention_hopper import _attend_partition, launch_geometry
from tritonllm.kernels.prefill_hopper_schedule import E4M3_STAGES, _load_kv_partition, _next_item, _work_item


@gluon.jit
def _convert_tile(staged, staged_scales, ready_codes, ready_scales, free_codes, free_scales, bufs, ready, free, count,
                  HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr, STAGED_SLOTS: gl.constexpr, KEY_MAJOR: gl.constexpr):
    """The count-th tile's staged codes and scales, as values of bufs' dtype, into its slot of the
    consumers' ring once that is free. K is staged [keys, D] (a scale a row), a key-major V as
    [D, keys] runs of one cache block each (a scale a column)."""
    CHUNK: gl.constexpr = min(BLOCK_N, BLOCK_SIZE)
    SCALE_SPREAD: gl.constexpr = max(1, 32 // CHUNK)  # a row of scales every 128 bytes (_copy_tile's SPREAD)
    staged_slot = count % STAGED_SLOTS
    slot = count % NUM_STAGES
    mbarrier.wait(ready_codes.index(staged_slot), (count // STAGED_SLOTS) & 1)
    mbarrier.wait(ready_scales.index(staged_slot), (count // STAGED_SLOTS) & 1)
    mbarrier.wait(free.index(slot), ((count // NUM_STAGES) & 1) ^ 1)
    # 16 codes a thread: one 16-byte shared-memory load each.
    if KEY_MAJOR:
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (CHUNK // 16), CHUNK // 16], [4, 1], [1, 0])
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (HEAD_DIM // 16), HEAD_DIM // 16], [4, 1], [1, 0])
    for c in gl.static_range(BLOCK_N // CHUNK):
        scales = staged_scales.index((staged_slot * (BLOCK_N // CHUNK) + c) * SCALE_SPREAD)  # [1, CHUNK]
        if KEY_MAJOR:
            codes = staged.index(staged_slot * (BLOCK_N // CHUNK) + c).load(layout)
            values = gl.permute((codes.to(gl.float32) * scales.load(layout)).to(bufs.dtype), (1, 0))
        else:
            # The row's scales come in as the run they are stored in, then turn into a column.
            row = gl.permute(scales.load(gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])), (1, 0))
            codes = staged.index(staged_slot).slice(c * CHUNK, CHUNK).load(layout)
            values = (codes.to(gl.float32) * gl.convert_layout(row, layout)).to(bufs.dtype)
        bufs.index(slot).slice(c * CHUNK, CHUNK).store(values)
    fence_async_shared()
    mbarrier.arrive(ready.index(slot), count=1)
    mbarrier.arrive(free_codes.index(staged_slot), count=1)
    mbarrier.arrive(free_scales.index(staged_slot), count=1)


@gluon.jit
def _convert_partition(k_staged, v_staged, ks_staged, vs_staged, ready_ke, ready_ve, ready_ks, ready_vs, free_ke,
                       free_ve, free_ks, free_vs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items, item_ready,
                       item_free, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch, num_q_tiles,
                       HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr,
                       NUM_STAGES: gl.constexpr, STAGED_SLOTS: gl.constexpr):
    # Tiles in the producer's order: the items it hands out, each item's key tiles, K before V.
    num_items = num_q_tiles * num_kv_heads * batch
    count = 0
    j = 0
    w = _next_item(items, item_ready, j)
    while w < num_items:
        num_tiles = _work_item(w, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch, num_q_tiles, BLOCK_Q,
                               BLOCK_N)[6]
        mbarrier.arrive(item_free.index(j % 2), count=1)
        for i in range(num_tiles):
            _convert_tile(k_staged, ks_staged, ready_ke, ready_ks, free_ke, free_ks, k_bufs, ready_k, free_k,
                          count + i, HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_STAGES, STAGED_SLOTS, False)
            _convert_tile(v_staged, vs_staged, ready_ve, ready_vs, free_ve, free_vs, v_bufs, ready_v, free_v,
                          count + i, HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_STAGES, STAGED_SLOTS, True)
        count += num_tiles
        j += 1
        w = _next_item(items, item_ready, j)


@gluon.jit
def _ring(NUM: gl.constexpr, FREE_COUNT: gl.constexpr):
    """`ready` and `free` mbarriers of a NUM-slot ring: ready by one arrival (or a TMA's bytes),
    free by FREE_COUNT."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=FREE_COUNT)
    return ready, free


@gluon.jit(do_not_specialize=["stride_block_table", "batch", "num_q_tiles"])
def _prefill_attention_hopper_e4m3_kernel(
    q_ptr, k_desc, v_desc, ks_desc, vs_desc, o_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, counter_ptr,
    qk_scale, stride_q_token, stride_q_head, stride_o_token, stride_o_head, stride_block_table, num_kv_heads, batch,
    num_q_tiles, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_Q: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, Q_SMEM_LAYOUT: gl.constexpr,
    KV_SMEM_LAYOUT: gl.constexpr, STAGED_SLOTS: gl.constexpr,
):
    WARPGROUPS: gl.constexpr = BLOCK_M // 64
    CHUNK: gl.constexpr = min(BLOCK_N, BLOCK_SIZE)
    CHUNKS: gl.constexpr = BLOCK_N // CHUNK
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_bufs = gl.allocate_shared_memory(dtype, [2 * WARPGROUPS, 64, HEAD_DIM], Q_SMEM_LAYOUT)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_SMEM_LAYOUT)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], KV_SMEM_LAYOUT)
    k_staged = gl.allocate_shared_memory(k_desc.dtype, [STAGED_SLOTS, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_staged = gl.allocate_shared_memory(v_desc.dtype, [STAGED_SLOTS * CHUNKS, HEAD_DIM, CHUNK], v_desc.layout)
    SCALE_SPREAD: gl.constexpr = max(1, 32 // CHUNK)  # a row of scales every 128 bytes (_copy_tile's SPREAD)
    ks_staged = gl.allocate_shared_memory(ks_desc.dtype, [STAGED_SLOTS * CHUNKS * SCALE_SPREAD, 1, CHUNK],
                                          ks_desc.layout)
    vs_staged = gl.allocate_shared_memory(vs_desc.dtype, [STAGED_SLOTS * CHUNKS * SCALE_SPREAD, 1, CHUNK],
                                          vs_desc.layout)
    # The consumers' rings (freed by every warpgroup), then the staging rings (freed by the converter).
    ready_k, free_k = _ring(NUM_STAGES, WARPGROUPS)
    ready_v, free_v = _ring(NUM_STAGES, WARPGROUPS)
    ready_ke, free_ke = _ring(STAGED_SLOTS, 1)
    ready_ve, free_ve = _ring(STAGED_SLOTS, 1)
    ready_ks, free_ks = _ring(STAGED_SLOTS, 1)
    ready_vs, free_vs = _ring(STAGED_SLOTS, 1)
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready, item_free = _ring(2, WARPGROUPS + 1)  # the converter reads every item too
    fence_async_shared()

    if WARPGROUPS == 1:
        gl.warp_specialize([
            (_attend_partition, (q_ptr, o_ptr, q_bufs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items,
                                 item_ready, item_free, qk_scale, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch,
                                 num_q_tiles, stride_q_token, stride_q_head, stride_o_token, stride_o_head, 0, GROUP,
                                 BLOCK_Q, BLOCK_N, HEAD_DIM, NUM_STAGES)),
            (_load_kv_partition, (k_desc, v_desc, ks_desc, vs_desc, k_staged, v_staged, ks_staged, vs_staged,
                                  ready_ke, ready_ve, ready_ks, ready_vs, free_ke, free_ve, free_ks, free_vs, items,
                                  item_ready, item_free, counter_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
                                  block_tables_ptr, stride_block_table, num_kv_heads, batch, num_q_tiles, HEAD_DIM,
                                  BLOCK_SIZE, BLOCK_Q, BLOCK_N, STAGED_SLOTS, True)),
            (_convert_partition, (k_staged, v_staged, ks_staged, vs_staged, ready_ke, ready_ve, ready_ks, ready_vs,
                                  free_ke, free_ve, free_ks, free_vs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v,
                                  items, item_ready, item_free, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch,
                                  num_q_tiles, HEAD_DIM, BLOCK_SIZE, BLOCK_Q, BLOCK_N, NUM_STAGES, STAGED_SLOTS)),
        ], [1, 4], [24, 96])
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
            (_load_kv_partition, (k_desc, v_desc, ks_desc, vs_desc, k_staged, v_staged, ks_staged, vs_staged,
                                  ready_ke, ready_ve, ready_ks, ready_vs, free_ke, free_ve, free_ks, free_vs, items,
                                  item_ready, item_free, counter_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
                                  block_tables_ptr, stride_block_table, num_kv_heads, batch, num_q_tiles, HEAD_DIM,
                                  BLOCK_SIZE, BLOCK_Q, BLOCK_N, STAGED_SLOTS, True)),
            (_convert_partition, (k_staged, v_staged, ks_staged, vs_staged, ready_ke, ready_ve, ready_ks, ready_vs,
                                  free_ke, free_ve, free_ks, free_vs, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v,
                                  items, item_ready, item_free, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch,
                                  num_q_tiles, HEAD_DIM, BLOCK_SIZE, BLOCK_Q, BLOCK_N, NUM_STAGES, STAGED_SLOTS)),
        ], [4, 1, 4], [216, 24, 72])


def _e4m3_descriptor(rows: torch.Tensor, box: list) -> TensorDescriptor:
    """A TMA descriptor of a contiguous 2-D view: box-sized tiles of codes in the default shared
    layout, or a [1, keys] row of scales unswizzled (a swizzled one would have to start on a whole
    swizzle atom of several rows, and the rows of a tile sit one row apart)."""
    if rows.dtype == torch.float32:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    else:
        layout = gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv)
    return TensorDescriptor(rows, list(rows.shape), [rows.shape[1], 1], box, layout)


def prefill_attention_hopper_e4m3(q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, seq_lens, block_tables, out,
                                  qk_scale, group, max_q_len, config):
    """Launch the e4m3 kernel: as kernels/prefill_attention_hopper.prefill_attention_hopper, over an
    e4m3 cache with a key-major V and head-major scales (kernels/fp8.empty_kv_scales), all checked
    by `supports`. Writes `out` in place and returns it."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    chunk = min(config["BLOCK_N"], block_size)
    # The memory of a key-major V is [blocks, Hkv, D, block_size], of head-major scales
    # [blocks, Hkv, block_size]: these views are it, no copy.
    k_desc = _e4m3_descriptor(k_cache.view(num_blocks * block_size, num_kv_heads * head_dim), [chunk, head_dim])
    v_desc = _e4m3_descriptor(v_cache.permute(0, 2, 3, 1).reshape(-1, block_size), [head_dim, chunk])
    ks_desc = _e4m3_descriptor(k_scale.permute(0, 2, 1).reshape(-1, block_size), [1, chunk])
    vs_desc = _e4m3_descriptor(v_scale.permute(0, 2, 1).reshape(-1, block_size), [1, chunk])
    grid, counter, block_q, num_q_tiles, q_layout, kv_layout = launch_geometry(q, seq_lens, max_q_len, group,
                                                                               num_kv_heads, config)
    _prefill_attention_hopper_e4m3_kernel[grid](
        q, k_desc, v_desc, ks_desc, vs_desc, out, cu_seqlens_q, seq_lens, block_tables, counter, qk_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), num_kv_heads,
        seq_lens.shape[0], num_q_tiles, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q,
        Q_SMEM_LAYOUT=q_layout, KV_SMEM_LAYOUT=kv_layout, STAGED_SLOTS=E4M3_STAGES, **config, num_warps=4)
    return out
