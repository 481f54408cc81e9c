"""The whole model's prefill step over an fp8 cache against the bf16 cache (issue 19), through the engine.

    python bench/prefill_engine.py [--model qwen3-0.6b] [--rounds 4]

Each case is one step of 16k new tokens: `generate(max_tokens=1)` on fresh random prompts each round
(so nothing is a prefix hit unless meant), best of the rounds. The short-prefix case first caches a
shared 512-token prefix, then prefills 32 prompts of it plus 512 new tokens each. Engines alternate
auto, fp8, auto, fp8 in one process (a second LLM sizes its cache after the first is freed); each
cell is the best over both engines of its kind.
"""
import argparse
import gc
import random
import time

import torch

from tritonllm import LLM, SamplingParams

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
CASES = ("B16 x 1k", "B4 x 4k", "B32 x 512 over 512 cached")


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(n)]


def prompts_of(case: str, llm: LLM, rng: random.Random) -> list[list[int]]:
    if case == "B16 x 1k":
        return [random_tokens(rng, 1024) for _ in range(16)]
    if case == "B4 x 4k":
        return [random_tokens(rng, 4096) for _ in range(4)]
    prefix = random_tokens(rng, 512)
    llm.generate([prefix + random_tokens(rng, 16)], ONE_TOKEN, use_tqdm=False)  # caches the prefix's blocks
    return [prefix + random_tokens(rng, 512) for _ in range(32)]


def best_seconds(llm: LLM, case: str, rounds: int, rng: random.Random) -> float:
    best = float("inf")
    for _ in range(rounds):
        prompts = prompts_of(case, llm, rng)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, ONE_TOKEN, use_tqdm=False)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    rng = random.Random(0)
    times = {}
    for kv in ("auto", "fp8", "auto", "fp8"):
        llm = LLM(args.model, kv_cache_dtype=kv, max_model_len=8192)
        best_seconds(llm, "B16 x 1k", 2, rng)  # warm-up
        for case in CASES:
            times.setdefault((case, kv), []).append(best_seconds(llm, case, args.rounds, rng))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print("| prefill step | bf16 cache ms | fp8 cache ms | fp8 / bf16 speed | readings (auto; fp8) |\n|---|---|---|---|---|")
    for case in CASES:
        auto, fp8 = times[(case, "auto")], times[(case, "fp8")]
        readings = f"{', '.join(f'{t * 1e3:.1f}' for t in auto)}; {', '.join(f'{t * 1e3:.1f}' for t in fp8)}"
        print(f"| {case} | {min(auto) * 1e3:.2f} | {min(fp8) * 1e3:.2f} | {min(auto) / min(fp8):.3f}x | {readings} |")


if __name__ == "__main__":
    main()
