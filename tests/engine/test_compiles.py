"""No Triton compile in the middle of serving (on a GPU: the interpreter compiles nothing).

The model runner's start-up runs a prefill step of each tuning bucket (and captures the decode
graphs, and samples once per sampler bucket); after it, steps of any batch size, length and
block-table width must reuse the compiled kernels. Triton specializes a launch on its integer
arguments (1, multiples of 16) and on pointer alignment, so an argument that changes every step (a
batch size, a table width, a row of a packed parameter tensor) would compile again for each new
case, taking seconds (the sampler about 5 s on an H200) while every request waits.
"""
import random
import sys

import pytest
import torch
import triton

from tritonllm import LLM, SamplingParams
from tritonllm.engine.warmup import prefill_warmup_steps
from tritonllm.kernels.prefill_attention import enough_work_for_hopper
from tritonllm.kernels.tuning import pow2

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter compiles nothing")

# Sampled rows with every filter and a penalty: the sampler's and the penalties' kernels run.
PARAMS = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, presence_penalty=0.5, max_tokens=4, ignore_eos=True)


def compiled_kernels() -> dict[str, int]:
    """Compiled variants of each Triton kernel of tritonllm.kernels, by name."""
    counts = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("tritonllm.kernels."):
            continue
        for attr, fn in vars(module).items():
            if isinstance(fn, triton.runtime.JITFunction) and attr.endswith("_kernel"):
                counts[f"{name}.{attr}"] = sum(len(caches[0]) for caches in fn.device_caches.values())
    return counts


def prompts(lengths: list[int], rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 380) for _ in range(n)] for n in lengths]


def step_buckets(longest_query: int, tokens: int) -> set:
    """What picks a prefill step's configs: its longest query's power of two (attention also by
    whether the step has enough work for the Hopper kernel) and its token count's."""
    return {("query", pow2(longest_query), enough_work_for_hopper(tokens, longest_query)),
            ("tokens", pow2(tokens))}


@pytest.mark.parametrize("max_model_len, max_num_batched_tokens, max_num_seqs",
                         [(40960, 16384, 256), (256, 16384, 8), (2000, 3000, 5), (777, 512, 3), (1, 1, 1)])
def test_warmup_steps_reach_every_bucket_a_prefill_step_can(max_model_len, max_num_batched_tokens, max_num_seqs):
    steps = prefill_warmup_steps(max_model_len, max_num_batched_tokens, max_num_seqs)
    for lengths in steps:  # steps the engine could schedule
        assert 1 <= len(lengths) <= max_num_seqs and max(lengths) <= max_model_len
        assert sum(lengths) <= max_num_batched_tokens
    warm = set().union(*(step_buckets(max(lengths), sum(lengths)) for lengths in steps))
    # Any step: a longest query q, and q to min(budget, max_num_seqs * q) tokens. The Hopper
    # condition grows with the tokens, so a step's fewest and most tokens bound what it reaches.
    for q in range(1, min(max_model_len, max_num_batched_tokens) + 1):
        most = min(max_num_batched_tokens, max_num_seqs * q)
        for tokens in {q, most} | {t for t in (1 << i for i in range(most.bit_length() + 1)) if q <= t <= most}:
            assert step_buckets(q, tokens) <= warm, (q, tokens)


@gpu_only
@pytest.mark.parametrize("model, kv_cache_dtype", [("tiny_qwen3", "auto"), ("tiny_qwen3", "fp8"),
                                                   ("tiny_qwen3_moe", "auto")])
def test_other_batch_sizes_and_table_widths_compile_nothing(request, model, kv_cache_dtype):
    llm = LLM(str(request.getfixturevalue(model)), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_num_seqs=8,
              max_model_len=256)
    rng = random.Random(0)
    # Prompts of 30..61 tokens: every prefill step's longest query and token count fall in the
    # buckets these two warm steps reach (64 tokens and 256), so later steps need no new config.
    for lengths in ([40, 40, 40, 40], [33, 30]):
        llm.generate(prompts(lengths, rng), PARAMS, use_tqdm=False)
    warm = compiled_kernels()
    assert sum(warm.values()) > 0, "found no compiled kernel to count"
    # Batches of 1, 3 and 5 (packed parameter rows at odd offsets), tables of 3 and 4 blocks.
    for lengths in ([50], [33, 47, 61], [33, 34, 35, 36, 37]):
        outputs = llm.generate(prompts(lengths, rng), PARAMS, use_tqdm=False)
        assert [len(o.token_ids) for o in outputs] == [4] * len(lengths)
    assert new_compiles(warm) == {}
    llm.close()


def new_compiles(before: dict[str, int]) -> dict[str, int]:
    after = compiled_kernels()
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


@gpu_only
@pytest.mark.parametrize("model, kv_cache_dtype, max_model_len",
                         [("tiny_qwen3", "auto", 512), ("tiny_qwen3", "fp8", 512), ("tiny_qwen3_moe", "auto", 512),
                          ("qwen3-0.6b", "auto", 4096), ("qwen3-0.6b", "fp8", 4096)])
def test_nothing_compiles_after_start_up(request, model, kv_cache_dtype, max_model_len):
    """Prompts of every size right after LLM(...): prefill steps of one token to a chunked prompt,
    batches that take the Hopper attention kernel (Qwen3-0.6B's D 128, on sm_90), prefix hits."""
    path = model if model.startswith("qwen3-") else str(request.getfixturevalue(model))  # a preset: dummy weights
    llm = LLM(path, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_num_seqs=4, max_model_len=max_model_len,
              max_num_batched_tokens=max_model_len // 2)
    warm = compiled_kernels()
    assert sum(warm.values()) > 0, "found no compiled kernel to count"
    rng = random.Random(0)
    half, full = max_model_len // 2, max_model_len - 8
    repeated = prompts([full], rng)  # chunked in two steps, then a prefix hit
    for batch in ([1], [5], [37, 200], [half // 4] * 4, [half // 2 + 1, 3], [half - 9, 17], [half], [5, 130, 77, 9]):
        outputs = llm.generate(prompts(batch, rng), PARAMS, use_tqdm=False)
        assert [len(o.token_ids) for o in outputs] == [4] * len(batch)
    for _ in range(2):
        assert len(llm.generate(repeated, PARAMS, use_tqdm=False)[0].token_ids) == 4
    assert new_compiles(warm) == {}
    llm.close()
