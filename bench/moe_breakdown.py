"""Where the time of a fused_moe call goes, kernel by kernel (issue 18's diagnosis).

    python bench/moe_breakdown.py            # prefill-sized calls
    python bench/moe_breakdown.py --decode   # decode-sized calls

For each shape (Qwen3-30B-A3B at 4096 and 16384 tokens, its TP 2 half, 235B-A22B at 4096) and each
config given below: the call's median time (bench/timing.py), its TFLOP/s over the routed FLOPs and
its ratio to cuBLAS on the same two GEMMs without the routing, then each kernel's time from
torch.profiler. Each config runs with the router's ids (random routing: each expert's group padded
to BLOCK_M) and with balanced ids (every expert gets exactly T k / E pairs: no padding), which
prices the padding.

Then the ceilings of the two GEMMs alone at that shape (gate/up and down, us, and the pair against
cuBLAS): cuBLAS on the dense [T k, H] x [H, 2N] and [T k, N] x [N, H]; a dense Triton GEMM at our
prefill tiles (TMA for both operands: what Triton 3.x reaches with no grouping); PyTorch's CUTLASS
grouped GEMM (torch._grouped_mm, sm_90) over the router's and the balanced group sizes, rows already
in expert order; and fused_moe's two GEMMs (tuned config) from the profiler.

--decode: moe_route + fused_moe at 1 to 64 tokens of each shape, tuned configs, as CUDA-graph replays
cycling through weight sets whose touched experts exceed L2 together; the call's time and each
kernel's duration inside the replays (the profiler over replays of the same graph). Needs a GPU.
"""
import argparse

import torch
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_cases import group_ends, new_expert_weights
from timing import graph_time_ms, input_sets, time_ms
from tritonllm import kernels

SHAPES = {"30B": (128, 8, 768, 2048), "30B TP2": (128, 8, 384, 2048), "235B": (128, 8, 1536, 4096)}


def config(block_m, up, down, group_m=8):
    """A fused_moe config from (BLOCK_N, BLOCK_K, warps, stages) of each GEMM."""
    return {"BLOCK_M": block_m, "BLOCK_N": up[0], "BLOCK_K": up[1], "GROUP_M": group_m, "num_warps": up[2],
            "num_stages": up[3], "DOWN_BLOCK_N": down[0], "DOWN_BLOCK_K": down[1], "DOWN_WARPS": down[2],
            "DOWN_STAGES": down[3]}


CONFIGS = {
    "tuned": None,
    "128 s3": config(128, (128, 64, 8, 3), (256, 64, 8, 3)),
    "128 s4": config(128, (128, 64, 8, 4), (256, 64, 8, 4)),
    "128 s3 group 32": config(128, (128, 64, 8, 3), (256, 64, 8, 3), group_m=32),
    "64 n256 w8": config(64, (256, 64, 8, 3), (256, 64, 8, 3)),
    "64 n128 w4": config(64, (128, 64, 4, 4), (128, 64, 4, 4)),
}
RUNS = [("30B", 4096), ("30B", 16384), ("30B TP2", 4096), ("235B", 4096)]


def profiled_times(run, calls) -> dict[str, float]:
    """Each CUDA kernel's mean time in us per call, over the `calls` calls that run() makes."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return {event.key: event.self_device_time_total / calls for event in prof.key_averages()
            if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0}


def kernel_times(fn, reps=10) -> dict[str, float]:
    """Each CUDA kernel's mean time per eager call of fn in us."""
    fn()
    torch.cuda.synchronize()
    return profiled_times(lambda: [fn() for _ in range(reps)], reps)


