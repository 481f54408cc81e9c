"""No Triton compile in the middle of serving (on a GPU: the interpreter compiles nothing).

Once a step of each shape bucket has run, steps of other batch sizes and block-table widths must
reuse the compiled kernels. Triton specializes a launch on its integer arguments (1, multiples of
16) and on pointer alignment, so an argument that changes every step (a batch size, a table width,
a row of a packed parameter tensor) would compile again for each new case, taking seconds (the
sampler about 5 s on an H200) while every request waits.
"""
import random
import sys

import pytest
import torch
import triton

from tritonllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter compiles nothing")

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
    after = compiled_kernels()
    assert {k: after[k] - warm.get(k, 0) for k in after if after[k] != warm.get(k, 0)} == {}
    llm.close()
