"""Continuous batching: chunked prefill under a token budget, decode otherwise, preemption by recompute.

The engine schedules step N + 1 before step N's sampled tokens reach the host: `launched` appends
a PENDING placeholder for each token a step samples, `resolve` fills them in later. A sequence
that a step-N token finishes (EOS, stop token) has already run in step N + 1: that row is dropped.
"""
from collections import deque

from tritonllm.engine.block_manager import BlockManager
from tritonllm.engine.sequence import PENDING, Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, eos_ids: set[int]):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_ids = eos_ids
        self.waiting: deque[Sequence] = deque()  # the head may be partly prefilled (holding blocks)
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> tuple[list[Sequence], list[int], bool]:
        """The next step: (sequences, new tokens of each, is_prefill)."""
        seqs, num_new = self._schedule_prefill()
        if seqs:
            return seqs, num_new, True
        return self._schedule_decode(), [], False

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
        scheduled, held = [], []
        while self.running:
            seq = self.running.popleft()
            if seq.num_completion_tokens >= seq.params.max_tokens:
                held.append(seq)  # its last token is pending: it finishes when that arrives
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        self.running.extend(scheduled + held)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it first: its prompt and output so far are recomputed later."""
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def launched(self, seqs: list[Sequence], num_new: list[int]) -> list[tuple[Sequence, int]]:
        """Account a step just launched: its computed tokens, and a PENDING placeholder for each token
        it samples. Returns (sequence, index of the placeholder) per sampled row, in row order."""
        rows = []
        for i, seq in enumerate(seqs):
            seq.num_computed_tokens = len(seq) if not num_new else seq.num_computed_tokens + num_new[i]
            if seq.num_computed_tokens == len(seq):  # reached the end: a token was sampled
                rows.append((seq, len(seq)))
                seq.token_ids.append(PENDING)
        return rows

    def resolve(self, rows: list[tuple[Sequence, int]], token_ids: list[int]) -> list[Sequence]:
        """Fill in a step's sampled tokens (rows as `launched` returned them); finish the sequences
        they end. Returns the sequences that got their token, skipping rows of sequences that
        finished since the step was launched."""
        resolved = []
        for (seq, index), token in zip(rows, token_ids):
            if index >= len(seq):  # the sequence stopped before this token
                continue
            seq.token_ids[index] = token
            self.block_manager.register_computed_blocks(seq)
            resolved.append(seq)
            reason = self._finish_reason(seq, index)
            if reason:
                self.finish(seq, reason)
        return resolved

    def _finish_reason(self, seq: Sequence, index: int) -> str | None:
        params, token = seq.params, seq.token_ids[index]
        num_completion = index + 1 - seq.num_prompt_tokens
        if num_completion >= params.max_tokens:
            return "length"
        if num_completion <= params.min_tokens:
            return None
        if (not params.ignore_eos and token in self.eos_ids) or token in params.stop_token_ids:
            return "stop"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop seq (also from outside: a stop string found in its text); tokens still pending after
        its last known one are dropped."""
        del seq.token_ids[seq.num_prompt_tokens + len(seq.completion_token_ids):]
        seq.finish_reason, seq.status = reason, SequenceStatus.FINISHED
        self.block_manager.deallocate(seq)
        (self.running if seq in self.running else self.waiting).remove(seq)
