"""Continuous batching: chunked prefill under a token budget, decode otherwise (and after each prefill
while sequences run), preemption by recompute.

The engine schedules step N + 1 before step N's sampled tokens reach the host: `launched` counts
a pending token for each row that samples, and the engine appends it when it arrives. A sequence
that a step-N token finishes has already run in step N + 1; the engine drops that row.
"""
from collections import deque
from dataclasses import dataclass

from tritonllm.engine.block_manager import BlockManager
from tritonllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step: the sequences, how many new tokens each computes, and which of them sample (a
    prefill chunk that stops short of the prompt's end does not). Decode computes one token each."""
    seqs: list[Sequence]
    num_new: list[int]
    is_prefill: bool
    samples: list[bool]

    @property
    def sampling_seqs(self) -> list[Sequence]:
        return [seq for seq, sample in zip(self.seqs, self.samples) if sample]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()  # the head may be partly prefilled (holding blocks)
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.after_prefill = False  # whether the last step scheduled was a prefill

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_first(self, seqs: list[Sequence]) -> None:
        """Queue seqs ahead of the other waiting ones (preempted sequences; the samples of a request
        whose first sample just prefilled their prompt: they hit its blocks while those are fresh),
        behind a head that is partly prefilled: it holds its prompt's blocks and goes on first, as
        nothing behind it could be allocated while it waits."""
        at = 1 if self.waiting and self.waiting[0].block_table else 0
        for i, seq in enumerate(seqs):
            self.waiting.insert(at + i, seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch | None:
        """The next step, or None when nothing can run. Prefill goes first, but not twice in a row while
        sequences run: prompts arriving at every step (or a long one's chunks) would stall their decoding."""
        if self.after_prefill and self.running:
            batch = self._decode_batch() or self._prefill_batch()
        else:
            batch = self._prefill_batch() or self._decode_batch()
        self.after_prefill = batch is not None and batch.is_prefill
        return batch

    def _prefill_batch(self) -> ScheduledBatch | None:
        seqs, num_new = self._schedule_prefill()
        if not seqs:
            return None
        samples = [seq.num_computed_tokens + n == len(seq) for seq, n in zip(seqs, num_new)]
        return ScheduledBatch(seqs, num_new, True, samples)

    def _decode_batch(self) -> ScheduledBatch | None:
        seqs = self._schedule_decode()
        return ScheduledBatch(seqs, [1] * len(seqs), False, [True] * len(seqs)) if seqs else None

    def _schedule_prefill(self):
        seqs, num_new, budget = [], [], self.max_num_batched_tokens
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
            n = min(len(seq) - seq.num_computed_tokens, budget)
            seqs.append(seq)
            num_new.append(n)
            budget -= n
            if seq.num_computed_tokens + n < len(seq):
                break  # a chunk: the rest of this prompt goes first next step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return seqs, num_new

    def _schedule_decode(self) -> list[Sequence]:
        # Each sequence leaves self.running only into scheduled or held (or waiting, preempted), so an
        # interrupt (Ctrl-C) anywhere in the loop leaves every one queued, and append_slot is idempotent.
        scheduled, held = [], []
        try:
            while self.running:
                seq = self.running[0]
                if seq.num_completion_tokens >= seq.params.max_tokens:
                    held.append(self.running.popleft())  # its last token is pending: it finishes when that arrives
                    continue
                fits = self.block_manager.can_append(seq)
                while not fits and len(self.running) > 1:
                    self._preempt(self.running[-1])
                    fits = self.block_manager.can_append(seq)
                if fits:
                    self.block_manager.append_slot(seq)
                    scheduled.append(self.running.popleft())
                else:
                    self._preempt(seq)
        finally:
            self.running.extendleft(reversed(scheduled + held))
        # Longest context first: the decode kernel starts rows in order, so the long rows start
        # first and short ones fill in at the end (kernels/decode_attention.py).
        return sorted(scheduled, key=lambda seq: seq.num_computed_tokens, reverse=True)

    def _preempt(self, seq: Sequence) -> None:
        """Free running seq's blocks and queue it first (add_first): its prompt and output so far are
        recomputed later."""
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.add_first([seq])

    def launched(self, batch: ScheduledBatch) -> None:
        """Account a step just launched: its computed tokens, and a pending token per sampling row."""
        for seq, n, sample in zip(batch.seqs, batch.num_new, batch.samples):
            seq.num_computed_tokens += n
            seq.num_pending += sample

    def finish(self, seqs: list[Sequence], reason: str) -> None:
        """Stop seqs (their last token, a stop string, an abort) and free their blocks at once; rows
        of them still in flight are dropped when they arrive. Many waiting ones leave in one pass over
        the queue (each remove() scans it from the head: aborting 32k newest first took seconds)."""
        waiting = set()
        for seq in seqs:
            seq.finish_reason, seq.status = reason, SequenceStatus.FINISHED
            self.block_manager.deallocate(seq)
            if seq in self.running:
                self.running.remove(seq)
            else:
                waiting.add(seq)
        if len(waiting) == 1:
            self.waiting.remove(*waiting)
        elif waiting:
            self.waiting = deque(seq for seq in self.waiting if seq not in waiting)

    def recompute_all(self) -> None:
        """Forget every computed and pending token and queue each sequence to be computed again, in
        order: the state to return to after a step failed midway (tokens already known are kept,
        cached prefix blocks stay reusable)."""
        seqs = list(self.running) + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        for seq in seqs:
            self.block_manager.deallocate(seq)
            seq.num_pending = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)
