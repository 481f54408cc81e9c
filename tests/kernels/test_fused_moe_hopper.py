"""The Hopper (warp-specialized Gluon) path of fused_moe against reference.fused_moe.

Prefill-sized calls (64 or more pairs an expert) take it on an sm_90 GPU; elsewhere only the path
choice is checked (its sm_90 compile is in test_compile.py). Shapes cover N and H that the tiles do
not divide (columns past N, K past H) and every config of its tuning space.
"""
import importlib

import pytest
import torch
from kernel_utils import HOPPER
from test_fused_moe import check, moe_inputs

from tritonllm.kernels import moe_align
from tritonllm.kernels.fused_moe_hopper import HOPPER_TUNABLE, moe_gemms_hopper, supports

fused_moe_module = importlib.import_module("tritonllm.kernels.fused_moe")
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernels run on sm_90 GPUs only")


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k, inter, hidden", [
    (300, 8, 2, 96, 128), (257, 4, 1, 256, 192), (600, 16, 8, 64, 96), (1000, 60, 8, 136, 64)])
def test_hopper_path_matches_reference(monkeypatch, tokens, experts, top_k, inter, hidden, dtype):
    taken = []
    original = fused_moe_module.fused_moe_hopper.moe_gemms_hopper
    monkeypatch.setattr(fused_moe_module.fused_moe_hopper, "moe_gemms_hopper",
                        lambda *a: taken.append(True) or original(*a))
    check(*moe_inputs(tokens, experts, top_k, inter, hidden, dtype))
    assert taken, "the Hopper path was not taken"


@needs_hopper
@pytest.mark.parametrize("config", HOPPER_TUNABLE.space("bfloat16", 8, 96, 128, 300), ids=str)
def test_hopper_every_config(config):
    x, w13, w2, weights, ids = moe_inputs(300, 8, 8, 96, 128, torch.bfloat16)
    sorted_ids, block_expert, num_padded = moe_align(ids, 8, config["BLOCK_M"])
    act = torch.empty(sorted_ids.shape[0], 96, dtype=x.dtype, device=x.device)
    rows = torch.full((ids.numel(), 128), float("nan"), dtype=x.dtype, device=x.device)
    moe_gemms_hopper(x, w13, w2, weights, sorted_ids, block_expert, num_padded, act, rows, 8, config)
    y = rows.view(300, 8, 128).float().sum(1).to(x.dtype)
    ref = check(x, w13, w2, weights, ids)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)


def test_decode_sized_and_cpu_calls_keep_the_portable_kernels():
    x, w13, w2, _, _ = moe_inputs(3, 8, 2, 96, 128, torch.bfloat16)
    assert not supports(x, w13, w2, 64)  # CPU tensors (the interpreter)
    if HOPPER:
        gpu = [t.cuda() for t in (x, w13, w2)]
        assert not supports(*gpu, 63) and supports(*gpu, 64)
