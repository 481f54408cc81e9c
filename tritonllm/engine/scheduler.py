"""Continuous batching: chunked prefill under a token budget, decode otherwise, preemption by recompute."""
from collections import deque

from tritonllm.engine.block_manager import BlockManager
from tritonllm.engine.sequence import Sequence, SequenceStatus


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
        scheduled = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it first: its prompt and output so far are recomputed later."""
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], num_new: list[int], token_ids: list[int | None]) -> list[Sequence]:
        """Account the computed tokens, append the sampled ones, stop finished sequences; returns those."""
        finished = []
        for i, seq in enumerate(seqs):
            seq.num_computed_tokens = len(seq) if not num_new else seq.num_computed_tokens + num_new[i]
            self.block_manager.register_computed_blocks(seq)
            token = token_ids[i]
            if token is None:  # a prefill chunk that did not reach the end of the prompt
                continue
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if seq.num_completion_tokens >= params.max_tokens:
            return "length"
        if seq.num_completion_tokens <= params.min_tokens:
            return None
        if (not params.ignore_eos and token in self.eos_ids) or token in params.stop_token_ids:
            return "stop"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop seq from outside (a stop string found in its text)."""
        seq.finish_reason, seq.status = reason, SequenceStatus.FINISHED
        self.block_manager.deallocate(seq)
        self.running.remove(seq)
