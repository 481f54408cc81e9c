"""Every kernel compiles for sm_90 (Hopper) with its default config, also on a machine without a GPU."""
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent

LOOP_SUM = '''
import triton
import triton.language as tl


@triton.jit
def _loop_sum_kernel(a_ptr, out_ptr, n):
    total = 0
    for i in range(n):
        total += tl.load(a_ptr + i)
    tl.store(out_ptr, total)
'''

CHECK_LOOP_SUM = '''
import sys
sys.path[:0] = [{tmp!r}, {here!r}]
import sm90_compile
import torch
import loop_sum

launches = sm90_compile.record_launches([lambda: loop_sum._loop_sum_kernel[(1,)](torch.ones(8), torch.zeros(1), 8)])
assert len(launches) == 1
sm90_compile.compile_sm90(*launches[0])
'''


def run(args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=dict(os.environ), timeout=600)


def test_every_kernel_compiles_for_sm90():
    result = run([str(HERE / "sm90_compile.py")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 failed" in result.stdout
    # Triton 3.9 warns when FMA contraction is left to its default; tritonllm/__init__.py sets it.
    assert "FP fusion" not in result.stderr, result.stderr[-2000:]


def test_compile_check_fails_on_a_kernel_only_the_interpreter_accepts(tmp_path):
    # The interpreter runs the loop as Python, so `total` may turn from the int 0 into a float32
    # tensor; the compiler gives a loop-carried value one type and rejects this on every Triton.
    # (A shape rule is no such kernel: the 8x8 float32 tl.dot that 3.6 rejected, 3.8 compiles.)
    (tmp_path / "loop_sum.py").write_text(LOOP_SUM)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.path.insert(0, str(tmp_path))
        try:
            import loop_sum
        finally:
            sys.path.remove(str(tmp_path))
        a, out = torch.randn(8), torch.full((1,), float("nan"))
        loop_sum._loop_sum_kernel[(1,)](a, out, 8)
        torch.testing.assert_close(out[0], a.sum())
    result = run(["-c", CHECK_LOOP_SUM.format(tmp=str(tmp_path), here=str(HERE))])
    assert result.returncode != 0
    assert "Loop-carried variable total has initial type int32" in result.stderr, result.stderr[-2000:]


PREFILL_PTX = '''
import sys
sys.path.insert(0, {here!r})
import sm90_compile
import torch
from tritonllm.kernels import prefill_attention

def call():
    cache = torch.zeros(1024, 16, 8, 128, dtype=torch.bfloat16)
    prefill_attention(torch.zeros(8192, 16, 128, dtype=torch.bfloat16), cache, cache,
                      torch.arange(0, 8193, 1024, dtype=torch.int32), torch.full((8,), 1024, dtype=torch.int32),
                      torch.zeros(8, 64, dtype=torch.int32), max_q_len=1024)

(launch,) = sm90_compile.record_launches([call])
print("wgmma" in sm90_compile.compile_sm90(*launch).asm["ptx"])
'''


def test_prefill_attention_uses_wgmma_on_sm90():
    # Hopper tensor cores need a per-CTA M of 64/128 and 4/8 warps; the bf16 default config has them.
    result = run(["-c", PREFILL_PTX.format(here=str(HERE))])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "True", result.stdout


ATTENTION_SHARED_MEMORY = '''
import sys
sys.path.insert(0, {here!r})
import sm90_compile
import torch
from triton.backends.compiler import GPUTarget
from tritonllm.kernels import decode_attention, prefill_attention
from tritonllm.kernels.fp8 import empty_kv_scales
from tritonllm.kernels.kv_cache import empty_kv_cache

cpu = torch.device("cpu")
for dtype, cc in ((torch.float32, 86), (torch.bfloat16, 86), (torch.float8_e4m3fn, 89)):
    for head_dim in (128, 256):
        fp8 = dtype == torch.float8_e4m3fn
        k = torch.zeros(64, 16, 8, head_dim, dtype=dtype)
        v = empty_kv_cache(64, 16, 8, head_dim, dtype, cpu, key_major=True) if fp8 else k
        scale = empty_kv_scales(64, 16, 8, cpu, head_major=True)
        scales = dict(k_scale=scale, v_scale=scale) if fp8 else {{}}
        q_dtype = torch.bfloat16 if fp8 else dtype
        calls = [lambda: prefill_attention(torch.zeros(1024, 16, head_dim, dtype=q_dtype), k, v,
                                           torch.tensor([0, 1024], dtype=torch.int32), torch.tensor([1024], dtype=torch.int32),
                                           torch.zeros(1, 64, dtype=torch.int32), max_q_len=1024, path="portable", **scales),
                 lambda: decode_attention(torch.zeros(64, 16, head_dim, dtype=q_dtype), k, v,
                                          torch.full((64,), 900, dtype=torch.int32), torch.zeros(64, 64, dtype=torch.int32),
                                          max_seq_len=1024, **scales)]
        for kernel, bound, options in sm90_compile.record_launches(calls):
            shared = sm90_compile.compile_sm90(kernel, bound, options, target=GPUTarget("cuda", cc, 32)).metadata.shared
            print(kernel.__name__, dtype, head_dim, shared)
'''


def test_attention_defaults_fit_the_shared_memory_of_sm86_and_sm89():
    # The GPUs without a tuned-config file run the default configs; sm_86 and sm_89 (the first GPU with
    # e4m3) have 99 KB of shared memory a block. The attention defaults must fit it at every head size
    # the models use (a 64-key bf16 prefill tile at D 256 took 104 KB there, a 128-key e4m3 one 177 KB).
    result = run(["-c", ATTENTION_SHARED_MEMORY.format(here=str(HERE))])
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.strip().splitlines() if line.startswith("_")]
    assert {row[0] for row in rows} >= {"_prefill_attention_kernel", "_decode_attention_kernel"}, result.stdout
    assert len(rows) >= 12 and all(0 < int(row[-1]) <= 99 * 1024 for row in rows), result.stdout


MOE_PTX = '''
import sys
sys.path.insert(0, {here!r})
import sm90_compile
import torch
from tritonllm.kernels import fused_moe

def call():
    bf16 = dict(dtype=torch.bfloat16)
    fused_moe(torch.zeros(4096, 2048, **bf16), torch.zeros(128, 1536, 2048, **bf16), torch.zeros(128, 2048, 768, **bf16),
              torch.zeros(4096, 8), torch.zeros(4096, 8, dtype=torch.int32))

for kernel, bound, options in sm90_compile.record_launches([call]):
    if kernel.__name__ in ("_moe_gate_up_kernel", "_moe_down_kernel"):
        print(kernel.__name__, "wgmma" in sm90_compile.compile_sm90(kernel, bound, options).asm["ptx"])
'''


def test_fused_moe_gemms_use_wgmma_on_sm90():
    # A prefill-sized bf16 call (the Qwen3-30B-A3B layer, 4096 tokens): both grouped GEMMs' default
    # tiles (BLOCK_M 64, 4 warps) run on Hopper's wgmma.
    result = run(["-c", MOE_PTX.format(here=str(HERE))])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["_moe_gate_up_kernel", "True", "_moe_down_kernel", "True"], result.stdout
