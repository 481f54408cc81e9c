"""vLLM's prompt_logprobs: each prompt token's log-probability given the tokens before it, scored
from the logits of the position before it while the prompt is prefilled, chunk by chunk.

The host plans which positions of a prefill step are scored (`prompt_logprob_spans`); every rank
runs the LM head over them (under tensor parallelism its gather is a collective) a few hundred rows
at a time, so their logits never take much memory; rank 0 scores them, and the scores reach the host
with the step's sampled tokens. A chunk scores from its start or past the scores its sequence holds,
whichever is later: a chunk's start is past every position in flight, and a prompt computed again
starts past its scores (a preempted one is scheduled again only after the step in flight at its
preemption is resolved; a failed step's scores are lost with it).
"""
from dataclasses import dataclass

import torch

from tritonllm.engine.sampled_tokens import agreeing_top
from tritonllm.engine.scheduler import ScheduledBatch
from tritonllm.engine.sequence import Sequence

ROWS_PER_PASS = 512  # positions whose logits exist at once: 512 x 151936 bf16 is 156 MB


@dataclass
class PromptSpan:
    """Prompt positions first .. first + count - 1 of seq, at rows row .. row + count - 1 of a step's tokens."""
    seq: Sequence
    row: int
    first: int
    count: int


def prompt_logprob_spans(batch: ScheduledBatch) -> list[PromptSpan]:
    """The positions a prefill step scores: those of each chunk not launched before, short of the
    prompt's last position (its logits are the ones sampled)."""
    spans, row = [], 0
    for seq, n in zip(batch.seqs, batch.num_new):
        if seq.needs_prompt_logprobs:
            start = seq.num_computed_tokens
            first, end = max(start, len(seq.prompt_logprobs)), min(start + n, seq.num_prompt_tokens - 1)
            if end > first:
                spans.append(PromptSpan(seq, row + first - start, first, end - first))
        row += n
    return spans


def score_positions(model, ops, hidden: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                    k: int) -> tuple | None:
    """Every rank: the LM head over hidden[rows], ROWS_PER_PASS rows at a time. Rank 0 (where
    compute_logits gives logits) returns (the ranks of token_ids [M] int64: the logits at or above
    each one's, itself included, as vLLM v1 counts, so ties rank last and the likeliest alone is 1), their logprobs [M] float32, and with k > 0 the k likeliest per row as
    (values [M, k], ids [M, k])); the other ranks None."""
    ranks, logprobs, values, ids = [], [], [], []
    for i in range(0, len(rows), ROWS_PER_PASS):
        logits = model.compute_logits(hidden[rows[i:i + ROWS_PER_PASS]])
        if logits is None:
            continue
        targets = token_ids[i:i + ROWS_PER_PASS]
        ranks.append((logits >= logits.gather(1, targets[:, None])).sum(1).clamp_min(1))  # 1 for a NaN logit
        logprobs.append(ops.compute_logprobs(logits, targets))
        if k:
            top = agreeing_top(ops.compute_top_logprobs(logits, min(k, logits.shape[1])), targets, logprobs[-1])
            values.append(top[0])
            ids.append(top[1])
    if not logprobs:
        return None
    return torch.cat(ranks), torch.cat(logprobs), (torch.cat(values), torch.cat(ids)) if k else None


def add_prompt_logprobs(spans: list[PromptSpan], ranks: list[int], logprobs: list[float],
                        top: tuple[list, list] | None) -> None:
    """Append a resolved step's scores to their sequences (those finished since drop theirs)."""
    at = 0
    for span in spans:
        seq, end = span.seq, at + span.count
        if not seq.is_finished:
            seq.prompt_logprobs += logprobs[at:end]
            seq.prompt_ranks += ranks[at:end]
            k = seq.params.prompt_logprobs
            if k:
                seq.prompt_top_logprobs += [dict(zip(i[:k], v[:k])) for v, i in zip(top[0][at:end], top[1][at:end])]
        at = end
