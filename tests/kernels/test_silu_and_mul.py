import pytest
from kernel_utils import DTYPES, assert_close, poisoned, randn

from tritonllm.kernels import reference, silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 1), (7, 100), (3, 1000), (2, 3072), (100, 7)])
def test_silu_and_mul(rows, inter, dtype):
    x = randn(rows, 2 * inter, dtype=dtype, scale=4.0)
    out = poisoned(rows, inter, dtype=dtype)
    y = silu_and_mul(x, out=out)
    assert y is out
    assert_close(y, reference.silu_and_mul(x), dtype)


def test_silu_and_mul_strided_rows():
    x = randn(5, 300)[:, :200]
    assert_close(silu_and_mul(x), reference.silu_and_mul(x), x.dtype)
