"""What the model runner runs before serving, so that no Triton compile lands in the middle of it:
the batch sizes and context bounds of its decode CUDA graphs, and prefill steps that reach every
tuning bucket."""
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
                steps.append([q] * (tokens // q) + ([tokens % q] if tokens % q else []))
    return steps
