"""Hundreds of requests with shared prefixes on a KV cache small enough to force preemption and eviction.

The PyTorch reference kernels keep this quick on a CPU: it exercises the scheduler and the block
manager, which are the same whatever kernels run. On a GPU it runs at full size: more requests,
more of them at once, the Triton kernels and CUDA graphs.
"""
import random

import torch

from tritonllm import LLM, SamplingParams

ON_GPU = torch.cuda.is_available()
NUM_REQUESTS = 1000 if ON_GPU else 200
OPTIONS = {"kernels": "triton", "max_num_seqs": 64} if ON_GPU else {"kernels": "reference", "max_num_seqs": 16, "enforce_eager": True}
NUM_KV_BLOCKS = 48 if ON_GPU else 24


def requests(vocab, seed=0):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(16, 40))] for _ in range(5)]
    prompts, params = [], []
    for _ in range(NUM_REQUESTS):
        prompts.append(rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))])
        if rng.random() < 0.5:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=rng.choice([0.5, 1.0]), top_k=rng.choice([0, 5]),
                                         top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.1]),
                                         max_tokens=rng.randint(1, 12), seed=rng.randrange(1000), ignore_eos=True))
    return prompts, params


def test_stress_preemption_eviction_no_leaks(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=64, **OPTIONS)
    prompts, params = requests(llm.hf_config.vocab_size)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    alone = LLM(str(tiny_qwen3), num_kv_blocks=64, **OPTIONS)
    # Greedy and seeded requests alike draw what they draw alone: preemption, prefix hits and the
    # batch beside them change nothing.
    mismatches = [i for i, p in enumerate(params)
                  if alone.generate([prompts[i]], p, use_tqdm=False)[0].token_ids != outputs[i].token_ids]
    leaked = NUM_KV_BLOCKS - llm.block_manager.num_free_blocks
    print(f"\nstress: {len(outputs)} requests, {llm.scheduler.num_preemptions} preemptions, "
          f"{llm.block_manager.num_evictions} evictions, {sum(o.num_cached_tokens for o in outputs)} cached tokens, "
          f"{len(mismatches)} mismatches against lone runs, {leaked} leaked blocks")
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert llm.scheduler.num_preemptions > 0 and llm.block_manager.num_evictions > 0
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert leaked == 0
    assert mismatches == []
