"""Where the time of a prefill-sized fused_moe call goes, kernel by kernel (issue 18's diagnosis).

    python bench/moe_breakdown.py

For each shape (Qwen3-30B-A3B at 4096 and 16384 tokens, its TP 2 half, 235B-A22B at 4096) and each
config given below: the call's median time (bench/timing.py), its TFLOP/s over the routed FLOPs and
its ratio to cuBLAS on the same two GEMMs without the routing, then each kernel's time from
torch.profiler. Each config runs with the router's ids (random routing: each expert's group padded
to BLOCK_M) and with balanced ids (every expert gets exactly T k / E pairs: no padding), which
prices the padding. Needs a GPU.
"""
import torch
from torch.profiler import ProfilerActivity, profile

from timing import time_ms
from tritonllm import kernels

SHAPES = {"30B": (128, 8, 768, 2048), "30B TP2": (128, 8, 384, 2048), "235B": (128, 8, 1536, 4096)}


def config(block_m, up, down, group_m=8):
    """A fused_moe config from (BLOCK_N, BLOCK_K, warps, stages) of each GEMM."""
    return {"BLOCK_M": block_m, "BLOCK_N": up[0], "BLOCK_K": up[1], "GROUP_M": group_m, "num_warps": up[2],
            "num_stages": up[3], "DOWN_BLOCK_N": down[0], "DOWN_BLOCK_K": down[1], "DOWN_WARPS": down[2],
            "DOWN_STAGES": down[3]}


CONFIGS = {
    "128 s3": config(128, (128, 64, 8, 3), (256, 64, 8, 3)),
    "128 s4": config(128, (128, 64, 8, 4), (256, 64, 8, 4)),
    "128 s3 group 32": config(128, (128, 64, 8, 3), (256, 64, 8, 3), group_m=32),
    "64 n256 w8": config(64, (256, 64, 8, 3), (256, 64, 8, 3)),
    "64 n128 w4": config(64, (128, 64, 4, 4), (128, 64, 4, 4)),
}
RUNS = [("30B", 4096), ("30B", 16384), ("30B TP2", 4096), ("235B", 4096)]


def kernel_times(fn, reps=10) -> dict[str, float]:
    """Each CUDA kernel's mean time per call in us."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {event.key: event.self_device_time_total / reps for event in prof.key_averages()
            if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0}


def main():
    if not torch.cuda.is_available():
        raise SystemExit("bench/moe_breakdown.py needs a CUDA GPU")
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for name, tokens in RUNS:
        experts, top_k, inter, hidden = SHAPES[name]
        w13 = torch.randn(experts, 2 * inter, hidden, **bf16) * hidden**-0.5
        w2 = torch.randn(experts, hidden, inter, **bf16) * inter**-0.5
        x = torch.randn(tokens, hidden, **bf16)
        weights, ids = kernels.moe_route(torch.randn(tokens, experts, **bf16), top_k, True)
        balanced = (torch.arange(tokens * top_k, device="cuda", dtype=torch.int32) % experts).view(tokens, top_k)
        a1, a2 = torch.randn(tokens * top_k, hidden, **bf16), torch.randn(tokens * top_k, inter, **bf16)
        cublas = time_ms(lambda: a1 @ w13[0].T) + time_ms(lambda: a2 @ w2[0].T)
        flops = 2 * tokens * top_k * 3 * inter * hidden
        print(f"\n## {name} T{tokens}: cuBLAS pair {cublas * 1e3:.0f} us\n\n| config | routing | us | TFLOP/s "
              "| vs cuBLAS pair | kernels (us) |\n|---|---|---|---|---|---|")
        for label, cfg in CONFIGS.items():
            for routing, topk_ids in (("router", ids), ("balanced", balanced)):
                def call():
                    return kernels.fused_moe(x, w13, w2, weights, topk_ids, config=cfg)
                ms = time_ms(call)
                times = sorted(kernel_times(call).items(), key=lambda kv: -kv[1])
                parts = ", ".join(f"{key.removesuffix('_kernel').lstrip('_')} {us:.0f}" for key, us in times if us > 2)
                print(f"| {label} | {routing} | {ms * 1e3:.0f} | {flops / ms / 1e9:.0f} | {cublas / ms:.2f}x | {parts} |")


if __name__ == "__main__":
    main()
