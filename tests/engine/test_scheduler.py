from collections import deque

from tritonllm.engine.block_manager import BlockManager
from tritonllm.engine.scheduler import Scheduler
from tritonllm.engine.sequence import Sequence, SequenceStatus
from tritonllm.sampling_params import SamplingParams

BS = 4
EOS = 0


def make(num_blocks=64, max_num_seqs=8, budget=64):
    return Scheduler(BlockManager(num_blocks, BS), max_num_seqs, budget)


def add(scheduler, n, **params):
    s = Sequence(list(range(1, n + 1)), SamplingParams(**params), BS)
    scheduler.add(s)
    return s


def step(scheduler, token=7):
    """One step whose sampled tokens arrive at once; a sequence finishes at max_tokens or, past
    min_tokens, at EOS (the engine's rule). Returns the step and the sequences it finished."""
    batch = scheduler.schedule()
    scheduler.launched(batch)
    finished = []
    for seq in batch.sampling_seqs:
        seq.append_token(token)
        n = len(seq.completion_token_ids)
        if n >= seq.params.max_tokens or (n > seq.params.min_tokens and token == EOS and not seq.params.ignore_eos):
            scheduler.finish([seq], "stop")
            finished.append(seq)
    return batch.seqs, batch.num_new, batch.is_prefill, finished


def test_prefill_then_decode_until_max_tokens():
    s = make()
    a, b = add(s, 5, max_tokens=3), add(s, 9, max_tokens=3)
    seqs, num_new, is_prefill, _ = step(s)
    assert is_prefill and seqs == [a, b] and num_new == [5, 9]
    seqs, _, is_prefill, _ = step(s)
    assert not is_prefill and seqs == [b, a]  # decode: the longest context first
    _, _, _, finished = step(s)
    assert finished == [b, a] and all(x.num_completion_tokens == 3 for x in (a, b))
    assert s.is_finished() and s.block_manager.num_free_blocks == 64


def test_decode_batch_is_longest_context_first():
    # The decode kernel starts rows in batch order, so long rows go first and short ones fill in
    # at the end. Ties keep the running order, and the running order itself (the preemption
    # order) stays the arrival order.
    s = make()
    a, b, c, d = add(s, 5), add(s, 17), add(s, 9), add(s, 9)
    step(s)  # prefill
    seqs, _, is_prefill, _ = step(s)
    assert not is_prefill and seqs == [b, c, d, a]
    assert list(s.running) == [a, b, c, d]
    # Contexts, not prompts: e (prompt 12) joins after the others decoded 6 more tokens.
    for _ in range(5):
        step(s)
    e = add(s, 12)
    step(s)  # e's prefill
    seqs, _, _, _ = step(s)
    assert seqs == [b, c, d, e, a]  # contexts 24, 16, 16, 13, 12


def test_chunked_prefill_respects_the_budget():
    s = make(budget=8)
    a = add(s, 20)
    b = add(s, 3)
    chunks = []
    while True:
        seqs, num_new, is_prefill, _ = step(s)
        if not is_prefill:
            break
        chunks.append(list(zip([x is a for x in seqs], num_new)))
    assert chunks == [[(True, 8)], [(True, 8)], [(True, 4), (False, 3)]]
    # The loop ended on a decode step, which computed each prompt's first sampled token too.
    assert a.num_computed_tokens == 21 and b.num_computed_tokens == 4


def test_running_sequences_decode_every_other_step_while_prompts_keep_arriving():
    # Prefill went first whenever a prompt could be admitted: one-token requests arriving at every
    # step gave the running sequence no decode step until they stopped.
    s = make()
    a = add(s, 5, max_tokens=20)
    kinds = []
    for _ in range(20):
        add(s, 3, max_tokens=1)
        seqs, _, is_prefill, _ = step(s)
        kinds.append("p" if is_prefill else "d")
    assert "".join(kinds) == "pd" * 10
    assert a.num_completion_tokens == 11 and s.block_manager.num_free_blocks == 64 - len(a.block_table)


def test_a_long_prompts_chunks_let_the_running_sequences_decode_between_them():
    s = make(budget=8)
    a = add(s, 3, max_tokens=10)
    step(s)
    b = add(s, 30, max_tokens=2)
    steps = [step(s)[:3] for _ in range(9)]
    assert [(is_prefill, num_new) for _, num_new, is_prefill in steps] == [
        (False, [1]), (True, [8]), (False, [1]), (True, [8]), (False, [1]), (True, [8]), (False, [1]), (True, [6]),
        (False, [1, 1])]
    assert b.is_finished and b.num_completion_tokens == 2 and a.num_completion_tokens == 6


def test_eos_stops_after_min_tokens_unless_ignored():
    s = make()
    a, b, c = add(s, 3, max_tokens=10), add(s, 3, max_tokens=10, ignore_eos=True), add(s, 3, max_tokens=10, min_tokens=2)
    step(s)  # prefill samples token 7
    _, _, _, finished = step(s, token=EOS)
    assert finished == [a] and a.finish_reason == "stop"
    _, _, _, finished = step(s, token=EOS)
    assert finished == [c] and c.num_completion_tokens == 3
    assert b.status == SequenceStatus.RUNNING


