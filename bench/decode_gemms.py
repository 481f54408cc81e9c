"""The decode step's GEMMs against their floors: cuBLAS (F.linear) and kernels.linear at decode batch sizes.

    python bench/decode_gemms.py [--model qwen3-0.6b] [--batches 1 2 4 8 16 32 64 128 256] [--tune]

For each batch B: a layer's projections (q/k/v, o, gate/up, down; a MoE model's router instead of
gate/up and down) and the LM head, each timed alone, then a layer's back to back in one graph (the
engine's order, with the kernels in between left out), as graph replays over weight sets larger than
L2: cuBLAS, and kernels.linear as the engine's layers call it (its own Triton kernel up to MAX_ROWS
rows, each projection with its zeroed counter buffer; past that it calls cuBLAS itself). The floor
of a GEMM is the larger of its bytes (weights, input, output) over the copy ceiling and its FLOPs
over the bf16 GEMM ceiling. NOTES-engine.md has the workload's sum.

--tune first tunes kernels.linear's buckets of the model's projections at 1 to MAX_ROWS rows (cuBLAS
among the candidates), each config graph-timed over the same cold weight sets, and writes the
winners to the tuned-config file.
"""
import argparse

import torch
import torch.nn.functional as F
import triton

from timing import BF16_FLOPS_PER_S, COPY_BYTES_PER_S, graph_time_ms, input_sets
from tritonllm.kernels import tuning
from tritonllm.kernels.linear import LINEAR_TUNABLE, MAX_ROWS, linear, linear_bucket, linear_counts
from tritonllm.loader import load_config
from tritonllm.models.qwen3 import head_dim_of


def layer_shapes(config) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection: out features, in features (TP 1)."""
    head_dim = head_dim_of(config)
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"qkv": (q + 2 * kv, config.hidden_size), "o": (config.hidden_size, q)}
    if getattr(config, "num_experts", None):
        shapes["router"] = (config.num_experts, config.hidden_size)
    else:
        shapes |= {"gate_up": (2 * config.intermediate_size, config.hidden_size),
                   "down": (config.hidden_size, config.intermediate_size)}
    return shapes | {"lm_head": (config.vocab_size, config.hidden_size)}


def gemm_bytes(batch: int, n: int, k: int) -> int:
    """bf16 bytes a GEMM of [batch, k] x [k, n] moves at least: weights, input and output."""
    return (n * k + batch * (n + k)) * 2


def floor_us(batch: int, n: int, k: int) -> float:
    return 1e6 * max(gemm_bytes(batch, n, k) / COPY_BYTES_PER_S, 2 * batch * n * k / BF16_FLOPS_PER_S)


def weight_sets(batch: int, n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, W) pairs, bf16, enough of them that their weights exceed L2 together."""
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    return [(torch.randn(batch, k, **bf16), torch.randn(n, k, **bf16) * 0.02)
            for _ in range(input_sets(gemm_bytes(batch, n, k)))]


def tune(shapes: dict[str, tuple[int, int]]):
    """Each bucket's fastest config of kernels.linear's space at 1..MAX_ROWS rows, into the tuned table."""
    table = tuning.tuned_table().setdefault("linear", {})
    for name, (n, k) in shapes.items():
        counts = linear_counts(n, "cuda")
        rows = 1
        while rows <= MAX_ROWS:
            sets, bucket = weight_sets(rows, n, k), linear_bucket(torch.bfloat16, n, k, rows)
            times = []
            for cfg in LINEAR_TUNABLE.space(*bucket):
                try:
                    times.append((graph_time_ms(lambda x, w, c=cfg: linear(x, w, counts=counts, config=c), sets,
                                                replays=15), cfg))
                except triton.runtime.errors.OutOfResources:
                    continue
            times.sort(key=lambda row: row[0])
            table[tuning.bucket_key(bucket)] = times[0][1]
            cublas = next(ms for ms, cfg in times if cfg.get("TORCH"))
            print(f"tuned {name} (N {n}, K {k}) M {rows}: {1e3 * times[0][0]:.1f} us {times[0][1]}, cuBLAS "
                  f"{1e3 * cublas:.1f} us, {len(times)} configs", flush=True)
            rows *= 2
    print(f"tuned configs written to {tuning.save()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="preset name or checkpoint folder")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--tune", action="store_true", help="tune kernels.linear's buckets of these shapes first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_gemms.py needs a CUDA GPU")
    shapes = layer_shapes(load_config(args.model))
    if args.tune:
        tune({name: shape for name, shape in shapes.items() if name != "lm_head"})
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    print(f"{args.model}: (N, K) {shapes}; kernels.linear runs its Triton kernel up to {MAX_ROWS} rows\n\n"
          "| B | GEMM | cuBLAS us | linear us | floor us | linear of floor | linear speedup |\n"
          "|---|---|---|---|---|---|---|")
    layer = [shape for name, shape in shapes.items() if name != "lm_head"]
    counts = {n: linear_counts(n, "cuda") for n, _ in shapes.values()}

    def ours(x, w):
        return linear(x, w, counts=counts[w.shape[0]])

    for batch in args.batches:
        for name, (n, k) in shapes.items():
            sets = weight_sets(batch, n, k)
            cublas, mine = (1e3 * graph_time_ms(fn, sets) for fn in (F.linear, ours))
            floor = floor_us(batch, n, k)
            print(f"| {batch} | {name} | {cublas:.1f} | {mine:.1f} | {floor:.1f} | {floor / mine:.0%} | "
                  f"{cublas / mine:.2f}x |")
        sets = [tuple(t for n, k in layer for t in (torch.randn(batch, k, **bf16), torch.randn(n, k, **bf16) * 0.02))
                for _ in range(input_sets(sum(gemm_bytes(batch, n, k) for n, k in layer)))]

        def back_to_back(fn):
            def run(*tensors):
                for x, w in zip(tensors[::2], tensors[1::2]):
                    fn(x, w)
            return run
        cublas, mine = (1e3 * graph_time_ms(back_to_back(fn), sets) for fn in (F.linear, ours))
        floor = sum(floor_us(batch, n, k) for n, k in layer)
        print(f"| {batch} | a layer's {len(layer)}, back to back | {cublas:.1f} | {mine:.1f} | {floor:.1f} | "
              f"{floor / mine:.0%} | {cublas / mine:.2f}x |")


if __name__ == "__main__":
    main()
