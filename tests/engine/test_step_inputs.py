"""A step's inputs built from the scheduled batch alone, without a model: positions, slots, query
offsets, which rows sample, and where pending tokens come from."""
import numpy as np
import torch

from tritonllm.engine.block_manager import BlockManager
from tritonllm.engine.scheduler import Scheduler
from tritonllm.engine.sequence import Sequence
from tritonllm.engine.step_inputs import block_copies, build_step_inputs
from tritonllm.sampling_params import SamplingParams

BS = 4


def setup(budget, *lengths):
    scheduler = Scheduler(BlockManager(32, BS), 8, budget)
    seqs = [Sequence(list(range(100 * i, 100 * i + n)), SamplingParams(max_tokens=5), BS) for i, n in enumerate(lengths)]
    for seq in seqs:
        scheduler.add(seq)
    return scheduler, seqs


def slots_of(seq, positions):
    return [seq.block_table[p // BS] * BS + p % BS for p in positions]


def test_prefill_with_a_chunk():
    scheduler, (a, b) = setup(12, 9, 7)  # a whole (9), b's first 3 of 7
    batch = scheduler.schedule()
    assert batch.is_prefill and batch.num_new == [9, 3] and batch.samples == [True, False]
    inputs = build_step_inputs(batch, {}, BS)
    assert inputs.token_ids.tolist() == a.token_ids + b.token_ids[:3]
    assert inputs.positions.tolist() == list(range(9)) + [0, 1, 2]
    assert inputs.slot_mapping.tolist() == slots_of(a, range(9)) + slots_of(b, range(3))
    assert inputs.cu_seqlens_q.tolist() == [0, 9, 12] and inputs.cu_seqlens_q.dtype == torch.int32
    assert inputs.seq_lens.tolist() == [9, 3] and inputs.seq_lens.dtype == torch.int32
    assert inputs.block_tables.tolist() == [a.block_table, b.block_table + [0]]  # zero-padded to the widest
    assert inputs.logit_rows.tolist() == [8] and inputs.max_q_len == 9 and inputs.max_seq_len == 9
    assert inputs.pending_rows is None
    scheduler.launched(batch)
    decode = scheduler.schedule()  # a decodes between b's chunks
    assert not decode.is_prefill and decode.seqs == [a]
    scheduler.launched(decode)
    # The rest of b: positions continue from its computed tokens; it samples now.
    batch = scheduler.schedule()
    inputs = build_step_inputs(batch, {a.seq_id: 0}, BS)
    assert batch.seqs == [b] and batch.samples == [True]
    assert inputs.positions.tolist() == [3, 4, 5, 6] and inputs.seq_lens.tolist() == [7]
    assert inputs.slot_mapping.tolist() == slots_of(b, range(3, 7)) and inputs.logit_rows.tolist() == [3]


def test_decode_reads_pending_tokens_from_the_previous_samples():
    scheduler, (a, b) = setup(64, 5, 4)
    first = scheduler.schedule()
    scheduler.launched(first)  # both sample: their first tokens are pending
    a.append_token(7)  # a's arrived, b's is still on the device
    batch = scheduler.schedule()
    assert not batch.is_prefill and batch.seqs == [a, b]
    inputs = build_step_inputs(batch, {a.seq_id: 0, b.seq_id: 1}, BS)
    assert inputs.pending_rows.tolist() == [-1, 1] and inputs.num_previous_samples == 2
    assert inputs.token_ids.tolist()[0] == 7
    assert inputs.positions.tolist() == [5, 4] and inputs.seq_lens.tolist() == [6, 5]
    assert inputs.slot_mapping.tolist() == slots_of(a, [5]) + slots_of(b, [4])  # b's 5th token opens its 2nd block
    assert inputs.cu_seqlens_q is None and inputs.logit_rows.tolist() == [0, 1] and inputs.max_seq_len == 6



def check_copies(gathered, block_tables, held, cached):
    """block_copies' answer: one copy of each distinct held block; the blocks holding cached tokens
    (the first cached[i] of held[i]) are gathered and take the first copies, in gather order; each
    table entry within a sequence's held blocks points at its block's copy, the rest zero."""
    blocks, tables, num_copies = gathered
    assert blocks.dtype == np.int32 and tables.shape == block_tables.shape
    assert num_copies == len({b for table in held for b in table})
    assert sorted(blocks.tolist()) == sorted({b for table, c in zip(held, cached) for b in table[:c]})
    block_of = {}
    for row, table in zip(tables.tolist(), held):
        for copy, block in zip(row, table):
            assert block_of.setdefault(copy, block) == block  # a copy holds one block
        assert row[len(table):] == [0] * (len(row) - len(table))
    assert sorted(block_of) == list(range(num_copies))
    assert [block_of[i] for i in range(len(blocks))] == blocks.tolist()


def check_step_copies(inputs, seqs, starts, counts):
    gathered = (inputs.gather_blocks.numpy(), inputs.gather_tables.numpy(), inputs.num_copies)
    held = [seq.block_table[:-(-(s + n) // BS)] for seq, s, n in zip(seqs, starts, counts)]
    check_copies(gathered, inputs.block_tables.numpy(), held, [-(-s // BS) for s in starts])
    # Each new token's copy slot: its position within its block's copy.
    expected = [int(inputs.gather_tables[i, p // BS]) * BS + p % BS
                for i, (s, n) in enumerate(zip(starts, counts)) for p in range(s, s + n)]
    assert inputs.copy_slots.dtype == torch.int64 and inputs.copy_slots.tolist() == expected


def test_prefill_over_block_copies_of_a_scheduled_step():
    scheduler, seqs = setup(20, 9, 5, 7)  # the third prompt chunked: its first 6 tokens
    batch = scheduler.schedule()
    assert batch.num_new == [9, 5, 6]
    inputs = build_step_inputs(batch, {}, BS, gather_limit=64)
    check_step_copies(inputs, seqs, [0, 0, 0], [9, 5, 6])
    assert len(inputs.gather_blocks) == 0  # nothing cached yet: the store writes every copied row
    plain = build_step_inputs(batch, {}, BS)  # no limit: the cache is read in place
    assert plain.gather_blocks is None and plain.copy_slots is None and plain.num_copies == 0
    scheduler.launched(batch)
    scheduler.launched(scheduler.schedule())  # the first two decode between the third's chunks
    # The third prompt's last token over its 6 cached ones, the first in a block it shares with them.
    batch = scheduler.schedule()
    assert batch.seqs == [seqs[2]] and batch.num_new == [1]
    inputs = build_step_inputs(batch, {seqs[0].seq_id: 0, seqs[1].seq_id: 1}, BS, gather_limit=64)
    check_step_copies(inputs, seqs[2:], [6], [1])
    assert inputs.gather_blocks.tolist() == seqs[2].block_table[:2]


def test_block_copies_share_a_block_and_stop_at_the_limit():
    # A block two sequences hold (a prefix hit) is copied once; past the limit there are no copies.
    # The first holds 4 cached tokens, the second 6 (its second block partly), the third none.
    tables = [np.array([5, 2, 9], dtype=np.int32), np.array([5, 7], dtype=np.int32),
              np.array([3, 1, 8, 4], dtype=np.int32)]  # the third's last two blocks past its 7 tokens
    block_tables = np.zeros((3, 4), dtype=np.int32)
    for row, table in zip(block_tables, tables):
        row[:len(table)] = table
    starts, seq_lens = np.array([4, 6, 0]), np.array([9, 8, 7])
    held, cached = [[5, 2, 9], [5, 7], [3, 1]], [1, 2, 0]
    gathered = block_copies(tables, block_tables, starts, seq_lens, BS, 6)
    check_copies(gathered, block_tables, held, cached)
    assert sorted(gathered[0].tolist()) == [5, 7]
    assert block_copies(tables, block_tables, starts, seq_lens, BS, 5) is None
