"""Correctness of the stream-K prototype against the installed decode_attention (CPU interpreter or GPU)."""
import os, sys
import torch

from tritonllm.kernels.decode_attention_lean import lean_decode_attention
from tritonllm import kernels
from tritonllm.kernels import reference
from tritonllm.kernels.fp8 import head_major_copy
from tritonllm.kernels.kv_cache import key_major_copy

dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
worst = 0.0
for fp8 in (False, True):
    for lens, block_size, cfg in [
        ([37, 0, 5, 130, 64], 16, {"BLOCK_N": 16, "num_warps": 1, "PROGRAMS_PER_SM": 3, "MIN_TILES": 1}),
        ([300], 16, {"BLOCK_N": 16, "num_warps": 1, "PROGRAMS_PER_SM": 5, "MIN_TILES": 1}),
        ([200, 199, 17, 1, 0, 0, 90], 32, {"BLOCK_N": 32, "num_warps": 1, "PROGRAMS_PER_SM": 2, "MIN_TILES": 2}),
        ([65, 64, 63], 16, {"BLOCK_N": 32, "num_warps": 1, "PROGRAMS_PER_SM": 7, "MIN_TILES": 1}),
        ([3], 16, {"BLOCK_N": 16, "num_warps": 1, "PROGRAMS_PER_SM": 4, "MIN_TILES": 1}),
    ] + [(l, b, c | {"FLAT": 1}) for l, b, c in [
        ([37, 0, 5, 130, 64], 16, {"BLOCK_N": 16, "num_warps": 1, "PROGRAMS_PER_SM": 3, "MIN_TILES": 1}),
        ([300], 16, {"BLOCK_N": 16, "num_warps": 1, "PROGRAMS_PER_SM": 5, "MIN_TILES": 1}),
        ([200, 199, 17, 1, 0, 0, 90], 32, {"BLOCK_N": 32, "num_warps": 1, "PROGRAMS_PER_SM": 2, "MIN_TILES": 2}),
        ([65, 64, 63], 16, {"BLOCK_N": 32, "num_warps": 1, "PROGRAMS_PER_SM": 7, "MIN_TILES": 1}),
        ([3], 16, {"BLOCK_N": 16, "num_warps": 1, "PROGRAMS_PER_SM": 4, "MIN_TILES": 1}),
        ([700, 3, 2, 1], 16, {"BLOCK_N": 16, "num_warps": 1, "PROGRAMS_PER_SM": 40, "MIN_TILES": 1}),
    ]]:
        hkv, g, d = 2, 3, 64
        B = len(lens)
        per_seq = -(-max(lens) // block_size) + 1
        nblocks = B * per_seq + 3
        k = torch.randn(nblocks, block_size, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(nblocks, block_size, hkv, d, device=dev, dtype=torch.bfloat16)
        tables = torch.randperm(nblocks, device=dev)[: B * per_seq].view(B, per_seq).to(torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        q = torch.randn(B, hkv * g, d, device=dev, dtype=torch.bfloat16)
        extra = {}
        if fp8:
            (k, ks), (v, vs) = reference.quantize_e4m3(k), reference.quantize_e4m3(v)
            v = key_major_copy(v)
            extra = {"k_scale": head_major_copy(ks), "v_scale": head_major_copy(vs)}
        want = kernels.decode_attention(q, k, v, seq_lens, tables, **extra).float()
        out = torch.full_like(q, float("nan"))
        got = lean_decode_attention(q, k, v, seq_lens, tables, config=cfg, out=out, **extra).float()
        err = ((got - want).norm() / want.norm()).item()
        worst = max(worst, err)
        print(f"fp8={fp8} lens={lens} block={block_size} {cfg}: rel err {err:.2e} nan={got.isnan().any().item()}")
        assert not got.isnan().any() and err < 2e-2
print("worst", worst)
