"""Start-up time and the latency of the first requests after it (bench/NOTES-engine.md).

    python bench/startup.py [--model qwen3-0.6b] [--kv-cache-dtype auto] [--max-tokens 1]

Times LLM(...) (load, cache sizing, prefill warm-up, graph capture), then sends requests of
several shapes, each shape twice in a row on fresh random prompts (no prefix hits): a first send
slower than the second is paying for a Triton compile, or a load from Triton's disk cache. Run
it with an empty TRITON_CACHE_DIR to see cold compiles. A preset name runs with dummy weights.
"""
import argparse
import random
import time

import torch

from tritonllm import LLM, SamplingParams
from tritonllm.config import KV_CACHE_DTYPES

SHAPES = [(1, 16), (1, 100), (1, 700), (4, 300), (16, 200), (1, 1500), (4, 1024), (1, 3000), (2, 6000)]  # (prompts, tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_CACHE_DTYPES))
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args()
    start = time.perf_counter()
    llm = LLM(args.model, kv_cache_dtype=args.kv_cache_dtype, max_model_len=16384)
    startup = time.perf_counter() - start
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rng = random.Random(0)
    rows = []
    for batch, length in SHAPES:
        times = []
        for _ in range(2):
            prompts = [[rng.randrange(100, 10000) for _ in range(length)] for _ in range(batch)]
            torch.cuda.synchronize()
            begin = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append((time.perf_counter() - begin) * 1e3)
        rows.append((batch, length, *times))
    llm.close()
    print(f"{args.model}, kv cache {args.kv_cache_dtype}: LLM(...) took {startup:.1f} s")
    print("| prompts x tokens | first ms | second ms |\n|---|---|---|")
    for batch, length, first, second in rows:
        print(f"| {batch} x {length} | {first:.1f} | {second:.1f} |")


if __name__ == "__main__":
    main()
