"""Benchmark cases of bench/kernels.py: shapes, inputs, bytes or FLOPs, and the anchors of each kernel."""
from dataclasses import dataclass, field
from typing import Callable

import torch

from tritonllm import kernels
from tritonllm.kernels import reference


@dataclass
class Case:
    kernel: str  # the Tunable's name
    label: str
    make: Callable[[], tuple]  # fresh random inputs
    triton: Callable  # the Triton wrapper, called on make()'s inputs
    anchors: dict[str, Callable] = field(default_factory=dict)  # timed on the same inputs
    bytes: int = 0  # fewest bytes the call must move (memory-bound kernels)
    flops: int = 0  # or its FLOPs (compute-bound kernels)


def reference_anchors(fn) -> dict[str, Callable]:
    """The PyTorch reference eager and under torch.compile."""
    return {"torch": fn, "torch.compile": torch.compile(fn, dynamic=False)}


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def cos_sin_cache(max_pos, head_dim, theta=1e6):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cuda") / head_dim)
    freqs = torch.arange(max_pos, dtype=torch.float32, device="cuda")[:, None] * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def norm_cases(quick):
    shapes = [(16384, 4096)] if quick else [(16384, 4096), (16384, 1024), (1024, 4096), (16384 * 16, 128)]
    cases = []
    for tokens, hidden in shapes:
        size = tokens * hidden * 2
        cases.append(Case(
            "fused_add_rms_norm", f"{tokens}x{hidden} bf16",
            lambda t=tokens, h=hidden: (randn(t, h), randn(t, h), randn(h), 1e-6),
            kernels.fused_add_rms_norm, reference_anchors(reference.fused_add_rms_norm), bytes=4 * size,
        ))
        cases.append(Case(
            "rms_norm", f"{tokens}x{hidden} bf16",
            lambda t=tokens, h=hidden: (randn(t, h), randn(h), 1e-6),
            kernels.rms_norm, reference_anchors(reference.rms_norm), bytes=2 * size,
        ))
    return cases


def silu_cases(quick):
    shapes = [(16384, 3072)] if quick else [(16384, 3072), (8192, 12288), (256, 3072)]
    return [
        Case("silu_and_mul", f"{tokens}x2*{inter} bf16", lambda t=tokens, i=inter: (randn(t, 2 * i),),
             kernels.silu_and_mul, reference_anchors(reference.silu_and_mul), bytes=3 * tokens * inter * 2)
        for tokens, inter in shapes
    ]


def rotary_cases(quick):
    shapes = [(16384, 16, 8)] if quick else [(16384, 16, 8), (8192, 32, 8), (256, 16, 8)]
    cases = []
    for tokens, q_heads, k_heads in shapes:
        def make(t=tokens, hq=q_heads, hk=k_heads):
            positions = torch.randint(0, 40960, (t,), device="cuda")
            return positions, randn(t, hq, 128), randn(t, hk, 128), cos_sin_cache(40960, 128)

        moved = 2 * tokens * (q_heads + k_heads) * 128 * 2 + tokens * 128 * 4
        cases.append(Case("rotary_embedding", f"{tokens} tok {q_heads}/{k_heads} heads D128 bf16", make,
                          kernels.rotary_embedding, reference_anchors(reference.rotary_embedding), bytes=moved))
    return cases


def kv_cache_cases(quick):
    shapes = [(16384, 16)] if quick else [(16384, 16), (16384, 256), (256, 16)]
    cases = []
    for tokens, block_size in shapes:
        def make(t=tokens, bs=block_size):
            num_blocks = 2 * t // bs + 1
            slots = torch.randperm(num_blocks * bs, device="cuda")[:t]
            cache = lambda: randn(num_blocks, bs, 8, 128)  # noqa: E731
            return randn(t, 8, 128), randn(t, 8, 128), cache(), cache(), slots

        cases.append(Case("store_kv_cache", f"{tokens} tok 8x128 block {block_size} bf16", make,
                          kernels.store_kv_cache, {"torch": reference.store_kv_cache},
                          bytes=4 * tokens * 8 * 128 * 2 + tokens * 8))
    return cases


def all_cases(quick: bool) -> list[Case]:
    return norm_cases(quick) + silu_cases(quick) + rotary_cases(quick) + kv_cache_cases(quick)
