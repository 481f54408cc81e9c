import pytest
import torch
import torch.nn.functional as F
from kernel_utils import assert_close, poisoned, randn

from tritonllm.kernels import linear, reference
from tritonllm.kernels.linear import LINEAR_TUNABLE, MAX_ROWS, linear_bucket

HALF = [torch.float16, torch.bfloat16]


def config(block_m, block_n, block_k, splits):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": splits, "num_warps": 4,
            "num_stages": 2}


def check(rows, n, k, dtype, cfg=None, scale=1.0):
    x, w = randn(rows, k, dtype=dtype), randn(n, k, dtype=dtype, scale=scale)
    out = poisoned(rows, n, dtype=dtype)
    y = linear(x, w, out=out, config=cfg)
    assert y.data_ptr() == out.data_ptr()
    assert_close(y, reference.linear(x.double(), w.double()).to(dtype), dtype)
    return x, w, y


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows, n, k", [(1, 1, 16), (3, 50, 100), (16, 64, 128), (17, 33, 300), (100, 96, 64),
                                        (MAX_ROWS, 48, 80)])
def test_linear_default_config(rows, n, k, dtype):
    check(rows, n, k, dtype)


# Every tile size and split count, with N, M and K that the tiles do not divide; with splits, the
# last split's K run ends early (K 300) or holds no step at all (K 130, 8 splits of 64).
@pytest.mark.parametrize("cfg", [config(16, 16, 64, 1), config(16, 32, 64, 2), config(32, 64, 128, 4),
                                 config(16, 16, 64, 8), config(64, 128, 64, 2), config(16, 32, 256, 1)],
                         ids=lambda c: f"m{c['BLOCK_M']}-n{c['BLOCK_N']}-k{c['BLOCK_K']}-s{c['SPLIT_K']}")
@pytest.mark.parametrize("rows, n, k", [(5, 70, 300), (40, 129, 130), (1, 16, 512)])
def test_linear_configs(rows, n, k, cfg):
    check(rows, n, k, torch.bfloat16, cfg)


def test_linear_splits_add_in_a_fixed_order():
    # Large terms that cancel: a sum in another order would round differently.
    x, w, y = check(4, 40, 512, torch.float16, config(16, 16, 64, 8), scale=30.0)
    for _ in range(3):
        assert torch.equal(linear(x, w, config=config(16, 16, 64, 8)), y)


def test_linear_strided_rows():
    x, w = randn(6, 200, dtype=torch.bfloat16)[:, :130], randn(20, 260, dtype=torch.bfloat16)[:, 100:230]
    assert_close(linear(x, w), reference.linear(x.double(), w.double()).to(x.dtype), x.dtype)


@pytest.mark.parametrize("rows, dtype, bias", [(3, torch.float32, False), (MAX_ROWS + 1, torch.bfloat16, False),
                                               (3, torch.bfloat16, True)])
def test_linear_torch_paths(rows, dtype, bias):
    x, w = randn(rows, 40, dtype=dtype), randn(24, 40, dtype=dtype)
    b = randn(24, dtype=dtype) if bias else None
    out = poisoned(rows, 24, dtype=dtype)
    assert torch.equal(linear(x, w, b, out=out), F.linear(x, w, b))
    assert torch.equal(out, F.linear(x, w, b))


def test_linear_no_rows():
    assert linear(randn(0, 32, dtype=torch.bfloat16), randn(8, 32, dtype=torch.bfloat16)).shape == (0, 8)


def test_linear_bad_inputs():
    x = randn(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        linear(x, randn(8, 31, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        linear(x, randn(8, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        linear(randn(32, 2, dtype=torch.bfloat16).t(), randn(8, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("n, k, rows", [(4096, 1024, 1), (1024, 3072, 16), (6144, 1024, 256), (1024, 2048, 64)])
def test_linear_space(n, k, rows):
    """Every config of a decode bucket launches a K run of at least one step per split, and the
    default is one of them."""
    bucket = linear_bucket(torch.bfloat16, n, k, rows)
    space = LINEAR_TUNABLE.space(*bucket)
    assert LINEAR_TUNABLE.default(*bucket) in space
    for cfg in space:
        assert k // cfg["SPLIT_K"] >= cfg["BLOCK_K"] and cfg["BLOCK_M"] <= max(16, rows)
