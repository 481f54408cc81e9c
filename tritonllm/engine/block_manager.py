"""Paged KV-cache blocks with reference counts and prefix caching.

A full block is identified by an xxhash of (the previous block's hash, its token ids), so equal
prefixes map to equal hash chains. A block is registered under its hash only once its K/V are
computed; a hit is confirmed by comparing token ids. Freed blocks keep their contents and hash
and are reused least-recently-freed first, so a later request can still hit them.
"""
from collections import OrderedDict

import numpy as np
import xxhash

from tritonllm.engine.sequence import Sequence


def block_hash(token_ids: list[int], parent: int) -> int:
    h = xxhash.xxh64()
    h.update(parent.to_bytes(8, "little", signed=True))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest() >> 1  # keep it a non-negative int64


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not a registered full block
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def _fresh_block(self) -> Block:
        """A free block for new contents: evicts what the least recently freed block cached."""
        block = self.blocks[self.free.popitem(last=False)[0]]
        if block.hash != -1:
            if self.hash_to_block.get(block.hash) == block.block_id:
                del self.hash_to_block[block.hash]
                self.num_evictions += 1
            block.hash, block.token_ids = -1, []
        block.ref_count = 1
        return block

    def _hash(self, seq: Sequence, i: int) -> int:
        """The hash chain's entry for seq's full block i, computed once (a request waiting for free
        blocks asks again every step, for prefixes of thousands of blocks)."""
        hashes = seq.block_hashes or []  # () until the first hash (Sequence)
        while len(hashes) <= i:
            hashes.append(block_hash(seq.block_tokens(len(hashes)), hashes[-1] if hashes else -1))
        seq.block_hashes = hashes
        return hashes[i]

    def _cached_block(self, seq: Sequence, i: int) -> Block | None:
        block_id = self.hash_to_block.get(self._hash(seq, i))
        if block_id is None or self.blocks[block_id].token_ids != seq.block_tokens(i):
            return None
        return self.blocks[block_id]

    def _prefix_hits(self, seq: Sequence) -> list[Block]:
        """The cached blocks allocate(seq) reuses: its longest chain of full prefix blocks in the cache.

        The block holding the last token is never taken from the cache, so at least one token
        is computed (a full prefix hit recomputes its last block). A prompt whose logprobs are still
        to be scored reuses none: each position's logits are computed.
        """
        hits = []
        for i in range(0 if seq.needs_prompt_logprobs else (len(seq) - 1) // self.block_size):
            block = self._cached_block(seq, i)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether the free list holds seq's blocks. A prefix hit on a block that running sequences
        hold takes none from it (the siblings of an n > 1 request, a shared system prompt), so in a
        tight cache the prefix is walked: otherwise such a request waits until the holder finishes
        and often finds the prefix evicted by then."""
        if self.num_free_blocks >= seq.num_blocks:
            return True
        held = sum(block.ref_count > 0 for block in self._prefix_hits(seq))
        return self.num_free_blocks >= seq.num_blocks - held

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its tokens, reusing cached full blocks of its prefix (_prefix_hits)."""
        assert not seq.block_table
        hits = self._prefix_hits(seq)
        for block in hits:
            if block.ref_count == 0:
                self.free.pop(block.block_id)
            block.ref_count += 1
        seq.block_table = [block.block_id for block in hits]
        for _ in range(len(hits), seq.num_blocks):
            seq.block_table.append(self._fresh_block().block_id)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        if seq.num_cached_tokens is None:  # the first allocation; a preempted one's later hits are its own blocks
            seq.num_cached_tokens = seq.num_computed_tokens

    def deallocate(self, seq: Sequence) -> None:
        """Release seq's blocks; the tail is freed first so it is evicted before the shared head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = ()  # no list while it waits (Sequence)
        seq.num_computed_tokens = seq.num_hashed_blocks = 0

    def can_append(self, seq: Sequence) -> bool:
        """Whether append_slot finds a slot for the token at index len(seq) - 1 (the one a decode step computes)."""
        return len(seq) <= len(seq.block_table) * self.block_size or self.num_free_blocks >= 1

    def append_slot(self, seq: Sequence) -> None:
        """Make room for the token at index len(seq) - 1."""
        if len(seq) > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._fresh_block().block_id)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Register the full blocks whose K/V are now computed, so later requests can hit them."""
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_hashed_blocks:  # the common case: called for every token, a block fills every block_size
            return
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash == -1:
                block.token_ids = seq.block_tokens(i)
                block.hash = self._hash(seq, i)
                self.hash_to_block.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = full
