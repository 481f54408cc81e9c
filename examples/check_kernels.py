"""Run nine tritonllm kernels of a Qwen3-0.6B-shaped step once (norms, rotary, SiLU-and-mul, KV store, both
attentions, sample, logprobs) and compare each with its PyTorch reference (tests/kernels checks them all).

    python examples/check_kernels.py [--tokens N]

Uses the GPU when there is one, else Triton's interpreter on the CPU (small shapes keep it quick).
"""
import argparse
import time

import torch

from tritonllm import kernels
from tritonllm.kernels import reference
from tritonllm.layers.rotary import cos_sin_cache


def rel_err(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the step (default: 4096 on GPU, 16 on CPU)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = args.tokens or (4096 if device == "cuda" else 16)
    dtype, hidden, heads, kv_heads, head_dim, inter, block_size = torch.bfloat16, 1024, 16, 8, 128, 3072, 16
    torch.manual_seed(0)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, device=device, dtype=dtype)

    positions = torch.arange(tokens, device=device)
    cos_sin = cos_sin_cache(head_dim, tokens, 1e6).to(device)
    x, residual, weight = randn(tokens, hidden), randn(tokens, hidden), randn(hidden)
    q, k, v = randn(tokens, heads, head_dim), randn(tokens, kv_heads, head_dim), randn(tokens, kv_heads, head_dim)
    gate_up = randn(tokens, 2 * inter)
    num_blocks = tokens // block_size + 1
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)

    def store(fn):
        k_cache, v_cache = cache.clone(), cache.clone()
        fn(k, v, k_cache, v_cache, slots)
        return torch.cat([k_cache, v_cache])

    lengths = [tokens // 2, tokens - tokens // 2]  # two sequences share the step's tokens
    blocks_per_seq = -(-max(lengths) // block_size)
    block_tables = torch.randperm(2 * blocks_per_seq, device=device).view(2, blocks_per_seq).to(torch.int32)
    k_cache = randn(2 * blocks_per_seq, block_size, kv_heads, head_dim)
    v_cache = randn(2 * blocks_per_seq, block_size, kv_heads, head_dim)
    seq_lens = torch.tensor(lengths, device=device, dtype=torch.int32)
    cu_seqlens_q = torch.tensor([0, lengths[0], tokens], device=device, dtype=torch.int32)
    logits = randn(8, 1000, dtype=torch.float32) * 3
    sampling = (torch.zeros(8, device=device), torch.zeros(8, dtype=torch.int32, device=device),
                torch.ones(8, device=device), torch.zeros(8, device=device))

    checks = {
        "rms_norm": (lambda f: f(x, weight, 1e-6), kernels.rms_norm, reference.rms_norm),
        "fused_add_rms_norm": (lambda f: torch.cat(f(x.clone(), residual.clone(), weight, 1e-6)),
                               kernels.fused_add_rms_norm, reference.fused_add_rms_norm),
        "rotary_embedding": (lambda f: torch.cat([t.flatten() for t in f(positions, q.clone(), k.clone(), cos_sin)]),
                             kernels.rotary_embedding, reference.rotary_embedding),
        "silu_and_mul": (lambda f: f(gate_up), kernels.silu_and_mul, reference.silu_and_mul),
        "store_kv_cache": (store, kernels.store_kv_cache, reference.store_kv_cache),
        "prefill_attention": (lambda f: f(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables),
                              kernels.prefill_attention, reference.prefill_attention),
        "decode_attention": (lambda f: f(q[:2], k_cache, v_cache, seq_lens, block_tables),
                             kernels.decode_attention, reference.decode_attention),
        # Greedy rows: the ids must be equal (+1 keeps the norm of the reference ids non-zero).
        "sample (greedy)": (lambda f: f(logits, *sampling).float() + 1, kernels.sample, reference.sample),
        "compute_logprobs": (lambda f: f(logits, logits.argmax(-1)), kernels.compute_logprobs, reference.compute_logprobs),
    }
    print(f"device {device}{' (Triton interpreter)' if device == 'cpu' else ''}, {tokens} tokens, bfloat16")
    print(f"{'kernel':22} {'rel. error':>11} {'first call':>11}")
    for name, (call, triton_fn, reference_fn) in checks.items():
        start = time.perf_counter()
        out = call(triton_fn)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        print(f"{name:22} {rel_err(out, call(reference_fn)):11.2e} {elapsed * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
