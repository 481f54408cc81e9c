"""Decode attention at the shapes of the nano-vllm workload, with the engine's config and others.

    python bench/decode_workload.py [--stride 16] [--kv-cache-dtype auto|fp8] [--block-size 16] [--grid space|wide]
                                    [--max-model-len 4096] [--save] [--out PATH]
                                    [--files OTHER/kernels/decode_attention.py ...]

bench/throughput.py's workload (256 requests, prompts 100..1024, outputs 100..1024) decodes with
batches that shrink from 256 as requests finish and contexts spread from 100 to 2k, under a
context bound of max_model_len 4096 (--max-model-len: a checkpoint's own, 40960 for Qwen3). The
engine replays each step from the graphs of the smallest context bound that holds its longest
context (engine/warmup.graph_context_bounds: 2048 here), whose buckets are the ones timed and saved;
bench/kernels.py tunes the others on uniform contexts at the bound.
This replays one layer of every `stride`-th decode step of the workload (and the first step of
each graph batch size the stride misses, so every bucket is timed), its rows longest context
first as the engine orders them (Qwen3-0.6B heads: 16 q / 8 kv, D 128, bf16, KV blocks of
--block-size keys, batch padded to the engine's CUDA-graph size, block tables covering
max_model_len keys), times the engine's config and a grid of others (one CUDA graph
each, median: --grid space, the kernel's own tuning space of each bucket; --grid wide, 80 configs
over an fp8 cache, each compiled once, which takes longer than a device call), and estimates the
workload's decode-attention seconds (28 layers) for each config per batch bucket.
With --kv-cache-dtype fp8 the cache is e4m3 with its per-(slot, head) scales (the engine's
kv_cache_dtype="fp8"), and the fp8 buckets are the ones timed and saved.

--files times the decode_attention of other files (other trees, prototypes) on the same inputs in
the same process, with the same configs, each checked against the installed kernel.

--save writes each bucket's best config into the tuned-config file under the engine's bucket key
(the step's context bound). Run it after bench/kernels.py, which tunes the keys it meets on uniform
contexts at the bound: the engine serves the workload's spread contexts from the short bound's graphs.
"""
import argparse
import itertools
import json
from collections import defaultdict

import torch

from kernel_cases import paged_cache, randn
from prefill_ab import load
from throughput import workload
from timing import COPY_BYTES_PER_S, graph_time_ms
from tritonllm import kernels
from tritonllm.kernels import reference
from tritonllm.engine.warmup import graph_batch_sizes, graph_context_bound
from tritonllm.kernels import tuning
from tritonllm.kernels.decode_attention import DECODE_TUNABLE, decode_attention_bucket
from tritonllm.kernels.fp8 import head_major_copy
from tritonllm.kernels.kv_cache import key_major_copy

LAYERS = 28


def engine_bucket(batch, cache_dtype, block_size, bound):
    """The decode tuning bucket of the engine's graph of `batch` rows and context bound `bound`: bf16,
    D 128, group 2, 8 kv heads; the kernel's own builder, so saved configs are the ones it reads."""
    return decode_attention_bucket(torch.bfloat16, 128, 2, 8, block_size, batch, bound, cache_dtype)


def fastest(times: dict) -> str:
    """The key of the shortest time; NaN (a config that failed) never wins unless every one failed."""
    return min(times, key=lambda key: (times[key] != times[key], times[key]))


def graph_batch(rows: int, sizes: list[int]) -> int:
    """The engine's CUDA-graph batch for `rows` decoding rows: the smallest graph size that holds them."""
    return next(size for size in sizes if size >= rows)


def rows_at(requests, step: int) -> int:
    """The requests still decoding at decode step `step` (a request of o output tokens decodes o - 1
    of them: its prefill samples the first)."""
    return sum(o - 1 > step for _, o in requests)


def contexts_at(requests, step: int) -> list[int]:
    """The keys each decoding row reads at decode step `step`, longest first (the engine's row order,
    engine/scheduler.py): the prompt, the tokens sampled so far and the new one."""
    return sorted((p + step + 1 for p, o in requests if o - 1 > step), reverse=True)


