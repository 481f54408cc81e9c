"""A step's inputs built from the scheduled batch alone, without a model: positions, slots, query
offsets, which rows sample, and where pending tokens come from."""
import torch

from tritonllm.engine.block_manager import BlockManager
from tritonllm.engine.scheduler import Scheduler
from tritonllm.engine.sequence import Sequence
from tritonllm.engine.step_inputs import build_step_inputs
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
