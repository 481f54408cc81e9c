"""A/B of the fp8 prefill step (issue 19) with other trees' prologue and gather, on the same inputs in one process.

    python bench/prefill_step_ab.py [TREE ...] [--parts]

The step is bench/prefill_cases.layer_fp8, as layers/attention.py runs it over an e4m3 cache: the fused
prologue (`qk_norm_rotary_store`, storing the new rows and their bf16 copies), `gather_kv_blocks` of the
blocks holding cached tokens, then prefill attention on the copies. For each TREE, its
kernels/qk_norm_rotary.py and kernels/kv_cache.py are loaded as modules of their own and stand in for
the installed ones. The anchor is the same step over the bf16 cache read in place (layer_bf16). All
are CUDA-graph replays of one input set (larger than L2), in rounds that alternate the trees; each
cell is the best of the rounds. --parts also times the installed tree's parts: each prologue, the
gather and each attention alone.
"""
import argparse
from pathlib import Path

import torch

import prefill_cases
from prefill_ab import load
from prologue_ab import keep_kernel_keys
from timing import graph_time_ms
from tritonllm import kernels

SHAPES = [(1024, 0, 16), (1024, 0, 256), (4096, 0, 16), (16384, 0, 256), (512, 512, 16)]  # new, cached, block


def tree_step(tree: str):
    """(prologue, gather) of TREE; a tuned config's keys that its kernel does not take are left out."""
    prologue, cache = (load(str(Path(tree) / "kernels" / name)) for name in ("qk_norm_rotary.py", "kv_cache.py"))
    keep_kernel_keys(prologue, prologue._TUNING.config)
    return prologue.qk_norm_rotary_store, cache.gather_kv_blocks


def timed(fn, inputs, step=None) -> float:
    """us of fn(*inputs), with (prologue, gather) = step standing in for the installed ones where given."""
    installed = kernels.qk_norm_rotary_store, kernels.gather_kv_blocks
    if step is not None:
        kernels.qk_norm_rotary_store, kernels.gather_kv_blocks = step
    try:
        return 1e3 * graph_time_ms(lambda: fn(*inputs), [()])
    finally:
        kernels.qk_norm_rotary_store, kernels.gather_kv_blocks = installed


def parts(inputs) -> dict:
    """us of the installed tree's parts of the step on these inputs."""
    prologue, slots, caches, fp8, tables, cu_q, seq_lens, max_q, gather_blocks, copy_tables, copy_slots = inputs
    k8, v8, k_scale, v_scale = fp8
    copy_shape = (copy_tables.numel(), *k8.shape[1:])
    k, v = prologue[1].new_empty(copy_shape), prologue[1].new_empty(copy_shape)
    copies = dict(k_scale=k_scale, v_scale=v_scale, k_copy=k, v_copy=v, copy_slots=copy_slots)
    q8 = kernels.qk_norm_rotary_store(*prologue, k8, v8, slots, 16, 8, **copies)
    kernels.gather_kv_blocks(k8, v8, gather_blocks, q8.dtype, k_scale=k_scale, v_scale=v_scale, out=(k, v))
    q = kernels.qk_norm_rotary_store(*prologue, *caches, slots, 16, 8)
    calls = {
        "bf16 prologue": lambda: kernels.qk_norm_rotary_store(*prologue, *caches, slots, 16, 8),
        "fp8 prologue with copies": lambda: kernels.qk_norm_rotary_store(*prologue, k8, v8, slots, 16, 8, **copies),
        "gather": lambda: kernels.gather_kv_blocks(k8, v8, gather_blocks, q8.dtype, k_scale=k_scale,
                                                   v_scale=v_scale, out=(k, v)),
        "attention in place": lambda: kernels.prefill_attention(q, *caches, cu_q, seq_lens, tables, max_q_len=max_q),
        "attention on copies": lambda: kernels.prefill_attention(q8, k, v, cu_q, seq_lens, copy_tables,
                                                                 max_q_len=max_q),
    }
    if gather_blocks.numel() == 0:
        del calls["gather"]
    return {name: timed(call, ()) for name, call in calls.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", help="roots of other trees (their kernels/ is loaded)")
    parser.add_argument("--parts", action="store_true", help="also time the installed tree's parts")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    steps = {"installed": (kernels.qk_norm_rotary_store, kernels.gather_kv_blocks)}
    steps |= {tree: tree_step(tree) for tree in args.trees}
    print("| step | bf16 step (us) | " + " | ".join(f"{name}, fp8 step" for name in steps) + " |\n"
          "|---|---|" + "---|" * len(steps))
    for new, cached, block_size in SHAPES:
        inputs = prefill_cases.layer_inputs(new, cached, block_size)
        times = {name: [] for name in ["bf16", *steps]}
        for _ in range(args.rounds):
            times["bf16"].append(timed(prefill_cases.layer_bf16, inputs))
            for name, step in steps.items():
                times[name].append(timed(prefill_cases.layer_fp8, inputs, step))
        anchor = min(times["bf16"])
        cells = [f"{min(times[name]):.1f} ({anchor / min(times[name]):.3f}x)" for name in steps]
        label = f"B{prefill_cases.TOKENS // new} x {new} over {cached}, block {block_size}"
        print(f"| {label} | {anchor:.1f} | " + " | ".join(cells) + " |", flush=True)
        if args.parts:
            print("|   parts: " + ", ".join(f"{k} {v:.1f}" for k, v in parts(inputs).items()) + " |", flush=True)


if __name__ == "__main__":
    main()
