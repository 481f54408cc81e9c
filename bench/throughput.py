"""End-to-end throughput on the nano-vllm benchmark workload (bench/NOTES-engine.md).

    python bench/throughput.py [--model qwen3-0.6b] [--tp 1] [--dp 1] [--kernels triton reference]
                               [--kv-cache-dtype fp8 auto] [--kv-block-size 16] [--num-seqs 256] [--repeat 1]

256 requests (seed 0): prompts of randint(100, 1024) tokens drawn from [0, 10000], outputs of
randint(100, 1024) tokens with ignore_eos, temperature 0.6, max_model_len 4096. A preset name runs
with dummy weights; a checkpoint folder with its own. With several --kernels or --kv-cache-dtype,
the same workload runs on each in turn, in this one process, and with two kinds of row their
ratio is printed. A value given again runs again (`--kv-cache-dtype auto fp8 fp8 auto`: both
orders in one process), and the ratio then pools the runs of each kind. --repeat N times N runs
of each (later ones on prompts of the same lengths with other tokens, so nothing hits the prefix
cache) and gives their median, range and each run's time in order: end to end, the same tree has
varied by 5-10% between calls (NOTES-decode-attention.md).

Each row also gives the decode floor: the workload's output tokens over the time its decode steps
would take if each only read its bytes at the copy ceiling (decode_floor), and the share of it
reached (the whole run, prefill included, against a decode-only floor).
"""
import argparse
import gc
import random
import statistics
import time

import torch
import triton

from timing import COPY_BYTES_PER_S
from tritonllm import LLM, SamplingParams
from tritonllm.cli import int_at_least
from tritonllm.config import KERNEL_BACKENDS, KV_CACHE_DTYPES
from tritonllm.kernels import tuning
from tritonllm.layers.attention import kv_bytes_per_token
from tritonllm.layers.moe import FusedMoE
from tritonllm.loader import load_config

MIN_LEN = 100  # the shortest prompt and output the workload draws