def test_preemption_when_blocks_run_out_and_everyone_finishes():
    s = make(num_blocks=6)
    seqs = [add(s, 4, max_tokens=8) for _ in range(3)]  # 3 blocks now, 9 needed at the end
    finished = []
    for _ in range(100):
        if s.is_finished():
            break
        finished += step(s)[3]
    assert s.num_preemptions > 0
    assert sorted(x.seq_id for x in finished) == sorted(x.seq_id for x in seqs)
    assert all(x.num_completion_tokens == 8 for x in seqs)
    assert s.block_manager.num_free_blocks == 6


def test_a_sequence_preempted_while_a_prompt_is_half_prefilled_queues_behind_it():
    # The half-prefilled prompt holds all its blocks. Queued ahead of it, the preempted sequence
    # could not be allocated and the prompt could not go on: nothing ran, though each fits alone.
    s = make(num_blocks=4, budget=8)
    a = add(s, 3, max_tokens=12)
    step(s)  # prefill a
    step(s)  # decode a: 5 tokens now, its next one needs a second block
    b = add(s, 9, max_tokens=2)
    seqs, num_new, is_prefill, _ = step(s)
    assert is_prefill and seqs == [b] and num_new == [8] and s.block_manager.num_free_blocks == 0
    seqs, num_new, is_prefill, _ = step(s)  # a cannot decode: preempted; b's last chunk runs
    assert is_prefill and seqs == [b] and num_new == [1] and list(s.waiting) == [a] and s.num_preemptions == 1
    for _ in range(40):
        if s.is_finished():
            break
        step(s)
    assert a.num_completion_tokens == 12 and b.num_completion_tokens == 2
    assert s.block_manager.num_free_blocks == 4


def test_max_num_seqs_limits_the_batch():
    s = make(max_num_seqs=2)
    for _ in range(3):
        add(s, 2)
    seqs, _, is_prefill, _ = step(s)
    assert is_prefill and len(seqs) == 2
    seqs, _, is_prefill, _ = step(s)
    assert not is_prefill and len(seqs) == 2


def test_a_step_launched_before_the_previous_resolves():
    """The engine schedules step N + 1 with step N's tokens pending: the pending token counts in
    the length, a sequence at max_tokens waits for its last token unscheduled, and finishing
    frees the blocks at once whatever is still in flight."""
    s = make()
    a, b = add(s, 3, max_tokens=10), add(s, 5, max_tokens=2)
    step(s)  # prefill: both sample their first token
    batch_n = s.schedule()
    s.launched(batch_n)
    assert batch_n.sampling_seqs == [b, a] and a.num_pending == 1 and len(a) == 5 and a.completion_token_ids == [7]
    batch_next = s.schedule()
    assert batch_next.seqs == [a] and not batch_next.is_prefill  # b holds max_tokens with its last token pending
    s.launched(batch_next)
    assert a.num_pending == 2 and a.num_completion_tokens == 3 and a.num_computed_tokens == 5
    a.append_token(EOS)
    b.append_token(9)
    s.finish([a], "stop")
    s.finish([b], "length")
    assert a.is_finished and a.completion_token_ids == [7, EOS] and b.completion_token_ids == [7, 9]
    assert s.is_finished() and s.block_manager.num_free_blocks == 64


def test_recompute_all_requeues_everything_with_known_tokens_only():
    s = make(budget=4)
    a, b = add(s, 6, max_tokens=5), add(s, 2, max_tokens=5)
    step(s)  # a's first chunk of 4
    batch = s.schedule()  # the rest of a and all of b, launched but never resolved
    s.launched(batch)
    assert a.num_pending == 1
    s.recompute_all()
    assert list(s.waiting) == [a, b] and not s.running
    assert all(x.num_pending == 0 and x.num_computed_tokens == 0 and not x.block_table for x in (a, b))
    assert len(a) == 6 and s.block_manager.num_free_blocks == 64
    while not s.is_finished():
        step(s)
    assert a.num_completion_tokens == 5 and b.num_completion_tokens == 5


def test_finishing_many_keeps_the_rest_in_order_and_frees_every_block():
    """An abort of many requests at once (running, a partly prefilled head, waiting ones in any
    order) leaves the others queued as they were, with every block of the finished ones free."""
    s = make(num_blocks=64, max_num_seqs=2, budget=8)
    running = add(s, 3, max_tokens=9)
    head = add(s, 12, max_tokens=9)  # its first chunk leaves it partly prefilled, first in line
    waiting = [add(s, 2 + i, max_tokens=9) for i in range(7)]
    step(s)
    assert s.running == deque([running]) and s.waiting[0] is head and head.block_table
    gone = [waiting[5], running, waiting[0], head, waiting[3]]
    s.finish(gone, "abort")
    assert list(s.waiting) == [waiting[i] for i in (1, 2, 4, 6)] and not s.running
    assert all(seq.is_finished and not seq.block_table for seq in gone)
    s.finish(list(s.waiting), "abort")
    assert s.is_finished() and s.block_manager.num_free_blocks == 64
