"""The decode step's GEMMs against their floors: cuBLAS (F.linear) and kernels.linear (the engine's) at decode batch sizes.

    python bench/decode_gemms.py [--model qwen3-0.6b] [--batches 8 16 32 64 128 256]

For each batch B: a layer's four projections (q/k/v, o, gate/up, down) and the LM head, each timed
alone, then the four of a layer back to back in one graph (the engine's order, with the kernels in
between left out), as graph replays over weight sets larger than L2. The floor of a GEMM is the larger
of its bytes (weights, input, output) over the copy ceiling and its FLOPs over the bf16 GEMM ceiling.
kernels.linear runs its tuned configs (bench/kernels.py --only linear tunes them, from `linear_cases`).
NOTES-linear.md has the numbers.
"""
import argparse

import torch
import torch.nn.functional as F

from kernel_cases import Case
from timing import BF16_FLOPS_PER_S, COPY_BYTES_PER_S, graph_time_ms, input_sets
from tritonllm import kernels
from tritonllm.loader import load_config

PROJECTIONS = ("qkv", "o", "gate_up", "down")


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


def linear_cases(quick: bool, model: str = "qwen3-0.6b") -> list[Case]:
    """bench/kernels.py's cases of kernels.linear: a layer's four projections at the engine's decode
    batch buckets, bf16, graph-timed against cuBLAS; bytes as gemm_bytes."""
    shapes = layer_shapes(load_config(model))
    batches = (16, 256) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    return [Case("linear", f"{name} N{n} K{k} M{batch} bf16",
                 lambda b=batch, n=n, k=k: (torch.randn(b, k, **bf16), torch.randn(n, k, **bf16) * k**-0.5),
                 kernels.linear, {"cuBLAS": F.linear}, bytes=gemm_bytes(batch, n, k), graph=True)
            for batch in batches for name in PROJECTIONS for n, k in [shapes[name]]]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="preset name or checkpoint folder")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_gemms.py needs a CUDA GPU")
    shapes = layer_shapes(load_config(args.model))
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    gemms = {"cuBLAS": F.linear, "triton": kernels.linear}
    print(f"{args.model}: (N, K) {shapes}\n\n| B | GEMM | floor us | cuBLAS us | of floor | triton us | of floor | "
          "triton GB/s | cuBLAS / triton |\n|---|---|---|---|---|---|---|---|---|")
    layer = [shapes[name] for name in PROJECTIONS]

    def row(batch, name, floor, times, moved):
        cublas, triton = times["cuBLAS"], times["triton"]
        print(f"| {batch} | {name} | {floor:.1f} | {cublas:.1f} | {floor / cublas:.0%} | {triton:.1f} | "
              f"{floor / triton:.0%} | {moved / triton / 1e3:.0f} | {cublas / triton:.2f} |")

    for batch in args.batches:
        for name, (n, k) in shapes.items():
            sets = [(torch.randn(batch, k, **bf16), torch.randn(n, k, **bf16) * 0.02)
                    for _ in range(input_sets(gemm_bytes(batch, n, k)))]
            times = {label: 1e3 * graph_time_ms(fn, sets) for label, fn in gemms.items()}
            row(batch, name, floor_us(batch, n, k), times, gemm_bytes(batch, n, k))
        sets = [tuple(t for n, k in layer for t in (torch.randn(batch, k, **bf16), torch.randn(n, k, **bf16) * 0.02))
                for _ in range(input_sets(sum(gemm_bytes(batch, n, k) for n, k in layer)))]

        def four(fn):
            def run(*tensors):
                for x, w in zip(tensors[::2], tensors[1::2]):
                    fn(x, w)
            return run
        times = {label: 1e3 * graph_time_ms(four(fn), sets) for label, fn in gemms.items()}
        row(batch, "a layer's four, back to back", sum(floor_us(batch, n, k) for n, k in layer), times,
            sum(gemm_bytes(batch, n, k) for n, k in layer))


if __name__ == "__main__":
    main()
