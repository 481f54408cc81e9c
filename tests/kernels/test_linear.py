"""kernels.linear (split-K Triton GEMM for a decode step's few rows) against the float64 reference."""
import pytest
import torch
import torch.nn.functional as F
from kernel_utils import DEVICE, assert_close, poisoned, randn

from tritonllm.kernels import linear, reference
from tritonllm.kernels.linear import LINEAR_TUNABLE, MAX_ROWS, TORCH, linear_bucket, linear_counts

HALF = [torch.float16, torch.bfloat16]


def config(block_n, block_k, splits, stages=3):
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": splits, "num_warps": 4, "num_stages": stages}


def check(rows, n, k, dtype, cfg, counts=None, scale=1.0):
    x, w = randn(rows, k, dtype=dtype), randn(n, k, dtype=dtype, scale=scale)
    out = poisoned(rows, n, dtype=dtype)
    y = linear(x, w, counts=counts, out=out, config=cfg)
    assert y.data_ptr() == out.data_ptr()
    assert_close(y, reference.linear(x.double(), w.double()).to(dtype), dtype)
    return x, w, y


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows, n, k", [(1, 1, 16), (3, 50, 100), (MAX_ROWS, 64, 1024), (7, 33, 300), (2, 200, 2048)])
def test_linear_triton(rows, n, k, dtype):
    check(rows, n, k, dtype, config(64, 128, 2, 4))


def test_linear_untuned_bucket_is_cublas():
    # No tuned entry (a shape no table holds): torch's own result, bit for bit.
    x, w = randn(3, 40, dtype=torch.bfloat16), randn(1000, 40, dtype=torch.bfloat16)
    assert LINEAR_TUNABLE.default(*linear_bucket(x.dtype, 1000, 40, 3)) == TORCH
    assert torch.equal(linear(x, w), F.linear(x, w))


# Every tile and split count, with N, M and K that the tiles do not divide; with splits the last
# split's K run ends early (K 300) or holds no step at all (K 130 in 8 splits of 64).
@pytest.mark.parametrize("cfg", [config(16, 64, 4), config(32, 64, 1), config(32, 64, 2), config(64, 128, 4, 4),
                                 config(32, 64, 8), config(128, 64, 2), config(32, 256, 1)],
                         ids=lambda c: f"n{c['BLOCK_N']}-k{c['BLOCK_K']}-s{c['SPLIT_K']}")
@pytest.mark.parametrize("rows, n, k", [(5, 70, 300), (16, 129, 130), (1, 32, 512)])
def test_linear_configs(rows, n, k, cfg):
    check(rows, n, k, torch.bfloat16, cfg)


def test_linear_counts_are_left_zero_and_reused():
    # One counter buffer for several calls, as a layer keeps it: the last program of each tile resets
    # its counter, so every later call starts from zero (a stale count would skip the tile's sum).
    counts = linear_counts(96, DEVICE)
    for rows, block_n in ((1, 32), (4, 16), (16, 64)):  # the smallest tile uses every counter
        check(rows, 96, 512, torch.bfloat16, config(block_n, 64, 4), counts=counts)
        assert not counts.any()


def test_linear_splits_add_in_a_fixed_order():
    # Large terms that cancel: a sum in another order would round differently.
    x, w, y = check(4, 40, 512, torch.float16, config(32, 64, 8), scale=30.0)
    for _ in range(3):
        assert torch.equal(linear(x, w, config=config(32, 64, 8)), y)


def test_linear_strided_rows():
    x, w = randn(6, 200, dtype=torch.bfloat16)[:, :130], randn(20, 260, dtype=torch.bfloat16)[:, 100:230]
    assert_close(linear(x, w, config=config(32, 64, 2)), reference.linear(x.double(), w.double()).to(x.dtype), x.dtype)


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
    with pytest.raises(ValueError, match="dtype"):  # two arguments that disagree, as kernels/README.md says
        linear(x, randn(8, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        linear(randn(32, 2, dtype=torch.bfloat16).t(), randn(8, 32, dtype=torch.bfloat16), config=config(32, 64, 1))
    with pytest.raises(ValueError, match=r"counts must be int32 with at least 5 entries"):
        linear(x, randn(70, 32, dtype=torch.bfloat16), counts=torch.zeros(2, dtype=torch.int32, device=DEVICE),
               config=config(32, 64, 1))
    with pytest.raises(ValueError, match=r"out must be \[2, 8\]"):
        linear(x, randn(8, 32, dtype=torch.bfloat16), out=poisoned(2, 9, dtype=torch.bfloat16))


@pytest.mark.parametrize("n, k, rows", [(4096, 1024, 1), (1024, 3072, 16), (128, 2048, 4), (6144, 1024, 8),
                                        (5120, 2048, 2), (96, 128, 1)])
def test_linear_space(n, k, rows):
    """cuBLAS (the default) and Triton tiles that give each split at least one BLOCK_K step of the
    bucket's smallest K; a K of at least 256 offers a split."""
    bucket = linear_bucket(torch.bfloat16, n, k, rows)
    space = LINEAR_TUNABLE.space(*bucket)
    assert LINEAR_TUNABLE.default(*bucket) == TORCH and space[0] == TORCH
    tiles = space[1:]
    assert tiles and all(max(1, bucket[2] // 2) // cfg["SPLIT_K"] >= cfg["BLOCK_K"] for cfg in tiles)
    assert any(cfg["SPLIT_K"] > 1 for cfg in tiles) == (k >= 256)