def sampled_steps(requests, stride: int, sizes: list[int]) -> list[tuple[int, int]]:
    """The decode steps timed, each with the number of the workload's steps it stands for: every
    stride-th step, plus the first step of each graph batch that those miss (the run's last and
    smallest batches, whose buckets a stride would leave untuned)."""
    last = max(o for _, o in requests) - 1
    steps = set(range(0, last, stride))
    seen = {graph_batch(rows_at(requests, step), sizes) for step in steps}
    for step in range(last):
        batch = graph_batch(rows_at(requests, step), sizes)
        if batch not in seen:
            steps.add(step)
            seen.add(batch)
    steps = sorted(steps)
    return [(step, following - step) for step, following in zip(steps, steps[1:] + [last])]


def wide_candidates(fp8: bool):
    warps = (4, 8) if fp8 else (4,)  # e4m3 tiles gain from more warps (NOTES-decode-attention.md)
    for block_n, splits, split_min, stages, num_warps in itertools.product((64, 128), (1, 2, 4, 8), (128, 256, 512),
                                                                           (2, 3), warps):
        if splits == 1 and split_min != 256:
            continue  # SPLIT_MIN is unused with one split
        yield {"BLOCK_N": block_n, "NUM_SPLITS": splits, "SPLIT_MIN": split_min, "num_warps": num_warps,
               "num_stages": stages}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stride", type=int, default=16,
                        help="time every stride-th decode step (and the first of each batch size those miss)")
    parser.add_argument("--save", action="store_true", help="write each bucket's best config to the tuned-config file")
    parser.add_argument("--out", help="write every timing as JSON here")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="auto: bf16")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="the engine's context bound: bench/throughput.py's 4096, or a checkpoint's own (40960)")
    parser.add_argument("--block-size", type=int, choices=(16, 32, 64, 128, 256), default=16, help="keys a KV block")
    parser.add_argument("--grid", choices=("space", "wide"), default="space",
                        help="configs timed: each bucket's tuning space, or a wider fixed grid")
    parser.add_argument("--files", nargs="+", default=[], metavar="PATH",
                        help="decode_attention.py files to time beside the installed kernel")
    args = parser.parse_args()
    kernel_fns = {"installed": kernels.decode_attention} | {path: load(path).decode_attention for path in args.files}
    block_size = args.block_size
    fp8 = args.kv_cache_dtype == "fp8"
    prompts, params = workload(256, 1024, 1024)
    requests = [(len(p), sp.max_tokens) for p, sp in zip(prompts, params)]
    step_keys = [sum(contexts_at(requests, s)) for s in range(max(o for _, o in requests) - 1)]  # keys read a step
    sizes = graph_batch_sizes(256)
    total_tokens = sum(p + o for p, o in requests)
    k_cache, v_cache, _ = paged_cache(total_tokens + 64 * block_size, 1, block_size)
    scales = {}
    if fp8:
        (k_cache, k_scale), (v_cache, v_scale) = reference.quantize_e4m3(k_cache), reference.quantize_e4m3(v_cache)
        # As the engine keeps an e4m3 cache: V key-major, the scales head-major.
        v_cache = key_major_copy(v_cache)
        scales = {"k_scale": head_major_copy(k_scale), "v_scale": head_major_copy(v_scale)}
    num_blocks = k_cache.shape[0]
    token_bytes = 8 * (128 + 4) * 2 if fp8 else 8 * 128 * 2 * 2  # K and V (and their float32 scales)
    wide = list(wide_candidates(fp8)) if args.grid == "wide" else None
    rows = []
    # kernel -> (context bound, batch bucket) -> config key -> estimated s
    by_bucket = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    engine_keys = {}  # (context bound, batch bucket) -> the key of the config the engine runs there
    table_width = -(-args.max_model_len // block_size)
    for step, span in sampled_steps(requests, args.stride, sizes):
        lens = contexts_at(requests, step)
        batch = graph_batch(len(lens), sizes)
        seq_lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
        seq_lens[: len(lens)] = torch.tensor(lens, dtype=torch.int32)
        # Each row its own blocks, as the engine's are (shared ones would be read from L2).
        tables = torch.zeros(batch, table_width, dtype=torch.int32)
        free = torch.randperm(num_blocks, dtype=torch.int32)
        for row, n in enumerate(-(-length // block_size) for length in lens):
            tables[row, :n], free = free[:n], free[n:]
        tables = tables.cuda()
        q = randn(batch, 16, 128)
        moved = sum(lens) * token_bytes
        # The step stands for the `span` steps from it, whose contexts shrink or grow: its time counts
        # in proportion to their bytes (time follows bytes at these sizes).
        weight = sum(step_keys[step:step + span]) / sum(lens)
        bound = graph_context_bound(args.max_model_len, lens[0])
        bucket = bound, tuning.pow2(batch)
        step_bucket = engine_bucket(batch, k_cache.dtype, block_size, bound)
        engine_cfg = DECODE_TUNABLE.config(step_bucket, None)
        configs = wide if wide is not None else DECODE_TUNABLE.space(*step_bucket)
        engine_keys[bucket] = json.dumps(engine_cfg, sort_keys=True)
        expected = kernels.decode_attention(q, k_cache, v_cache, seq_lens, tables, config=engine_cfg, **scales).float()
        step_times, errors = {}, {}
        for name, fn in kernel_fns.items():
            try:
                out = fn(q, k_cache, v_cache, seq_lens, tables, config=engine_cfg, **scales).float()
                errors[name] = ((out - expected).norm() / expected.norm()).item()
            except Exception:  # a prototype that does not compile at the engine's config
                if name == "installed":
                    raise
                errors[name] = float("inf")
            times = step_times[name] = {}
            for cfg in [engine_cfg] + configs:
                key = json.dumps(cfg, sort_keys=True)
                if key in times:  # the engine's config is often one of the candidates: count it once
                    continue
                times[key] = float("nan")  # a kernel that disagrees with the installed one counts for nothing
                if not errors[name] > 2e-2:
                    try:
                        times[key] = graph_time_ms(lambda c=cfg: fn(q, k_cache, v_cache, seq_lens, tables, config=c,
                                                                    **scales), [()], replays=20)
                    except Exception:  # a prototype's config that does not compile stays NaN
                        if name == "installed":
                            raise
                by_bucket[name][bucket][key] += times[key] * 1e-3 * weight * LAYERS
        times = step_times["installed"]
        best = fastest(times)
        engine_ms = times[engine_keys[bucket]]
        rows.append({"step": step, "weight": weight, "batch": len(lens), "graph_batch": batch,
                     "mean_context": sum(lens) / len(lens), "engine": engine_cfg, "engine_us": engine_ms * 1e3,
                     "best": json.loads(best), "best_us": times[best] * 1e3,
                     "floor_us": moved / COPY_BYTES_PER_S * 1e6, "all": times})
        print(f"step {step:4d}: batch {len(lens):3d} (graph {batch:3d}), mean context {sum(lens) / len(lens):6.0f}: "
              f"engine {engine_ms * 1e3:7.1f} us ({moved / engine_ms / 1e6:5.0f} GB/s), best {times[best] * 1e3:7.1f} us "
              f"({moved / times[best] / 1e6:5.0f} GB/s) {best}", flush=True)
        for name, other in step_times.items():
            if name != "installed":
                print(f"   {name}: engine config {other[engine_keys[bucket]] * 1e3:7.1f} us, best "
                      f"{other[fastest(other)] * 1e3:7.1f} us, error {errors[name]:.1e}", flush=True)
    floor_total = sum(step_keys) * token_bytes / COPY_BYTES_PER_S * LAYERS  # every step, not only the sampled
    for name, buckets in by_bucket.items():
        engine_total = best_total = 0.0
        print(f"\n{name}\n\n| context bound, batch bucket | engine config (s) | best single config (s) | that config |\n"
              "|---|---|---|---|")
        for bucket, totals in sorted(buckets.items()):
            key = fastest(totals)
            engine_s = totals[engine_keys[bucket]]
            engine_total += engine_s
            best_total += totals[key]
            if args.save and name == "installed":
                saved_key = tuning.bucket_key(engine_bucket(bucket[1], k_cache.dtype, block_size, bucket[0]))
                tuning.tuned_table().setdefault("decode_attention", {})[saved_key] = json.loads(key)
            print(f"| {bucket[0]}, {bucket[1]} | {engine_s:.3f} | {totals[key]:.3f} | {key} |")
        print(f"\nworkload decode attention, {name}, estimated: engine configs {engine_total:.3f} s, best config per "
              f"bucket {best_total:.3f} s, floor at {COPY_BYTES_PER_S / 1e12:.2f} TB/s {floor_total:.3f} s")
    if args.save:
        print(f"saved to {tuning.save()}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