def workload(num_seqs: int, max_input_len: int, max_output_len: int, max_token_id: int = 10000, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(MIN_LEN, max_input_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(MIN_LEN, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


def decode_floor(model, cache_dtype, prompt_lens: list[int], output_lens: list[int], dp: int = 1) -> float:
    """Output tokens/s if every decode step took only the time to read its bytes at the copy ceiling:
    this rank's weights (the embedding is a lookup, not read whole; of the experts, those the step's
    tokens pick, in expectation under uniform routing) and the KV cache of every running sequence.
    Every request runs from the first step, as when all fit. With dp replicas, request i runs on
    replica i % dp and the replicas run side by side: the slowest share sets the time."""
    shares = [decode_seconds(model, cache_dtype, prompt_lens[r::dp], output_lens[r::dp]) for r in range(dp)]
    return sum(output_lens) / max(shares)


def decode_seconds(model, cache_dtype, prompt_lens: list[int], output_lens: list[int]) -> float:
    """decode_floor's time for one replica's requests."""
    params = dict(model.named_parameters())  # a tied LM head is the embedding, counted once
    dense = sum(p.numel() * p.element_size() for name, p in params.items() if "experts" not in name)
    if "lm_head.weight" in params:
        dense -= params["model.embed_tokens.weight"].numel() * params["model.embed_tokens.weight"].element_size()
    experts = [(m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size(), m.w13.shape[0], m.top_k)
               for m in model.modules() if isinstance(m, FusedMoE)]
    kv_token = kv_bytes_per_token(model, cache_dtype)
    seconds = 0.0
    for step in range(max(output_lens) - 1):  # the prefill samples each request's first token
        contexts = [p + step + 1 for p, o in zip(prompt_lens, output_lens) if o - 1 > step]
        picked = sum(size * (1 - (1 - k / e) ** len(contexts)) for size, e, k in experts)
        seconds += (dense + picked + kv_token * sum(contexts)) / COPY_BYTES_PER_S
    return seconds


def relabeled(prompts, seed: int):
    """Prompts of the same lengths with other random tokens (no prefix-cache hits on the originals),
    inside the originals' token range, so inside the vocabulary."""
    rng = random.Random(seed)
    top = max(max(prompt) for prompt in prompts)
    return [[rng.randint(0, top) for _ in prompt] for prompt in prompts]


def warm_up(llm, prompts) -> None:
    """Other prompts of the same lengths with 1..16 output tokens: they reach every prefill length
    bucket and, as they finish, every decode batch size, so Triton compiles each kernel variant
    before the clock starts (a fresh machine spends about 10 s on this; later runs read Triton's
    on-disk cache). Other tokens, so the timed run finds nothing of them in the prefix cache."""
    rng = random.Random(1)
    llm.generate(relabeled(prompts, 1), [SamplingParams(ignore_eos=True, max_tokens=rng.randint(1, 16)) for _ in prompts],
                 use_tqdm=False)


def run(args, kernels: str, kv_cache_dtype: str, prompts, params) -> dict:
    # The references (run eagerly) gather whole block tables in float32: gigabytes of scratch at
    # batch 256 that need room beside the KV cache.
    llm = LLM(args.model, tensor_parallel_size=args.tp, data_parallel_size=args.dp, max_model_len=args.max_model_len,
              kernels=kernels, kv_cache_dtype=kv_cache_dtype, kv_block_size=args.kv_block_size,
              enforce_eager=args.enforce_eager,
              gpu_memory_utilization=0.5 if kernels == "reference" else 0.9)
    floor = decode_floor(llm.runner.model, llm.config.cache_dtype, [len(p) for p in prompts],
                         [p.max_tokens for p in params], args.dp)
    warm_up(llm, prompts)
    times = []
    for repeat in range(args.repeat):  # later repeats: the same lengths, other tokens (no prefix hits)
        batch = prompts if repeat == 0 else relabeled(prompts, 100 + repeat)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=not args.no_tqdm)
        times.append(time.perf_counter() - start)
    elapsed = statistics.median(times)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    result = {"kernels": f"{kernels}, KV {kv_cache_dtype}, block {args.kv_block_size}", "output_tokens": output_tokens,
              "seconds": elapsed, "tokens_per_s": output_tokens / elapsed, "preemptions": llm.scheduler.num_preemptions,
              "blocks": llm.runner.num_kv_blocks, "floor": floor,
              "spread": f"{output_tokens / max(times):.0f}-{output_tokens / min(times):.0f}" if len(times) > 1 else "-",
              "times": times}
    llm.close()
    del llm, outputs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def make_parser() -> argparse.ArgumentParser:
    """The command line; other benches take run()'s options from its defaults (parse_args([]))."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="preset name (dummy weights) or checkpoint folder")
    parser.add_argument("--tp", type=int_at_least(1), default=1, help="tensor-parallel size")
    parser.add_argument("--dp", type=int_at_least(1), default=1, help="data-parallel replicas (each --tp GPUs)")
    parser.add_argument("--kernels", nargs="+", default=["triton"], choices=KERNEL_BACKENDS)
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], choices=list(KV_CACHE_DTYPES),
                        help="several: each runs in turn (with each of --kernels)")
    parser.add_argument("--kv-block-size", type=int, choices=(16, 32, 64, 128, 256), default=16, help="keys a KV block")
    parser.add_argument("--num-seqs", type=int_at_least(1), default=256)
    parser.add_argument("--max-input-len", type=int_at_least(MIN_LEN), default=1024,
                        help=f"prompts of {MIN_LEN} to this many tokens")
    parser.add_argument("--max-output-len", type=int_at_least(MIN_LEN), default=1024,
                        help=f"outputs of {MIN_LEN} to this many tokens")
    parser.add_argument("--max-model-len", type=int_at_least(1), default=4096)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-tqdm", action="store_true")
    parser.add_argument("--repeat", type=int_at_least(1), default=1,
                        help="timed runs per row (the same lengths, other tokens); the row gives their median")
    return parser


def main():
    parser = make_parser()
    args = parser.parse_args()
    if args.max_input_len + args.max_output_len > args.max_model_len:
        parser.error(f"--max-model-len {args.max_model_len} must be >= --max-input-len + --max-output-len "
                     f"({args.max_input_len} + {args.max_output_len}), the longest request")
    try:
        vocab = load_config(args.model).vocab_size  # token ids stay below 10000 and inside the vocabulary
    except ValueError as error:  # no such folder or preset
        parser.error(str(error))
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len, min(10000, vocab - 1))
    print(f"{args.model}, TP {args.tp}, DP {args.dp}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{sum(p.max_tokens for p in params)} output tokens")
    in_use = tuning.config_file_in_use()
    print(f"torch {torch.__version__}, Triton {triton.__version__}, tuned configs: {in_use.name if in_use else 'none'}")
    print("\n| kernels | output tokens | time (s) | tokens/s | repeats' range | runs in order (s) | decode floor (tokens/s) "
          "| of floor | preemptions | KV blocks |\n|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for kernels in args.kernels:  # each row printed as soon as it is known
        for kv_cache_dtype in args.kv_cache_dtype:
            results.append(run(args, kernels, kv_cache_dtype, prompts, params))
            r = results[-1]
            print(f"| {r['kernels']} | {r['output_tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} | {r['spread']} | "
                  f"{' '.join(f'{t:.2f}' for t in r['times'])} | {r['floor']:.0f} | {r['tokens_per_s'] / r['floor']:.2f} | {r['preemptions']} | {r['blocks']} |")
    kinds = {}  # a row's label -> the times of all its runs, in the order the labels first ran
    for r in results:
        kinds.setdefault(r["kernels"], []).extend(r["times"])
    if len(kinds) == 2:
        (first, first_times), (second, second_times) = kinds.items()
        pooled = f" (medians of {len(first_times)} and {len(second_times)} runs)" if len(results) > 2 else ""
        print(f"\n{first} / {second}: {statistics.median(second_times) / statistics.median(first_times):.2f}x{pooled}")


if __name__ == "__main__":
    main()
