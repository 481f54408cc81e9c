"""A/B of the fused attention prologue (qk_norm_rotary_store) from other trees, on the same inputs in one process.

    python bench/prologue_ab.py OTHER/kernels/qk_norm_rotary.py [...] [--configs 1,8 4,8]

Times the installed kernel and each file's (loaded as a module of its own) with each config
(TOKENS,num_warps; default: each bucket's shipped config) on Qwen3-0.6B's heads (16 q / 8 kv, D 128,
bf16 qkv, KV blocks of 16) into a bf16 cache and into the engine's e4m3 cache (key-major V,
head-major scales), with and without prefill copies. Prefill sizes (>= 1024 tokens) write runs of
a block's consecutive slots, as a prefill does; decode sizes one slot per sequence, scattered. Each
time is the median of CUDA-graph replays over 4 input sets (the 16k-token ones larger than L2),
installed / other / installed again; every file's cache bytes, scales, copies and q must equal
the installed kernel's.
"""
import argparse

import torch

from kernel_cases import store_slots
from prefill_ab import load
from timing import graph_time_ms
from tritonllm.kernels import qk_norm_rotary as installed
from tritonllm.kernels.fp8 import empty_kv_scales
from tritonllm.kernels.kv_cache import empty_kv_cache
from tritonllm.layers import rotary

HQ, HKV, D, BS = 16, 8, 128, 16
CASES = [(16384, "bf16"), (16384, "fp8"), (16384, "fp8 copies"), (1024, "fp8 copies"), (256, "bf16"), (256, "fp8"),
         (128, "bf16"), (128, "fp8"), (64, "bf16"), (64, "fp8"), (32, "fp8"), (8, "fp8"), (1, "fp8")]


def inputs(tokens: int, cache: str) -> tuple:
    """(positions, qkv, q_weight, k_weight, eps, cos_sin, k_cache, v_cache, slots, Hq, Hkv), keywords."""
    blocks = 4096 + tokens // BS
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    slots = store_slots(tokens, blocks, BS)
    if tokens >= 1024:
        positions = torch.arange(tokens, device="cuda") % 1024
    else:
        positions = torch.randint(0, 4096, (tokens,), device="cuda")
    fp8 = cache != "bf16"
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k_cache = empty_kv_cache(blocks, BS, HKV, D, dtype, "cuda").zero_()
    v_cache = empty_kv_cache(blocks, BS, HKV, D, dtype, "cuda", key_major=fp8).zero_()
    keywords = {}
    if fp8:
        keywords = {name: empty_kv_scales(blocks, BS, HKV, "cuda", head_major=True).zero_() for name in ("k_scale", "v_scale")}
    if "copies" in cache:
        keywords |= {name: torch.zeros(tokens // BS, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
                     for name in ("k_copy", "v_copy")}
        keywords["copy_slots"] = torch.arange(tokens, device="cuda")
    cos_sin = rotary.cos_sin_cache(D, 4096, 1e6).cuda()
    return (positions, qkv, *weights, 1e-6, cos_sin, k_cache, v_cache, slots, HQ, HKV), keywords


def outputs(module, args, keywords) -> list:
    """What module's kernel writes on these inputs, into caches, scales and copies zeroed first."""
    tensors = [args[6], args[7]] + [t for name, t in keywords.items() if name != "copy_slots"]
    for t in tensors:
        t.zero_()
    q = module.qk_norm_rotary_store(*args, **keywords)
    return [t.contiguous().view(torch.uint8).clone() for t in [q] + tensors]


def keep_kernel_keys(module, config_of):
    """Make module's tuning answer config_of(bucket, ...) without the keys its kernel does not take
    (another tree's kernel may lack a meta-parameter of the installed one, e.g. DIRECT_STORES)."""
    names = set(module._qk_norm_rotary_store_kernel.arg_names) | {"num_warps", "num_stages", "maxnreg"}
    module._TUNING.config = lambda *args, **kw: {k: v for k, v in config_of(*args, **kw).items() if k in names}
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="qk_norm_rotary.py of each other tree")
    parser.add_argument("--configs", nargs="+", default=[],
                        help="TOKENS,num_warps[,DIRECT_STORES 0/1] (default: the shipped config)")
    args = parser.parse_args()
    modules = {path: load(path) for path in args.files}
    shipped = installed._TUNING.config  # before the timings replace it
    print("| tokens | cache | config | installed (us) | " + " | ".join(args.files) + " | installed again (us) |\n"
          "|---|---|---|---|" + "---|" * len(args.files) + "---|")
    configs = [{"DIRECT_STORES": False} | dict(zip(("TOKENS", "num_warps", "DIRECT_STORES"), map(int, c.split(","))))
               | {"num_stages": 1} for c in args.configs]
    for tokens, cache in CASES:
        sets = [inputs(tokens, cache) for _ in range(4)]
        bucket = installed.qk_norm_rotary_store_bucket(torch.bfloat16, HQ, HKV, D, tokens,
                                                       torch.float8_e4m3fn if cache != "bf16" else None)
        for config in configs or [shipped(bucket)]:
            def use(module):
                return keep_kernel_keys(module, lambda *_, **__: config)

            def timed(module):
                use(module)
                return graph_time_ms(lambda a, k: module.qk_norm_rotary_store(*a, **k), sets) * 1e3  # per call

            cells = [f"{timed(installed):.2f}"]
            expected = outputs(installed, *sets[0])
            for module in modules.values():
                same = all(torch.equal(a, b) for a, b in zip(outputs(use(module), *sets[0]), expected))
                cells.append(f"{timed(module):.2f}" if same else "differs")
            cells.append(f"{timed(installed):.2f}")
            label = f"{config['TOKENS']} x {config['num_warps']}"
            print(f"| {tokens} | {cache} | {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
