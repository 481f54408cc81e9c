"""Programmatic dependent launch (kernels/pdl.py): kernels launched back to back, each reading what
the previous one wrote, give the reference's result on the GPU, eagerly and in a CUDA graph; the
kernels compile to griddepcontrol for sm_90 where PDL is on and to nothing of it where it is off."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_utils import DEVICE, HOPPER, randn, rel_err

from tritonllm.kernels import fused_add_rms_norm, reference
from tritonllm.kernels.pdl import pdl_launch

HERE = Path(__file__).parent


def test_pdl_only_on_hopper_gpus():
    x = torch.zeros(1, device=DEVICE)
    assert pdl_launch(x) == ({"PDL": True, "launch_pdl": True} if HOPPER else {"PDL": False})
    assert pdl_launch(torch.zeros(1)) == {"PDL": False}


@pytest.mark.parametrize("graph", [False, True])
def test_chain_of_dependent_launches(graph):
    # 12 norms in a row, each reading the x and residual the previous one wrote: a kernel that
    # started reading before its predecessor finished would see the old rows.
    rows, cols, steps = (4099, 1024, 12) if DEVICE == "cuda" else (37, 96, 3)
    x0, r0, w = randn(rows, cols), randn(rows, cols), randn(cols)
    x, r = x0.clone(), r0.clone()

    def chain():
        for _ in range(steps):
            fused_add_rms_norm(x, r, w, 1e-6)

    if graph and DEVICE == "cuda":
        chain()  # compiles, tunes nothing (TRITONLLM_AUTOTUNE unset)
        x.copy_(x0), r.copy_(r0)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        x.copy_(x0), r.copy_(r0)
        g.replay()
    elif graph:
        pytest.skip("CUDA graphs need a GPU")
    else:
        chain()
    ref_x, ref_r = x0.double(), r0.double()
    for _ in range(steps):
        ref_x, ref_r = reference.fused_add_rms_norm(ref_x, ref_r, w.double(), 1e-6)
    assert rel_err(x, ref_x) < 1e-4 and rel_err(r, ref_r) < 1e-4


PTX = '''
import sys
sys.path.insert(0, {here!r})
import sm90_compile
import torch
from tritonllm.kernels import decode_attention, fused_add_rms_norm, qk_norm_rotary_store, silu_and_mul

def z(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype)

calls = [
    lambda: fused_add_rms_norm(z(256, 1024), z(256, 1024), z(1024), 1e-6),
    lambda: silu_and_mul(z(256, 2 * 3072)),
    lambda: qk_norm_rotary_store(z(256, dtype=torch.int64), z(256, 32 * 128), z(128), z(128), 1e-6,
                                 z(4096, 128, dtype=torch.float32), z(64, 16, 8, 128), z(64, 16, 8, 128),
                                 z(256, dtype=torch.int32), 16, 8),
    lambda: decode_attention(z(8, 16, 128), z(64, 16, 8, 128), z(64, 16, 8, 128), z(8, dtype=torch.int32),
                             z(8, 64, dtype=torch.int32), config={{"BLOCK_N": 32, "NUM_SPLITS": 4, "SPLIT_MIN": 128,
                                                                  "num_warps": 4, "num_stages": 2}}),
]
for kernel, bound, options in sm90_compile.record_launches(calls):
    for pdl in (False, True):
        ptx = sm90_compile.compile_sm90(kernel, dict(bound, PDL=pdl), options).asm["ptx"]
        print(kernel.__name__, pdl, "griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx)
'''


def test_kernels_compile_with_and_without_pdl_for_sm90():
    result = subprocess.run([sys.executable, "-c", PTX.format(here=str(HERE))], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line.split() for line in result.stdout.strip().splitlines()]
    names = {"_rms_norm_kernel", "_silu_and_mul_kernel", "_qk_norm_rotary_store_kernel", "_decode_attention_kernel",
             "_merge_splits_kernel"}
    assert {line[0] for line in lines} == names, result.stdout
    for name, pdl, waits, triggers in lines:
        assert waits == triggers == pdl, (name, pdl, waits, triggers)
