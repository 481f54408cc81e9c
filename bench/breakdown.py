"""Where the time of the nano-vllm workload goes: GPU kernels by kind, and the host's share (not named profile.py: that would shadow the standard library module cProfile imports).

    python bench/breakdown.py [--model qwen3-0.6b] [--num-seqs 64] [--kv-cache-dtype auto] [--trace PATH]

Runs bench/throughput.py's workload (fewer requests by default, to keep the trace small) under
torch.profiler and sums the CUDA kernel time by kind: prefill and decode attention, GEMM, norms, other elementwise
kernels (rotary, SiLU-and-mul, KV store), sampler, MoE, communication, the rest. Host overhead is the
wall time the GPU sat idle: wall time minus the summed kernel time (one stream, no overlap).
Also counts kernel launches per step and layer, and splits the idle time by gap length from the
trace: gaps of a few microseconds sit between the kernels of one CUDA graph or launch sequence,
long ones are the GPU waiting for the host; the long gaps are also counted by the kinds of
kernel before and after them, which tells which step or launch left the GPU waiting.
Last, the decode steps by batch size: the host's busy time a step (schedule, build, launch, resolve) and its
wait for the previous step's sampled ids; steps that barely waited left the GPU idle until their launch.
"""
import argparse
import json
import re
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from throughput import warm_up, workload
from tritonllm import LLM
from tritonllm.config import KV_CACHE_DTYPES
from tritonllm.engine.sampled_tokens import SampledTokens
from tritonllm.loader import load_config

KINDS = [  # first match wins, on the kernel's name
    ("prefill attention", r"prefill_attention|flash|fmha"),
    ("decode attention", r"decode_attention|merge_splits"),
    ("MoE", r"moe|_align_"),  # router, alignment, the grouped GEMMs and the combine
    ("GEMM", r"gemm|nvjet|cutlass|xmma|sm90_|splitK|cublas|_linear_kernel"),  # _linear_kernel: ours at 1-16 rows
    ("norms", r"rms_norm"),
    ("rotary + KV store", r"rotary|store_kv|qk_norm"),
    ("SiLU-and-mul", r"silu"),
    ("sampler", r"sample|logprob|race|threshold"),
    ("communication", r"nccl|all_reduce|allreduce"),
]


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


GAP_BOUNDS_US = (2, 5, 20, 100)


