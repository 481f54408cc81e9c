"""The Gluon e4m3 decode prototype against the float64 reference and the shipped Triton kernel.

The NaN-poisoned caches of test_decode_attention.py in the engine's fp8 layout (key-major V,
head-major scales): a key or a V column read past a sequence brings NaN. Gluon has no interpreter,
so this runs on a CUDA GPU only; its sm_90 compile is checked here on any machine.
"""
import os
import subprocess
import sys

import pytest
import torch
from kernel_utils import ATTN, DEVICE, assert_close, exact, paged_caches, poisoned, randn, rel_err

from tritonllm.kernels import decode_attention, reference
from tritonllm.kernels.decode_attention_gluon import decode_attention_gluon

needs_gpu = pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 0),
                               reason="Gluon kernels run on CUDA GPUs (sm_80+) only")

# (Hq, Hkv, block_size, seq_lens): GQA 2 (the engine's), 8, 1 and 16; lengths around tiles and blocks.
CASES = [
    (16, 8, 16, [1, 15, 16, 17, 33, 300]),
    (32, 4, 32, [31, 33, 100, 64]),
    (8, 8, 16, [129, 3, 1000]),
    (64, 4, 256, [255, 257, 1]),
]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, block_size, seq_lens", CASES)
def test_gluon_decode_matches_reference(num_q_heads, num_kv_heads, block_size, seq_lens, num_splits, block_n, dtype):
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, num_kv_heads, 128, block_size, dtype, fp8=True,
                                                    v_layout="key_major", scale_layout="head_major")
    q = randn(len(seq_lens), num_q_heads, 128, dtype=dtype, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    config = {"BLOCK_N": block_n, "NUM_SPLITS": num_splits, "SPLIT_MIN": 16, "num_warps": 1, "num_stages": 2}
    out = decode_attention_gluon(q, k_cache, v_cache, lens, tables, config=config, **scales)
    ref = reference.decode_attention(q.double(), exact(k_cache), exact(v_cache), lens, tables, None, **scales)
    assert_close(out, ref, dtype, ATTN)
    shipped = decode_attention(q, k_cache, v_cache, lens, tables, config=config, out=poisoned(*q.shape, dtype=dtype),
                               **scales)
    assert rel_err(out, shipped) <= 1e-2


def test_gluon_decode_rejects_other_caches():
    k_cache, v_cache, tables, scales = paged_caches([5], 2, 128, 16, torch.bfloat16, fp8=True)  # V not key-major
    q = randn(1, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="key-major"):
        decode_attention_gluon(q, k_cache, v_cache, torch.tensor([5], dtype=torch.int32, device=DEVICE), tables,
                               config={"BLOCK_N": 32, "NUM_SPLITS": 1, "SPLIT_MIN": 128}, **scales)


SM90_COMPILE = """
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, {tests!r})
import torch
from sm90_compile import compile_sm90, record_launches
from tritonllm.kernels.fp8 import empty_kv_scales
from tritonllm.kernels.kv_cache import empty_kv_cache
from tritonllm.kernels.decode_attention_gluon import decode_attention_gluon
k = torch.zeros(64, 16, 8, 128, dtype=torch.float8_e4m3fn)
v = empty_kv_cache(64, 16, 8, 128, torch.float8_e4m3fn, key_major=True).zero_()
scales = {{n: empty_kv_scales(64, 16, 8, head_major=True).zero_() for n in ("k_scale", "v_scale")}}
q = torch.zeros(4, 16, 128, dtype=torch.bfloat16)
for block_n in (16, 32):
    config = {{"BLOCK_N": block_n, "NUM_SPLITS": 2, "SPLIT_MIN": 128}}
    launch = record_launches([lambda: decode_attention_gluon(q, k, v, torch.zeros(4, dtype=torch.int32),
                                                             torch.zeros(4, 16, dtype=torch.int32), config=config,
                                                             **scales)])[0]
    ptx = compile_sm90(*launch).asm["ptx"]
    # The tiles come from global memory straight into the MMA operands: no cp.async staging.
    assert "mma.sync" in ptx and "cp.async" not in ptx
    print("compiled", block_n)
"""


def test_gluon_decode_compiles_for_sm90():
    # A fresh process: record_launches swaps JITFunction.run, which must not leak into other tests.
    tests = os.path.dirname(__file__)
    result = subprocess.run([sys.executable, "-c", SM90_COMPILE.format(tests=tests)], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["compiled", "16", "compiled", "32"]
