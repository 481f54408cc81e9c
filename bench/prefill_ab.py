"""A/B of Hopper prefill kernels from several trees, on the same inputs in one process (issue 21).

    python bench/prefill_ab.py TREE_A/kernels/prefill_attention_hopper.py TREE_B/... [--configs 128,64,4 128,128,2]

Each file is loaded as a module of its own; its `prefill_attention_hopper` launcher is called with
each config on the bench's prefill shapes (causal, 16/8 heads, D 128, bf16, 16k new tokens; S 512
to 16k at blocks 16 and 256, the workload's varlen batch, prefix hits), timed as CUDA-graph
replays (the launch's host time would otherwise show at short S), and checked against the
portable kernel (relative error < 2e-2). Anchors in the same run: SDPA cuDNN and flash, the
portable kernel. Prints TFLOP/s per kernel and config, then the best config of each kernel.
"""
import argparse
import importlib.util
from pathlib import Path

import torch

from prefill_cases import anchors, batch_inputs, causal_flops, workload_lengths
from timing import graph_time_ms
from tritonllm import kernels
from tritonllm.kernels.paged import LOG2E


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"hopper_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launcher(module, config):
    def run(q, k_cache, v_cache, cu, seq_lens, tables, max_q, *_):
        return module.prefill_attention_hopper(q, k_cache, v_cache, cu, seq_lens, tables, torch.empty_like(q),
                                               128**-0.5 * LOG2E, 2, max_q, config)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="prefill_attention_hopper.py of each tree")
    parser.add_argument("--configs", nargs="+", default=["128,64,4", "128,64,3", "128,128,2"],
                        help="BLOCK_M,BLOCK_N,NUM_STAGES")
    args = parser.parse_args()
    configs = [dict(zip(("BLOCK_M", "BLOCK_N", "NUM_STAGES"), map(int, c.split(",")))) for c in args.configs]
    names = [Path(f).resolve().parent.parent.name for f in args.files]
    if len(set(names)) < len(names):  # trees of the same folder name: tell them apart by path
        names = [str(Path(f).parent.parent) for f in args.files]
    trees = {name: load(f) for name, f in zip(names, args.files)}
    cases = [(f"S{s} block {bs}", [s] * (16384 // s), 0, bs) for bs in (16, 256) for s in (512, 1024, 2048, 4096, 16384)]
    cases += [("varlen block 16", workload_lengths(), 0, 16), ("512 over 4k block 16", [512] * 32, 4096, 16)]
    summary = []
    for name, lens, context, block_size in cases:
        inputs = batch_inputs(lens, context, block_size)
        flops = causal_flops(lens, context)
        reference = kernels.prefill_attention(*inputs[:6], max_q_len=inputs[6], path="portable").float()
        rates = {}
        for label, fn in anchors(context == 0 and len(set(lens)) == 1).items():
            if label != "varlen_attn":  # not capturable
                rates[label] = flops / graph_time_ms(fn, [inputs]) / 1e9
        for tree, module in trees.items():
            for config in configs:
                fn = launcher(module, config)
                error = ((fn(*inputs).float() - reference).norm() / reference.norm()).item()
                key = f"{tree} {tuple(config.values())}"
                rates[key] = flops / graph_time_ms(fn, [inputs]) / 1e9 if error < 2e-2 else float("nan")
        print(f"{name}: " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()), flush=True)
        best = {tree: max(((v, k) for k, v in rates.items() if k.startswith(tree + " ") and v == v),
                          default=(float("nan"), f"{tree} failed")) for tree in trees}
        summary.append((name, best, rates))
    print("\n| shape | " + " | ".join(trees) + " | SDPA cuDNN | portable |\n|---|" + "---|" * (len(trees) + 2))
    for name, best, rates in summary:
        cells = [f"{v:.0f} {k.split(' ', 1)[1]}" for v, k in best.values()]
        anchor = [f"{rates[a]:.0f}" if a in rates else "" for a in ("sdpa cudnn", "triton portable")]
        print(f"| {name} | " + " | ".join(cells + anchor) + " |")


if __name__ == "__main__":
    main()
