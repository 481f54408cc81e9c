"""What the model runner runs before serving, so that no Triton compile lands in the middle of it:
the batch sizes and context bounds of its decode CUDA graphs, prefill steps that reach every tuning
bucket, and a pass of the sampler's kernels at each batch bucket."""
import torch

from tritonllm.kernels.prefill_attention import enough_work_for_hopper
from tritonllm.kernels.tuning import pow2


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({min(s, max_num_seqs) for s in sizes} | {max_num_seqs})


# Decode steps whose contexts all fit this many keys (chat turns, the nano-vllm workload) replay graphs
# captured for it, so decode attention runs the configs tuned on such steps (bench/decode_workload.py)
# while steps with longer contexts keep those tuned on long rows: one config cannot serve both.
SHORT_CONTEXT = 2048


def graph_context_bounds(max_model_len: int, short: int = SHORT_CONTEXT) -> list[int]:
    """The context bounds decode graphs are captured for, ascending. A step replays a graph of the
    first bound that holds its longest context; decode attention's grid and config follow the bound."""
    return [short, max_model_len] if max_model_len > short else [max_model_len]


def graph_context_bound(max_model_len: int, longest: int) -> int | None:
    """The bound whose graphs a decode step replays: the first that holds its longest context (None
    past max_model_len)."""
    return next((bound for bound in graph_context_bounds(max_model_len) if bound >= longest), None)


def split_lengths(tokens: int, longest: int) -> list[int]:
    """Lengths of sequences of at most `longest` tokens (all but the last that long) that add up to `tokens`."""
    return [longest] * (tokens // longest) + ([tokens % longest] if tokens % longest else [])


def prefill_warmup_steps(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> list[list[int]]:
    """Sequence lengths of prefill steps that together reach every tuning bucket a prefill step can:
    the attention kernels' configs go by the longest query (its power of two, and whether the step
    has enough work for the Hopper kernel), the other kernels' by the step's token count.
    Each step is a longest query q (a bucket's first and last length) and others up to t tokens."""
    longest = min(max_model_len, max_num_batched_tokens)
    steps, seen = [], set()
    firsts_and_lasts = {n for i in range(longest.bit_length()) for n in (1 << i, (1 << i) + 1) if n <= longest}
    for q in sorted(firsts_and_lasts | {longest}):
        most = min(max_num_batched_tokens, max_num_seqs * q)
        for tokens in sorted({q, most} | {1 << i for i in range(most.bit_length()) if q < 1 << i < most}):
            keys = {("query", pow2(q), enough_work_for_hopper(tokens, q)), ("tokens", pow2(tokens))}
            if not keys <= seen:
                seen |= keys
                steps.append(split_lengths(tokens, q))
    return steps


@torch.inference_mode()
def compile_sampler(ops, max_num_seqs: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """Sample once per batch-size bucket of the sampler's configs (powers of two up to max_num_seqs)
    through `ops` (the runner's backend), logits of `dtype` (compute_logits') over `vocab` tokens."""
    for batch in sorted({min(1 << i, max_num_seqs) for i in range(max_num_seqs.bit_length() + 1)}):
        logits = torch.zeros(batch, vocab, dtype=dtype, device=device)
        ones = torch.ones(batch, device=device)
        top_k, seeds = (50 * ones).to(torch.int32), ones.to(torch.int64)
        ids = ops.sample(logits, ones, top_k, 0.9 * ones, 0.05 * ones, seeds)
        ops.sample(logits.float(), ones, top_k, 0.9 * ones, 0.05 * ones, seeds)  # after a bias or penalties
        ops.compute_logprobs(logits, ids)
        # The penalties (on float32 logits) and top logprobs, with the argument dtypes sample() passes.
        counts = torch.zeros(1, vocab, dtype=torch.int32, device=device)
        mask = torch.zeros(1, vocab, dtype=torch.uint8, device=device)
        ops.apply_penalties(logits.float(), counts, mask, 0 * seeds, ones, ones, ones)
        ops.count_tokens(counts, 0 * seeds, ids)
        ops.count_tokens(mask, 0 * seeds, ids)
        ops.compute_top_logprobs(logits, min(20, vocab))
    torch.cuda.synchronize(device)
