"""The producer side of prefill_attention_hopper's kernel: which work item a program runs next, and
the warp that claims items, hands them to the consumers and copies their K/V tiles.

Work items are counted from a global counter (persistent programs); each item is a KV head, a
sequence and a tile of BLOCK_Q new tokens. The producer publishes each item it claims into a
two-entry ring in shared memory (`_publish_item`, read by the consumers with `_next_item`), then
copies the item's key tiles of K and V, slot by slot, into NUM_STAGES-deep rings with TMA.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# Triton 3.8 named the TMA global-to-shared copy async_load; 3.9 removed the older name.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.jit
def _work_item(w, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch, num_q_tiles, BLOCK_Q: gl.constexpr,
               BLOCK_N: gl.constexpr):
    """Work item w: (kv_head, q_start, q_len, q0, seq_len, num_full, num_tiles, block-table row index).
    Items run highest query tile first (they see the most keys), KV heads fastest; num_tiles is 0
    for a tile past its sequence's query."""
    per_tile = num_kv_heads * batch
    tile = num_q_tiles - 1 - w // per_tile
    seq = (w % per_tile) // num_kv_heads
    kv_head = w % num_kv_heads
    q_start = gl.load(cu_seqlens_q_ptr + seq)
    q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = gl.load(seq_lens_ptr + seq)
    q0 = tile * BLOCK_Q
    context = seq_len - q_len  # keys cached before the first new token
    # Tiles [0, num_full) are visible to every row (the first sits at context + q0); the rest, up
    # to the last row's position, are the diagonal.
    num_full = (context + q0 + 1) // BLOCK_N
    num_tiles = gl.where(q0 < q_len, gl.cdiv(gl.minimum(seq_len, context + q0 + BLOCK_Q), BLOCK_N), 0)
    return kv_head, q_start, q_len, q0, seq_len, num_full, num_tiles, seq


@gluon.jit
def _copy_tile(desc, bufs, ready, free, count, n0, block_table_row, seq_len, column, BLOCK_SIZE: gl.constexpr,
               BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The K or V tile of keys n0 .. n0 + BLOCK_N - 1, the count-th tile loaded, into its ring slot
    once the slot is free: one TMA copy per cache block the tile covers (or one, where it lies
    inside a block), all signalling the slot's `ready`."""
    CHUNK: gl.constexpr = min(BLOCK_N, BLOCK_SIZE)
    slot = count % NUM_STAGES
    # Slots start free: the first pass waits on the phase before the barrier's first one.
    mbarrier.wait(free.index(slot), ((count // NUM_STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes * (BLOCK_N // CHUNK))
    for c in gl.static_range(BLOCK_N // CHUNK):
        key = n0 + c * CHUNK
        # Table entries past the sequence are never read: such chunks copy block 0, whose keys the
        # consumers mask (scores) and zero (V) like any key past seq_len.
        block = gl.load(block_table_row + key // BLOCK_SIZE, mask=key < seq_len, other=0)
        row = block * BLOCK_SIZE + key % BLOCK_SIZE  # TMA coordinates are int32
        _tma_load(desc, [row, column], ready.index(slot), bufs.index(slot).slice(c * CHUNK, CHUNK))


@gluon.jit
def _publish_item(items, item_ready, item_free, j, w):
    """The producer's side of the item ring: item w, the j-th handed out, into entry j % 2."""
    mbarrier.wait(item_free.index(j % 2), ((j // 2) & 1) ^ 1)
    items.index(j % 2).store(gl.full([1], w, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    mbarrier.arrive(item_ready.index(j % 2), count=1)


@gluon.jit
def _next_item(items, item_ready, j):
    """The consumers' side: the j-th item handed out (num_items once there are no more). The entry is
    freed by the caller once all its warps are past reading it (after the item's first dot)."""
    mbarrier.wait(item_ready.index(j % 2), (j // 2) & 1)
    return gl.max(items.index(j % 2).load(gl.BlockedLayout([1], [32], [4], [0])), 0)


@gluon.jit
def _load_kv_partition(k_desc, v_desc, k_bufs, v_bufs, ready_k, ready_v, free_k, free_v, items, item_ready,
                       item_free, counter_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, stride_block_table,
                       num_kv_heads, batch, num_q_tiles, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                       BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    # K and V slots are freed apart (K once the scores are done, V once the PV dot is), so a K tile
    # can come in while the previous tile's V is still being read.
    num_items = num_q_tiles * num_kv_heads * batch
    count = 0  # tiles loaded so far: slot count % NUM_STAGES, pass count // NUM_STAGES
    j = 0  # items handed out so far
    w = gl.atomic_add(counter_ptr, 1, sem="relaxed")
    while w < num_items:
        w_next = gl.atomic_add(counter_ptr, 1, sem="relaxed")  # claimed now, waited for only at the loop's end
        kv_head, q_start, q_len, q0, seq_len, num_full, num_tiles, seq = _work_item(
            w, cu_seqlens_q_ptr, seq_lens_ptr, num_kv_heads, batch, num_q_tiles, BLOCK_Q, BLOCK_N)
        if num_tiles > 0:
            _publish_item(items, item_ready, item_free, j, w)
            j += 1
            block_table_row = block_tables_ptr + seq.to(gl.int64) * stride_block_table
            for i in range(num_tiles):
                _copy_tile(k_desc, k_bufs, ready_k, free_k, count, i * BLOCK_N, block_table_row, seq_len,
                           kv_head * HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_STAGES)
                _copy_tile(v_desc, v_bufs, ready_v, free_v, count, i * BLOCK_N, block_table_row, seq_len,
                           kv_head * HEAD_DIM, BLOCK_SIZE, BLOCK_N, NUM_STAGES)
                count += 1
        w = w_next
    _publish_item(items, item_ready, item_free, j, num_items)
