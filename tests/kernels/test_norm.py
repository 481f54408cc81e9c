import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, poisoned, randn

from tritonllm.kernels import fused_add_rms_norm, reference, rms_norm
from tritonllm.kernels.tuning import INTERPRET

SHAPES = [(1, 7), (7, 100), (100, 128), (3, 1000), (5, 4096)]


def factor(dtype) -> float:
    """The interpreter truncates float32 -> bfloat16 (up to 2**-7 an element) and a norm rounds twice
    (the normalized value, then times the weight): a row of a few elements can pass 1e-2."""
    return 2.0 if INTERPRET and dtype == torch.bfloat16 else 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_rms_norm(rows, cols, dtype):
    x, weight = randn(rows, cols, dtype=dtype, scale=3.0), randn(cols, dtype=dtype)
    out = poisoned(rows, cols, dtype=dtype)
    y = rms_norm(x, weight, 1e-6, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_close(y, reference.rms_norm(x, weight, 1e-6), dtype, factor(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_view(dtype):
    # q heads of a packed qkv tensor: rows are strided, the norm runs over head_dim.
    qkv = randn(9, 6 * 64, dtype=dtype)
    q = qkv[:, : 4 * 64].view(9, 4, 64)
    weight = randn(64, dtype=dtype)
    assert_close(rms_norm(q, weight, 1e-6), reference.rms_norm(q, weight, 1e-6), dtype, factor(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_fused_add_rms_norm(rows, cols, dtype):
    x, residual = randn(rows, cols, dtype=dtype), randn(rows, cols, dtype=dtype, scale=4.0)
    weight = randn(cols, dtype=dtype)
    ref_y, ref_h = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    y, h = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert y.data_ptr() == x.data_ptr() and h.data_ptr() == residual.data_ptr()
    assert_close(h, ref_h, dtype)
    assert_close(y, ref_y, dtype, factor(dtype))


def test_fused_add_rms_norm_rounds_residual_first():
    # In float16 the sum 2048 + 1 is not representable: HF normalizes the rounded sum.
    x = torch.full((1, 16), 2048.0, dtype=torch.float16, device=DEVICE)
    residual = torch.ones(1, 16, dtype=torch.float16, device=DEVICE)
    weight = torch.ones(16, dtype=torch.float16, device=DEVICE)
    y, h = fused_add_rms_norm(x.clone(), residual.clone(), weight, 0.0)
    assert torch.equal(h, torch.full_like(h, 2048.0))
    assert torch.equal(y, torch.ones_like(y))


def test_rms_norm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(randn(2, 8), randn(7), 1e-6)
