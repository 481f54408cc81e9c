"""Timing helpers and GPU ceilings shared by the kernel benchmarks (bench/kernels.py, bench/decode_workload.py).

The ceilings are those of the H200 the notes were measured on (bench/NOTES-elementwise.md,
"Floors and ceilings"): percentages of them are only meaningful on that GPU.
"""
import math
import time

import torch

import tritonllm  # noqa: F401  (first: without a GPU it selects Triton's interpreter before triton is imported)
from triton.testing import do_bench

COPY_BYTES_PER_S = 4.24e12  # device-to-device copy: the ceiling of memory-bound kernels
BF16_FLOPS_PER_S = 690e12  # bf16 GEMM: the ceiling of compute-bound kernels
L2_BYTES = 50 * 2**20
MAX_INPUT_SETS = 256  # the most input sets a graph timing cycles through (3x L2 down to sets of 600 KB)
WARM_UP_S = 0.1  # seconds of graph replays before the timed ones (see graph_time_ms)


def time_ms(fn) -> float:
    """Median time of fn in ms; do_bench warms up and flushes L2 between repetitions."""
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def input_sets(bytes_per_set: int) -> int:
    """How many input sets a graph timing cycles through: enough to fill 3x L2, so each call reads its
    inputs from memory, and at most MAX_INPUT_SETS."""
    return 1 + min(MAX_INPUT_SETS - 1, 3 * L2_BYTES // max(bytes_per_set, 1))


def graph_time_ms(fn, arg_sets: list[tuple], replays: int = 30, sample_ms: float = 2.0) -> float:
    """Median time of one fn call in ms, from a CUDA graph that calls fn once on each input set.

    For kernels of a few microseconds: the graph removes launch overhead (as the engine replays
    decode steps), and cycling through input sets larger than L2 together keeps them cold. Each of
    the `replays` samples times back-to-back replays worth about sample_ms: the host's launch of a
    graph (about 10 us) then falls on a sample, not on every call, as an engine's decode step pays
    it once for all its layers.
    """
    for args in arg_sets:  # tunes and compiles outside the capture
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in arg_sets:
            fn(*args)
    # Replays for WARM_UP_S first, so that the timed ones find the GPU busy, as a serving engine
    # keeps it, rather than just out of the host's setup (the suspect of a gap in NOTES-decode-attention.md).
    deadline = time.perf_counter() + WARM_UP_S
    while time.perf_counter() < deadline:
        graph.replay()
        torch.cuda.synchronize()

    def sample(count):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    count = max(1, math.ceil(sample_ms / sample(1)))  # one replay, its launch included, sizes the samples
    times = sorted(sample(count) / (count * len(arg_sets)) for _ in range(replays))
    return times[len(times) // 2]
