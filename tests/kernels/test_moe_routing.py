"""moe_route (softmax top-k of the router) and moe_align (pairs grouped by expert) against PyTorch
and a plain-Python construction."""
import pytest
import torch
from kernel_utils import DEVICE, DTYPES, randn

from tritonllm.kernels import moe_align, moe_route, reference
from tritonllm.kernels.moe_routing import SMALL_PAIRS, moe_align_size

ROUTES = [(1, 4, 1), (3, 8, 2), (17, 60, 8), (17, 8, 8), (5, 512, 8), (33, 128, 8), (2, 60, 60)]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, experts, top_k", ROUTES)
def test_moe_route(tokens, experts, top_k, dtype, renormalize):
    logits = randn(tokens, experts, dtype=dtype, scale=3.0)
    weights, ids = moe_route(logits, top_k, renormalize)
    ref_weights, ref_ids = reference.moe_route(logits.double(), top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(weights.double(), ref_weights, rtol=1e-5, atol=1e-7)


def test_moe_route_ties_take_the_lower_expert():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0], [5.0] * 6], device=DEVICE)
    weights, ids = moe_route(logits, 4, True)
    assert ids.tolist() == [[1, 3, 5, 2], [0, 1, 2, 3]]
    assert ids.tolist() == reference.moe_route(logits, 4, True)[1].tolist()
    torch.testing.assert_close(weights[1], torch.full((4,), 0.25, device=DEVICE))


@pytest.mark.parametrize("experts, renormalize", [(60, True), (6, False), (8, False)])
def test_moe_route_rows_without_a_softmax(experts, renormalize):
    # A NaN logit, a +inf one, or only -inf ones: torch's softmax is NaN throughout, so the weights
    # are NaN (never the kernel's -1 marker) and the ids those of a stable sort, 0, 1, ...
    logits = randn(5, experts)
    logits[1, 3] = float("nan")
    logits[2, 1] = float("inf")
    logits[3] = float("-inf")
    top_k = min(3, experts)
    weights, ids = moe_route(logits, top_k, renormalize)
    ref_weights, ref_ids = reference.moe_route(logits, top_k, renormalize)
    assert ids.tolist() == ref_ids.tolist() and ids[1:4].tolist() == [list(range(top_k))] * 3
    assert weights[1:4].isnan().all() and ref_weights[1:4].isnan().all()
    torch.testing.assert_close(weights[[0, 4]], ref_weights[[0, 4]])


def test_moe_route_strided_rows_and_empty():
    logits = randn(7, 96)[:, :64]
    weights, ids = moe_route(logits, 8, False)
    ref_weights, ref_ids = reference.moe_route(logits, 8, False)
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(weights, ref_weights)
    weights, ids = moe_route(randn(0, 64), 8, True)
    assert weights.shape == (0, 8) and ids.shape == (0, 8)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(randn(3, 4), 5, True)


def align_by_hand(topk_ids, num_experts, block_m, real_tokens=None):
    """moe_align's result built pair by pair in Python; only the pairs of the first real_tokens tokens
    grouped where given."""
    flat = topk_ids.flatten().tolist()
    pairs = len(flat)
    real = pairs if real_tokens is None else min(pairs, real_tokens * topk_ids.shape[1])
    groups = [[] for _ in range(num_experts)]
    for i, expert in enumerate(flat[:real]):
        groups[expert].append(i)
    sorted_ids, blocks = [], []
    for expert, group in enumerate(groups):
        padded = -(-len(group) // block_m) * block_m
        sorted_ids += group + [pairs] * (padded - len(group))
        blocks += [expert] * (padded // block_m)
    used = len(sorted_ids)
    size = moe_align_size(pairs, num_experts, block_m)
    assert used <= size
    return sorted_ids + [pairs] * (size - used), blocks + [-1] * (size // block_m - len(blocks)), used


def check_align(topk_ids, num_experts, block_m, real_tokens=None):
    real = None if real_tokens is None else torch.tensor([real_tokens], dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, num_experts, block_m, real_tokens=real)
    ref_sorted, ref_blocks, ref_used = align_by_hand(topk_ids, num_experts, block_m, real_tokens)
    assert sorted_ids.dtype == block_expert.dtype == num_padded.dtype == torch.int32
    assert num_padded.tolist() == [ref_used]
    assert block_expert.tolist() == ref_blocks
    assert sorted_ids.tolist() == ref_sorted


def random_ids(tokens, num_experts, top_k, dtype=torch.int32):
    """Each token's top_k distinct experts, as the router picks them."""
    return torch.rand(tokens, num_experts, device=DEVICE).topk(top_k, dim=1).indices.to(dtype).contiguous()


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens, experts, top_k", ROUTES)
def test_moe_align(tokens, experts, top_k, block_m):
    check_align(random_ids(tokens, experts, top_k), experts, block_m)


@pytest.mark.parametrize("tokens, experts, top_k, block_m", [
    (SMALL_PAIRS // 8, 128, 8, 16),  # one program at its limit, over several chunks
    (SMALL_PAIRS // 8 + 1, 128, 8, 64),  # just past one program: three launches, three chunks
    (700, 60, 4, 16),
    (1500, 512, 8, 128),
])
def test_moe_align_many_pairs(tokens, experts, top_k, block_m):
    check_align(random_ids(tokens, experts, top_k), experts, block_m)


@pytest.mark.parametrize("pairs", [1000, 4000])
def test_moe_align_skewed(pairs):
    # Most pairs on one expert, a few on the last: groups spanning many chunks and blocks.
    ids = torch.full((pairs, 1), 3, dtype=torch.int64, device=DEVICE)
    ids[::97] = 59
    check_align(ids, 60, 16)


def test_moe_align_64k_pairs():
    check_align(random_ids(8192, 512, 8), 512, 64)


@pytest.mark.parametrize("tokens, experts, top_k, block_m", [
    (13, 8, 2, 16),  # one program
    (SMALL_PAIRS // 8 + 9, 128, 8, 64),  # three launches; real pairs end inside a chunk
    (700, 60, 4, 16),
])
def test_moe_align_groups_only_the_real_tokens(tokens, experts, top_k, block_m):
    # A CUDA graph's padding tokens (t >= real_tokens[0]) get no slot; their pair indices stay the sentinel's range.
    ids = random_ids(tokens, experts, top_k)
    for real in (0, 1, tokens // 2 + 1, tokens - 1, tokens, tokens + 5):
        check_align(ids, experts, block_m, real)


def test_moe_align_checks_real_tokens():
    ids = random_ids(5, 8, 2)
    for bad in (torch.tensor([3], device=DEVICE), torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)):
        with pytest.raises(ValueError, match="real_tokens"):
            moe_align(ids, 8, 16, real_tokens=bad)


def test_moe_align_empty():
    sorted_ids, block_expert, num_padded = moe_align(torch.zeros(0, 8, dtype=torch.int32, device=DEVICE), 128, 16)
    assert sorted_ids.numel() == 0 and block_expert.numel() == 0 and num_padded.tolist() == [0]
