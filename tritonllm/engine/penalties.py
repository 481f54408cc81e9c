"""The penalties' per-sequence state on the device (which buffer row each running sequence owns),
and the logit_bias and allowed_token_ids each sequence applies to its row."""
import torch

from tritonllm.engine.sequence import Sequence, SequenceStatus


class PenaltyRows:
    """Rows of two device buffers, one per running sequence with penalties: counts [R, V] int32 of
    its generated tokens and prompt_mask [R, V] uint8 of its prompt's tokens (the kernels'
    apply_penalties reads them). After sampling, count_tokens adds the sampled ids to the counts
    on the device, so the host never waits for them nor loops over the vocabulary.

    A sequence gets a row when it first samples after a prefill, when all its tokens are on the
    host: the row is filled from them. The row is given back once the sequence is no longer
    running (finished or preempted; a preempted one gets a fresh row when it samples again).
    A fill is launched after every update still in flight for the row's former owner, so the
    device applies them in order. The buffers are made on first use and grow to max_rows.
    """

    def __init__(self, ops, vocab: int, max_rows: int, device: torch.device, to_device):
        self.ops, self.vocab, self.max_rows, self.device = ops, vocab, max_rows, device
        self.to_device = to_device  # host tensor -> device without waiting for the device (pinned)
        self.counts = self.prompt_mask = None
        self.owner: dict[int, Sequence] = {}  # row -> its sequence
        self.row_of: dict[int, int] = {}  # seq_id -> row

    def rows(self, seqs: list[Sequence]) -> list[int] | None:
        """Each sequence's row (-1 without penalties), new rows filled; None if none has penalties."""
        for row, seq in list(self.owner.items()):  # first: a step without penalties lets finished ones go too
            if seq.status != SequenceStatus.RUNNING:
                del self.owner[row], self.row_of[seq.seq_id]
        if not any(seq.params.has_penalties for seq in seqs):
            return None
        new = [seq for seq in seqs if seq.params.has_penalties and seq.seq_id not in self.row_of]
        if new:
            self._assign(new)
        return [self.row_of.get(seq.seq_id, -1) for seq in seqs]

    def _assign(self, seqs: list[Sequence]) -> None:
        # Running sequences never outnumber max_rows (max_num_seqs), and only they keep rows.
        needed = len(self.owner) + len(seqs)
        capacity = 0 if self.counts is None else len(self.counts)
        if needed > capacity:
            self._grow(min(self.max_rows, 1 << (needed - 1).bit_length()))
        free = (row for row in range(len(self.counts)) if row not in self.owner)
        rows = []
        for seq, row in zip(seqs, free):
            self.owner[row], self.row_of[seq.seq_id] = seq, row
            rows.append(row)
        index = self.to_device(torch.tensor(rows))
        self.counts.index_fill_(0, index, 0)
        self.prompt_mask.index_fill_(0, index, 0)
        for buffer, tokens in ((self.counts, [s.completion_token_ids for s in seqs]),
                               (self.prompt_mask, [s.token_ids[:s.num_prompt_tokens] for s in seqs])):
            pairs = torch.tensor([(row, t) for row, ids in zip(rows, tokens) for t in ids], dtype=torch.int64)
            if len(pairs):
                pairs = self.to_device(pairs.T.contiguous())
                self.ops.count_tokens(buffer, pairs[0], pairs[1])

    def _grow(self, rows: int) -> None:
        counts = torch.zeros(rows, self.vocab, dtype=torch.int32, device=self.device)
        mask = torch.zeros(rows, self.vocab, dtype=torch.uint8, device=self.device)
        if self.counts is not None:
            counts[:len(self.counts)] = self.counts
            mask[:len(self.prompt_mask)] = self.prompt_mask
        self.counts, self.prompt_mask = counts, mask

    def reset(self) -> None:
        """Forget every row (after a failed step, whose in-flight updates the host never saw)."""
        self.owner.clear()
        self.row_of.clear()


def add_logit_bias(logits: torch.Tensor, seqs: list[Sequence], to_device) -> torch.Tensor | None:
    """A float32 copy of logits [B, V] with each row's logit_bias added (vLLM adds them in float32:
    bf16 would round small biases away) and, in a row with allowed_token_ids, -inf on every other
    token; None if no row has either. A sequence's ids and biases go to the device once and stay
    on it (`to_device`: host tensor -> device)."""
    biased = [(row, seq) for row, seq in enumerate(seqs) if seq.params.logit_bias]
    allowed = [(row, seq) for row, seq in enumerate(seqs) if seq.params.allowed_token_ids]
    if not biased and not allowed:
        return None
    out = logits.to(torch.float32, copy=True)  # a copy even of float32 logits: the raw ones give the logprobs
    if allowed:
        for _, seq in allowed:
            if seq.allowed_ids_tensor is None:
                seq.allowed_ids_tensor = to_device(torch.tensor(seq.params.allowed_token_ids))
        mask = torch.full((len(allowed), out.shape[1]), float("-inf"), device=out.device)
        mask[_pairs(range(len(allowed)), [seq.allowed_ids_tensor for _, seq in allowed])] = 0.0
        out.index_add_(0, to_device(torch.tensor([row for row, _ in allowed])), mask)  # no [n, V] temporary
    if biased:
        for _, seq in biased:
            if seq.logit_bias_tensors is None:
                bias = seq.params.logit_bias
                seq.logit_bias_tensors = (to_device(torch.tensor(list(bias))),
                                          to_device(torch.tensor(list(bias.values()), dtype=torch.float32)))
        where = _pairs([row for row, _ in biased], [seq.logit_bias_tensors[0] for _, seq in biased])
        # Each (row, token) comes once, so the accumulating put is a plain add.
        out.index_put_(where, torch.cat([seq.logit_bias_tensors[1] for _, seq in biased]), accumulate=True)
    return out


def _pairs(rows, ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, token id) index pairs of each row's ids on the device."""
    return torch.cat([torch.full_like(i, row) for row, i in zip(rows, ids)]), torch.cat(ids)