@triton.jit
def _dense_kernel(a_desc, b_desc, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    # c = a b^T; consecutive programs share a's row block (b, one expert's size, stays in L2).
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // num_n, tl.program_id(0) % num_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k0]), tl.trans(b_desc.load([pid_n * BLOCK_N, k0])), acc)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def dense_triton(a, b, c, block_n, stages):
    """c = a @ b.T by _dense_kernel with 128-row tiles, 64-deep K steps, 8 warps."""
    a_tiles = TensorDescriptor.from_tensor(a, [128, 64])
    b_tiles = TensorDescriptor.from_tensor(b, [block_n, 64])
    grid = (triton.cdiv(a.shape[0], 128) * triton.cdiv(b.shape[0], block_n),)
    _dense_kernel[grid](a_tiles, b_tiles, c, a.shape[0], b.shape[0], a.shape[1], BLOCK_M=128, BLOCK_N=block_n,
                        BLOCK_K=64, num_warps=8, num_stages=stages)


def ceilings(x, w13, w2, weights, a1, a2, dense, routings):
    """(label, gate/up ms, down ms) of each GEMM pair at this shape; a1 [T k, H] and a2 [T k, N] stand
    for the rows in expert order, dense is cuBLAS's (gate/up ms, down ms) on them."""
    c1 = torch.empty(a1.shape[0], w13.shape[1], device="cuda", dtype=x.dtype)
    c2 = torch.empty(a1.shape[0], x.shape[1], device="cuda", dtype=x.dtype)
    rows = [("cuBLAS dense", *dense)]
    for block_n, stages in ((128, 4), (256, 3)):
        rows.append((f"Triton dense 128x{block_n}", time_ms(lambda: dense_triton(a1, w13[0], c1, block_n, stages)),
                     time_ms(lambda: dense_triton(a2, w2[0], c2, block_n, stages))))
    for routing, topk_ids in routings:
        if hasattr(torch, "_grouped_mm"):
            ends = group_ends(topk_ids, w13.shape[0])
            up = time_ms(lambda: torch._grouped_mm(a1, w13.transpose(1, 2), offs=ends))
            down = time_ms(lambda: torch._grouped_mm(a2, w2.transpose(1, 2), offs=ends))
            rows.append((f"CUTLASS grouped, {routing}", up, down))
        times = kernel_times(lambda: kernels.fused_moe(x, w13, w2, weights, topk_ids))
        rows.append((f"fused_moe, {routing}", sum(us for key, us in times.items() if "gate_up" in key) / 1e3,
                     sum(us for key, us in times.items() if "down" in key) / 1e3))
    return rows


def graph_kernel_times(arg_sets, fn, reps=10) -> dict[str, float]:
    """Each CUDA kernel's mean time per fn call in us, inside replays of a graph of fn over arg_sets."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in arg_sets:
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    return profiled_times(lambda: [graph.replay() for _ in range(reps)], reps * len(arg_sets))


def short_name(kernel: str) -> str:
    """A profiler kernel name as the table shows it: ours without `_..._kernel`, PyTorch's fill as torch.zeros."""
    return "torch.zeros" if "FillFunctor" in kernel else kernel.removesuffix("_kernel").lstrip("_")


def decode_breakdown(bf16):
    for name, (experts, top_k, inter, hidden) in SHAPES.items():
        print(f"\n## {name}\n\n| tokens | us a call | kernels (us) |\n|---|---|---|")
        expert_bytes = 3 * inter * hidden * 2
        sets = input_sets(top_k * expert_bytes)  # enough weight sets that one token's experts come from HBM
        weights = [new_expert_weights(experts, inter, hidden) for _ in range(sets)]
        for tokens in (1, 2, 4, 8, 16, 64):
            arg_sets = [(torch.randn(tokens, experts, **bf16), torch.randn(tokens, hidden, **bf16), *w)
                        for w in weights]

            def call(logits, x, w13, w2, k=top_k):
                return kernels.fused_moe(x, w13, w2, *kernels.moe_route(logits, k, True))

            us = graph_time_ms(call, arg_sets) * 1e3
            times = sorted(graph_kernel_times(arg_sets, call).items(), key=lambda kv: -kv[1])
            parts = ", ".join(f"{short_name(key)} {t:.1f}" for key, t in times)
            print(f"| {tokens} | {us:.1f} | {parts} |")
        del weights
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode", action="store_true", help="decode-sized calls instead of prefill-sized ones")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_breakdown.py needs a CUDA GPU")
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    if args.decode:
        return decode_breakdown(bf16)
    for name, tokens in RUNS:
        experts, top_k, inter, hidden = SHAPES[name]
        w13, w2 = new_expert_weights(experts, inter, hidden)
        x = torch.randn(tokens, hidden, **bf16)
        weights, ids = kernels.moe_route(torch.randn(tokens, experts, **bf16), top_k, True)
        balanced = (torch.arange(tokens * top_k, device="cuda", dtype=torch.int32) % experts).view(tokens, top_k)
        a1, a2 = torch.randn(tokens * top_k, hidden, **bf16), torch.randn(tokens * top_k, inter, **bf16)
        dense = time_ms(lambda: a1 @ w13[0].T), time_ms(lambda: a2 @ w2[0].T)
        cublas = sum(dense)
        flops = 2 * tokens * top_k * 3 * inter * hidden
        print(f"\n## {name} T{tokens}: cuBLAS pair {cublas * 1e3:.0f} us\n\n| config | routing | us | TFLOP/s "
              "| vs cuBLAS pair | kernels (us) |\n|---|---|---|---|---|---|")
        for label, cfg in CONFIGS.items():
            for routing, topk_ids in (("router", ids), ("balanced", balanced)):
                def call():
                    return kernels.fused_moe(x, w13, w2, weights, topk_ids, config=cfg)
                ms = time_ms(call)
                times = sorted(kernel_times(call).items(), key=lambda kv: -kv[1])
                parts = ", ".join(f"{short_name(key)} {us:.0f}" for key, us in times if us > 2)
                print(f"| {label} | {routing} | {ms * 1e3:.0f} | {flops / ms / 1e9:.0f} | {cublas / ms:.2f}x | {parts} |")
        print(f"\n{name} T{tokens}, the two GEMMs alone:\n\n| GEMMs | gate/up us | down us | pair us "
              "| vs cuBLAS pair |\n|---|---|---|---|---|")
        for label, up, down in ceilings(x, w13, w2, weights, a1, a2, dense, (("router", ids), ("balanced", balanced))):
            pair = up + down
            print(f"| {label} | {up * 1e3:.0f} | {down * 1e3:.0f} | {pair * 1e3:.0f} | {cublas / pair:.2f}x |")


if __name__ == "__main__":
    main()
