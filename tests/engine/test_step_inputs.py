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



def check_copies(gathered, block_tables, held):
    """block_copies' answer: each distinct held block copied once, each table entry within a
    sequence's held blocks pointing at its block's copy, the rest zero."""
    blocks, tables = gathered
    assert blocks.dtype == torch.int32 and tables.shape == block_tables.shape
    assert sorted(blocks.tolist()) == sorted({b for table in held for b in table})
    for row, table in zip(tables.tolist(), held):
        assert [blocks[i].item() for i in row[:len(table)]] == table
        assert row[len(table):] == [0] * (len(row) - len(table))


def test_prefill_over_block_copies_of_a_scheduled_step():
    scheduler, seqs = setup(20, 9, 5, 7)  # the third prompt chunked: its first 6 tokens
    batch = scheduler.schedule()
    assert batch.num_new == [9, 5, 6]
    inputs = build_step_inputs(batch, {}, BS, gather_limit=64)
    held = [seq.block_table[:-(-n // BS)] for seq, n in zip(seqs, [9, 5, 6])]
    check_copies((inputs.gather_blocks, inputs.gather_tables), inputs.block_tables, held)
    assert build_step_inputs(batch, {}, BS).gather_blocks is None  # no limit: the cache is read in place


def test_block_copies_share_a_block_and_stop_at_the_limit():
    # A block two sequences hold (a prefix hit) is copied once; past the limit there are no copies.
    tables = [np.array([5, 2, 9], dtype=np.int32), np.array([5, 7], dtype=np.int32),
              np.array([3, 1, 8, 4], dtype=np.int32)]  # the third's last two blocks past its 7 tokens
    block_tables = np.zeros((3, 4), dtype=np.int32)
    for row, table in zip(block_tables, tables):
        row[:len(table)] = table
    seq_lens = np.array([9, 5, 7])
    held = [[5, 2, 9], [5, 7], [3, 1]]
    check_copies(block_copies(tables, block_tables, seq_lens, BS, 6), block_tables, held)
    assert block_copies(tables, block_tables, seq_lens, BS, 5) is None
