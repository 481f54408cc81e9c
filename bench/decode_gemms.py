"""The decode step's GEMMs against their floors: cuBLAS (F.linear, as the engine calls it) at decode batch sizes.

    python bench/decode_gemms.py [--model qwen3-0.6b] [--batches 8 16 32 64 128 256]

For each batch B: a layer's four projections (q/k/v, o, gate/up, down) and the LM head, each timed
alone, then the four of a layer back to back in one graph (the engine's order, with the kernels in
between left out), as graph replays over weight sets larger than L2. The floor of a GEMM is the larger
of its bytes (weights, input, output) over the copy ceiling and its FLOPs over the bf16 GEMM ceiling.
NOTES-engine.md has the workload's sum: the decode GEMMs ran at about 42% of their floor.
"""
import argparse

import torch
import torch.nn.functional as F

from timing import BF16_FLOPS_PER_S, COPY_BYTES_PER_S, graph_time_ms, input_sets
from tritonllm.loader import load_config


def layer_shapes(config) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection: out features, in features (TP 1)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"qkv": (q + 2 * kv, config.hidden_size), "o": (config.hidden_size, q),
            "gate_up": (2 * config.intermediate_size, config.hidden_size),
            "down": (config.hidden_size, config.intermediate_size), "lm_head": (config.vocab_size, config.hidden_size)}


def gemm_bytes(batch: int, n: int, k: int) -> int:
    """bf16 bytes a GEMM of [batch, k] x [k, n] moves at least: weights, input and output."""
    return (n * k + batch * (n + k)) * 2


def floor_us(batch: int, n: int, k: int) -> float:
    return 1e6 * max(gemm_bytes(batch, n, k) / COPY_BYTES_PER_S, 2 * batch * n * k / BF16_FLOPS_PER_S)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="preset name or checkpoint folder")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_gemms.py needs a CUDA GPU")
    shapes = layer_shapes(load_config(args.model))
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    print(f"{args.model}: (N, K) {shapes}\n\n| B | GEMM | us | floor us | of floor | TFLOP/s | GB/s |\n|---|---|---|---|---|---|---|")
    layer = [shapes[name] for name in ("qkv", "o", "gate_up", "down")]
    for batch in args.batches:
        for name, (n, k) in shapes.items():
            sets = [(torch.randn(batch, k, **bf16), torch.randn(n, k, **bf16) * 0.02)
                    for _ in range(input_sets(gemm_bytes(batch, n, k)))]
            us = 1e3 * graph_time_ms(F.linear, sets)
            floor = floor_us(batch, n, k)
            print(f"| {batch} | {name} | {us:.1f} | {floor:.1f} | {floor / us:.0%} | {2 * batch * n * k / us / 1e6:.0f} | "
                  f"{gemm_bytes(batch, n, k) / us / 1e3:.0f} |")
        sets = [tuple(t for n, k in layer for t in (torch.randn(batch, k, **bf16), torch.randn(n, k, **bf16) * 0.02))
                for _ in range(input_sets(sum(gemm_bytes(batch, n, k) for n, k in layer)))]

        def four(*tensors):
            for x, w in zip(tensors[::2], tensors[1::2]):
                F.linear(x, w)
        us = 1e3 * graph_time_ms(four, sets)
        floor = sum(floor_us(batch, n, k) for n, k in layer)
        print(f"| {batch} | a layer's four, back to back | {us:.1f} | {floor:.1f} | {floor / us:.0%} | | |")


if __name__ == "__main__":
    main()
