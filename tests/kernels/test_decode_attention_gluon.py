"""decode_attention's Gluon e4m3 path (config GLUON = 1) against the float64 reference.

The NaN-poisoned caches of test_decode_attention.py in the engine's fp8 layout (key-major V,
head-major scales): a key or a V column read past a sequence brings NaN. Gluon has no interpreter,
so the kernel itself runs on a CUDA GPU only; the fallback to the Triton kernel where it does not
apply, and the sm_90 compile, are checked on any machine.
"""
import importlib
import os
import subprocess
import sys

import pytest
import torch
from kernel_utils import ATTN, DEVICE, assert_close, exact, paged_caches, poisoned, randn, rel_err

from tritonllm.kernels import decode_attention, reference

decode_module = importlib.import_module("tritonllm.kernels.decode_attention")
needs_gpu = pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 0),
                               reason="Gluon kernels run on CUDA GPUs (sm_80+) only")

# (Hq, Hkv, block_size, seq_lens): GQA 2 (the engine's), 8, 1 and 16; lengths around tiles and blocks.
CASES = [
    (16, 8, 16, [1, 15, 16, 17, 33, 300]),
    (32, 4, 32, [31, 33, 100, 64]),
    (8, 8, 16, [129, 3, 1000]),
    (64, 4, 256, [255, 257, 1]),
]


def gluon_launches(monkeypatch):
    """A list that gets one entry per launch of the Gluon kernel."""
    launches, original = [], decode_module.decode_attention_gluon

    def spy(*args):
        launches.append(args[0])
        return original(*args)

    monkeypatch.setattr(decode_module, "decode_attention_gluon", spy)
    return launches


def run(q, k_cache, v_cache, lens, tables, scales, config):
    out = decode_attention(q, k_cache, v_cache, lens, tables, config=config, out=poisoned(*q.shape, dtype=q.dtype),
                           **scales)
    return out, reference.decode_attention(q.double(), exact(k_cache), exact(v_cache), lens, tables, None, **scales)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, block_size, seq_lens", CASES)
def test_gluon_decode_matches_reference(monkeypatch, num_q_heads, num_kv_heads, block_size, seq_lens, num_splits,
                                        block_n, dtype):
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, num_kv_heads, 128, block_size, dtype, fp8=True,
                                                    v_layout="key_major", scale_layout="head_major")
    q = randn(len(seq_lens), num_q_heads, 128, dtype=dtype, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    config = {"BLOCK_N": block_n, "NUM_SPLITS": num_splits, "SPLIT_MIN": 16, "num_warps": 1, "num_stages": 2}
    launches = gluon_launches(monkeypatch)
    out, ref = run(q, k_cache, v_cache, lens, tables, scales, config | {"GLUON": 1})
    assert launches == [(num_splits, num_kv_heads, len(seq_lens))]
    assert_close(out, ref, dtype, ATTN)
    triton_out, _ = run(q, k_cache, v_cache, lens, tables, scales, config)
    assert len(launches) == 1 and rel_err(out, triton_out) <= 1e-2


# Inputs the Gluon kernel does not take run the Triton kernel under a GLUON config: a V not
# key-major, and anything on the CPU (the interpreter).
@pytest.mark.parametrize("v_layout", ["contiguous", "key_major"])
def test_gluon_configs_fall_back_where_unsupported(monkeypatch, v_layout):
    if DEVICE == "cuda" and v_layout == "key_major":
        pytest.skip("a key-major V on a GPU takes the Gluon kernel (test above)")
    seq_lens = [1, 17, 300]
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, 2, 64, 16, torch.bfloat16, fp8=True, v_layout=v_layout)
    q = randn(len(seq_lens), 4, 64, dtype=torch.bfloat16, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    launches = gluon_launches(monkeypatch)
    config = {"BLOCK_N": 32, "NUM_SPLITS": 2, "SPLIT_MIN": 16, "num_warps": 1, "num_stages": 2, "GLUON": 1}
    out, ref = run(q, k_cache, v_cache, lens, tables, scales, config)
    assert launches == []
    assert_close(out, ref, torch.bfloat16, ATTN)


SM90_COMPILE = """
import importlib, os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, {tests!r})
import torch
from sm90_compile import compile_sm90, record_launches
from tritonllm.kernels import decode_attention
from tritonllm.kernels.fp8 import empty_kv_scales
from tritonllm.kernels.kv_cache import empty_kv_cache
importlib.import_module("tritonllm.kernels.decode_attention").gluon_supports = lambda *args: True  # CPU tensors
k = torch.zeros(64, 16, 8, 128, dtype=torch.float8_e4m3fn)
v = empty_kv_cache(64, 16, 8, 128, torch.float8_e4m3fn, key_major=True).zero_()
scales = {{n: empty_kv_scales(64, 16, 8, head_major=True).zero_() for n in ("k_scale", "v_scale")}}
q = torch.zeros(4, 16, 128, dtype=torch.bfloat16)
for block_n in (16, 32):
    config = {{"BLOCK_N": block_n, "NUM_SPLITS": 2, "SPLIT_MIN": 128, "num_warps": 1, "num_stages": 3, "GLUON": 1}}
    launch = record_launches([lambda: decode_attention(q, k, v, torch.zeros(4, dtype=torch.int32),
                                                       torch.zeros(4, 16, dtype=torch.int32), config=config,
                                                       **scales)])[0]
    assert launch[0].__name__ == "_decode_attention_gluon_kernel", launch[0].__name__
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
