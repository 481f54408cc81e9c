"""Every kernel compiles for sm_90 (Hopper) with its default config, also on a machine without a GPU."""
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent

SMALL_DOT = '''
import triton
import triton.language as tl


@triton.jit
def _small_dot_kernel(a_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    a = tl.load(a_ptr + offsets)
    tl.store(out_ptr + offsets, tl.dot(a, a))
'''

CHECK_SMALL_DOT = '''
import sys
sys.path[:0] = [{tmp!r}, {here!r}]
import sm90_compile
import torch
import small_dot

launches = sm90_compile.record_launches([lambda: small_dot._small_dot_kernel[(1,)](torch.zeros(64), torch.zeros(64), N=8)])
assert len(launches) == 1
sm90_compile.compile_sm90(*launches[0])
'''


def run(args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=dict(os.environ), timeout=600)


def test_every_kernel_compiles_for_sm90():
    result = run([str(HERE / "sm90_compile.py")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 failed" in result.stdout


def test_compile_check_fails_on_a_kernel_only_the_interpreter_accepts(tmp_path):
    # A 8x8 tl.dot is fine for the interpreter (NumPy) but below the GPU's 16x16 minimum.
    (tmp_path / "small_dot.py").write_text(SMALL_DOT)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.path.insert(0, str(tmp_path))
        try:
            import small_dot
        finally:
            sys.path.remove(str(tmp_path))
        a, out = torch.randn(64), torch.full((64,), float("nan"))
        small_dot._small_dot_kernel[(1,)](a, out, N=8)
        torch.testing.assert_close(out.view(8, 8), a.view(8, 8) @ a.view(8, 8))
    result = run(["-c", CHECK_SMALL_DOT.format(tmp=str(tmp_path), here=str(HERE))])
    assert result.returncode != 0
    assert "K >= 16" in result.stderr, result.stderr[-2000:]


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