def idle_gaps(prof, trace: Path | None) -> list[tuple[float, str, str]]:
    """GPU idle gaps between consecutive kernels and copies (one stream: no overlap) as (us, the kernel
    before, the kernel after), read from the profile's Chrome trace, kept at `trace` if given, else
    written to a temporary file."""
    with tempfile.TemporaryDirectory() as scratch:
        path = trace or Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((event["ts"], event["ts"] + event["dur"], event.get("name", "")) for event in events
                     if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    return [(max(0.0, start - end), before, after)
            for (_, end, before), (start, _, after) in zip(kernels, kernels[1:])]


def print_gaps(gaps: list[tuple[float, str, str]], long_us: float = 20.0, rows: int = 8):
    """The idle gaps by length, then the gaps of long_us or more by the kinds of kernel around them."""
    bounds = (0, *GAP_BOUNDS_US, float("inf"))
    print("\n| gap between kernels | gaps | idle seconds |\n|---|---|---|")
    for low, high in zip(bounds, bounds[1:]):
        inside = [g for g, _, _ in gaps if low <= g < high]
        print(f"| {low}-{high} us | {len(inside)} | {sum(inside) / 1e6:.3f} |")
    print(f"| all | {len(gaps)} | {sum(g for g, _, _ in gaps) / 1e6:.3f} |")
    around = defaultdict(lambda: [0, 0.0])
    for gap, before, after in gaps:
        if gap >= long_us:
            entry = around[kind_of(before), kind_of(after)]
            entry[0] += 1
            entry[1] += gap / 1e6
    print(f"\n| gaps of {long_us:g} us or more: kernel before | kernel after | gaps | idle seconds |\n|---|---|---|---|")
    for (before, after), (count, seconds) in sorted(around.items(), key=lambda item: -item[1][1])[:rows]:
        print(f"| {before} | {after} | {count} | {seconds:.3f} |")


class StepClock:
    """Each step's host time, split into the wait for the previous step's sampled ids (the GPU still
    busy) and the rest (schedule, build, launch, resolve: the host busy). A decode step that barely
    waited found the GPU done before its launch: the GPU idled for the host in between."""

    def __init__(self):
        self.rows = []  # (batch, is_prefill, host busy s, wait s)
        self._wait = 0.0
        self._result = SampledTokens.result
        clock = self

        def timed_result(tokens, check=None):
            start = time.perf_counter()
            try:
                return clock._result(tokens, check)
            finally:
                clock._wait += time.perf_counter() - start
        SampledTokens.result = timed_result

    def step(self, llm):
        self._wait, start = 0.0, time.perf_counter()
        outputs = llm.step()
        if llm.last_step is not None:
            num_tokens, is_prefill, _ = llm.last_step
            self.rows.append((num_tokens, is_prefill, time.perf_counter() - start - self._wait, self._wait))
        return outputs

    def close(self):
        SampledTokens.result = self._result

    def print(self, waited_us: float = 20.0):
        print(f"\n| decode batch | steps | host busy ms a step | wait ms a step | steps that waited < {waited_us:g} us |"
              "\n|---|---|---|---|---|")
        bounds = (1, 32, 64, 128, 256, float("inf"))
        for low, high in zip(bounds, bounds[1:]):
            rows = [(busy, wait) for batch, prefill, busy, wait in self.rows if not prefill and low <= batch < high]
            if rows:
                print(f"| {low}-{high - 1:g} | {len(rows)} | {1e3 * sum(b for b, _ in rows) / len(rows):.2f} | "
                      f"{1e3 * sum(w for _, w in rows) / len(rows):.2f} | {sum(w < waited_us / 1e6 for _, w in rows)} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="preset name (dummy weights) or checkpoint folder")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto")
    parser.add_argument("--trace", type=Path, help="also write a Chrome trace here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/breakdown.py needs a CUDA GPU")
    config = load_config(args.model)
    prompts, params = workload(args.num_seqs, 1024, 1024, min(10000, config.vocab_size - 1))
    llm = LLM(args.model, max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype)
    warm_up(llm, prompts)

    outputs = []
    for prompt, p in zip(prompts, params):
        llm.add_request(prompt, p, stream=False)
    torch.cuda.synchronize()
    clock = StepClock()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels only: CPU op tracing would slow the host
        start = time.perf_counter()
        while llm.has_unfinished():
            outputs += [out.output for out in clock.step(llm)]
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    clock.close()
    steps = Counter(is_prefill for _, is_prefill, _, _ in clock.rows)
    gaps = idle_gaps(prof, args.trace)

    by_kind, launches, names = defaultdict(float), Counter(), defaultdict(list)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            kind = kind_of(event.key)
            by_kind[kind] += event.self_device_time_total / 1e6
            launches[kind] += event.count
            names[kind].append((event.self_device_time_total / 1e6, event.count, event.key))
    gpu = sum(by_kind.values())
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"{args.model}, KV {args.kv_cache_dtype}: {args.num_seqs} requests, {tokens} output tokens in {wall:.2f} s "
          f"= {tokens / wall:.0f} tok/s (under the profiler); {steps[True]} prefill and {steps[False]} decode steps")
    print("\n| part | seconds | % of wall | kernel launches |\n|---|---|---|---|")
    for kind, seconds in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"| {kind} | {seconds:.3f} | {100 * seconds / wall:.1f}% | {launches[kind]} |")
    print(f"| host (GPU idle) | {wall - gpu:.3f} | {100 * (wall - gpu) / wall:.1f}% | |")
    print(f"| total | {wall:.3f} | 100% | {sum(launches.values())} |")
    # GEMM: cuBLAS's and our small-batch linear; other: the kernels no kind names; MoE: router, alignment, the grouped GEMMs and the sum; decode
    # attention and its merge; the norms.
    for kind in [kind for kind in ("GEMM", "other", "MoE", "decode attention", "norms") if names[kind]]:
        print(f"\n{kind} kernels, longest first: " + "; ".join(
            f"{name[:70]} {seconds:.3f} s x{count}" for seconds, count, name in sorted(names[kind], reverse=True)[:8]))
    print_gaps(gaps)
    clock.print()
    per_step = steps[True] + steps[False]
    print(f"\nkernel launches per step and layer ({config.num_hidden_layers} layers; sampler and LM head included): "
          + ", ".join(f"{kind} {n / per_step / config.num_hidden_layers:.2f}" for kind, n in sorted(launches.items()))
          + f"; all {sum(launches.values()) / per_step / config.num_hidden_layers:.2f}")
    llm.close()


if __name__ == "__main__":
    main()
