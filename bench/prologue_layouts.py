"""The e4m3 attention prologue (qk_norm_rotary_store, no copies) in each cache layout, against the bf16 one.

    python bench/prologue_layouts.py

One layer of bench/prefill_cases.layer_inputs (16k new tokens, 16 q / 8 kv heads, D 128, prompts of 1k
tokens) for blocks of 16 and 256: the bf16 cache, then e4m3 caches holding the same values with V
key-major or contiguous and the scales head-major or contiguous (the engine keeps the first of
each). CUDA-graph replays of the installed kernel with its tuned config, best of three (us).
"""
import torch

import prefill_cases
from timing import graph_time_ms
from tritonllm import kernels
from tritonllm.kernels import reference
from tritonllm.kernels.fp8 import head_major_copy
from tritonllm.kernels.kv_cache import key_major_copy


def best_us(fn) -> float:
    return min(1e3 * graph_time_ms(fn, [()]) for _ in range(3))


def main():
    print("| cache | block 16 | block 256 |\n|---|---|---|")
    rows = {}
    for block_size in (16, 256):
        prologue, slots, caches = prefill_cases.layer_inputs(1024, 0, block_size)[:3]
        (k8, k_scale), (v8, v_scale) = (reference.quantize_e4m3(c) for c in caches)
        v_layouts = {"V key-major": key_major_copy(v8), "V contiguous": v8}
        scale_layouts = {"scales head-major": (head_major_copy(k_scale), head_major_copy(v_scale)),
                         "scales contiguous": (k_scale, v_scale)}
        rows.setdefault("bf16", []).append(
            best_us(lambda: kernels.qk_norm_rotary_store(*prologue, *caches, slots, 16, 8)))
        for scale_name, (ks, vs) in scale_layouts.items():
            for v_name, v in v_layouts.items():
                rows.setdefault(f"e4m3, {v_name}, {scale_name}", []).append(best_us(
                    lambda: kernels.qk_norm_rotary_store(*prologue, k8, v, slots, 16, 8, k_scale=ks, v_scale=vs)))
        torch.cuda.empty_cache()
    for name, times in rows.items():
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + " |")


if __name__ == "__main__":
    main()
