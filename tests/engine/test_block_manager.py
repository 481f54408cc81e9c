from tritonllm.engine.block_manager import BlockManager, block_hash
from tritonllm.engine.sequence import Sequence
from tritonllm.sampling_params import SamplingParams

BS = 4


def seq(tokens):
    return Sequence(tokens, SamplingParams(), BS)


def compute(manager, s):
    """What a prefill step does: all tokens computed, full blocks registered."""
    s.num_computed_tokens = len(s)
    manager.register_computed_blocks(s)


def test_hash_chain_depends_on_the_parent():
    assert block_hash([1, 2, 3, 4], -1) == block_hash([1, 2, 3, 4], -1)
    assert block_hash([1, 2, 3, 4], -1) != block_hash([1, 2, 3, 4], 7)
    assert block_hash([1, 2, 3, 4], -1) != block_hash([1, 2, 3, 5], -1)


def test_allocate_and_free_count_blocks():
    manager = BlockManager(10, BS)
    a = seq(list(range(9)))  # 3 blocks
    manager.allocate(a)
    assert len(a.block_table) == 3 and manager.num_free_blocks == 7 and a.num_cached_tokens == 0
    manager.deallocate(a)
    assert manager.num_free_blocks == 10 and not a.block_table


def test_prefix_hit_shares_computed_blocks_only():
    manager = BlockManager(10, BS)
    a = seq(list(range(10)))
    manager.allocate(a)
    b = seq(list(range(8)) + [99, 98, 97])
    manager.allocate(b)
    assert b.num_cached_tokens == 0  # a's blocks are not computed yet: no hit
    compute(manager, a)
    c = seq(list(range(8)) + [99])
    manager.allocate(c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == a.block_table[:2]
    assert manager.blocks[a.block_table[0]].ref_count == 2


def test_full_prefix_hit_recomputes_the_last_block():
    manager = BlockManager(10, BS)
    a = seq(list(range(8)))
    manager.allocate(a)
    compute(manager, a)
    b = seq(list(range(8)))
    manager.allocate(b)
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_freed_blocks_stay_cached_until_evicted_lru():
    manager = BlockManager(4, BS)
    a = seq(list(range(9)))  # blocks: 2 full + 1 partial
    manager.allocate(a)
    compute(manager, a)
    manager.deallocate(a)
    hit = seq(list(range(8)) + [5])
    manager.allocate(hit)
    assert hit.num_cached_tokens == 8
    manager.deallocate(hit)
    # Taking all 4 blocks evicts every cached one; the hashes no longer resolve.
    big = seq(list(range(100, 116)))
    manager.allocate(big)
    assert manager.num_evictions == 2 and not manager.hash_to_block
    manager.deallocate(big)
    again = seq(list(range(8)) + [5])
    manager.allocate(again)
    assert again.num_cached_tokens == 0


def test_hash_collision_guard_compares_tokens():
    manager = BlockManager(6, BS)
    a = seq([1, 2, 3, 4, 5])
    manager.allocate(a)
    compute(manager, a)
    block = manager.blocks[a.block_table[0]]
    block.token_ids = [9, 9, 9, 9]  # as if another prefix had hashed the same
    b = seq([1, 2, 3, 4, 5])
    manager.allocate(b)
    assert b.num_cached_tokens == 0


def test_append_slot_takes_a_block_at_each_boundary():
    manager = BlockManager(3, BS)
    a = seq([1, 2, 3, 4])
    manager.allocate(a)
    a.token_ids.append(5)
    assert manager.can_append(a)
    manager.append_slot(a)
    assert len(a.block_table) == 2 and manager.num_free_blocks == 1
    for t in (6, 7, 8):
        a.token_ids.append(t)
        manager.append_slot(a)
    assert len(a.block_table) == 2


def test_can_append_counts_the_token_the_step_computes():
    """The scheduler asks with that token already in len(seq) (pending): while the last block holds it
    no free block is needed, past the boundary one is."""
    manager = BlockManager(1, BS)
    a = seq([1, 2, 3])
    manager.allocate(a)
    a.token_ids.append(4)  # index 3: the last slot of the only block
    assert manager.num_free_blocks == 0 and manager.can_append(a)
    manager.append_slot(a)
    assert len(a.block_table) == 1
    a.token_ids.append(5)
    assert not manager.can_append(a)


def test_cached_tokens_are_the_first_allocations_prompt_hits():
    """After a preemption the sequence hits its own blocks, completion included: those are not cached prompt tokens."""
    manager = BlockManager(8, BS)
    compute(manager, _allocated(manager, seq(list(range(9)))))
    b = _allocated(manager, seq(list(range(8)) + [99]))
    assert b.num_cached_tokens == 8
    compute(manager, b)
    for token in (100, 101, 102, 103):  # generated: block 2 fills with [99, 100, 101, 102]
        b.token_ids.append(token)
        manager.append_slot(b)
        compute(manager, b)
    manager.deallocate(b)  # preempted
    manager.allocate(b)
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 8


def _allocated(manager, s):
    manager.allocate(s)
    return s


def test_can_allocate_counts_held_prefix_hits_as_free():
    """A prefix hit on a block another sequence holds takes nothing from the free list; a hit on a
    freed (still cached) block takes that block from it, so it counts as needed."""
    manager = BlockManager(6, BS)
    holder = _allocated(manager, seq(list(range(13))))  # 4 blocks, 3 of them full
    compute(manager, holder)
    sibling = seq(list(range(12)) + [50])  # 4 blocks, the first 3 hits
    assert manager.num_free_blocks == 2 and manager.can_allocate(sibling)
    manager.allocate(sibling)
    assert sibling.block_table[:3] == holder.block_table[:3] and manager.num_free_blocks == 1
    assert not manager.can_allocate(seq(list(range(12)) + [51, 52, 53, 54, 55]))  # 3 hits + 2 fresh blocks

    manager = BlockManager(5, BS)
    finished = _allocated(manager, seq(list(range(13))))
    compute(manager, finished)
    manager.deallocate(finished)  # its 3 full blocks stay cached, last in the LRU order
    _allocated(manager, seq(list(range(90, 98))))  # 2 fresh blocks: the unused one and finished's tail
    assert manager.num_free_blocks == 3
    assert not manager.can_allocate(seq(list(range(12)) + [50]))  # 3 cached hits + 1 fresh block
    fits = seq(list(range(12)))  # 2 cached hits + 1 fresh block
    assert manager.can_allocate(fits)
    manager.allocate(fits)
    assert fits.num_cached_tokens == 8 and manager.num_free_blocks == 0


def test_a_waiting_prompt_hashes_each_block_once(monkeypatch):
    # can_allocate walked (and hashed) the whole cached prefix at every step a request waited for blocks.
    manager = BlockManager(16, BS)
    a, c = seq(list(range(40))), seq(list(range(100, 116)))  # 10 blocks, computed and held; 4 more held
    for s in (a, c):
        manager.allocate(s)
        compute(manager, s)
    hashed = []
    monkeypatch.setattr("tritonllm.engine.block_manager.block_hash",
                        lambda tokens, parent: hashed.append(tokens) or block_hash(tokens, parent))
    b = seq(list(range(40)) + [99] * 12)  # 13 blocks: a's 10 and 3 more, of 2 free
    for _ in range(5):
        assert not manager.can_allocate(b)
    assert len(hashed) == 11  # the 10 hits and the first miss
    manager.deallocate(c)
    manager.allocate(b)
    assert b.num_cached_tokens == 40 and b.block_table[:10] == a.block_table and len(hashed) == 11
    compute(manager, b)  # 13 full blocks: 2 more hashed
    assert len(hashed) == 13
