"""fused_moe (moe_align + the two grouped GEMMs + the sum over top-k) against reference.fused_moe,
a loop over experts in PyTorch with the same roundings."""
import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, poisoned, randn

from tritonllm.kernels import fused_moe, moe_route, reference

# Gate, up, silu, the product and the output are each rounded to x's dtype (truncated under the
# interpreter for bfloat16: about 1.5e-2 there, matching a truncating reference exactly).
ROUNDINGS = 2.0
# T, E, k, N, H: odd token counts, N not a power of two, k up to 8 of 60 experts; the last has 16-bit
# rows of 72 bytes, which TMA cannot copy (the weights then load through pointers).
SHAPES = [(1, 4, 1, 48, 32), (3, 8, 2, 96, 64), (17, 60, 8, 48, 64), (17, 8, 8, 96, 32), (3, 60, 2, 96, 32),
          (17, 4, 2, 48, 32), (5, 8, 2, 36, 36)]


def moe_inputs(tokens, experts, top_k, inter, hidden, dtype, renormalize=True):
    """x, w13, w2 (scaled so every stage stays O(1)) and the router's weights and ids."""
    x = randn(tokens, hidden, dtype=dtype)
    w13 = randn(experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5 * 2)
    w2 = randn(experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    weights, ids = moe_route(randn(tokens, experts), top_k, renormalize)
    return x, w13, w2, weights, ids


def check(x, w13, w2, weights, ids, **kwargs):
    """fused_moe into a NaN-poisoned out against the reference: float32 against a float64 reference
    (exact), float16/bfloat16 against the reference on the same inputs (the same rounding points)."""
    out = poisoned(*x.shape, dtype=x.dtype)
    y = fused_moe(x, w13, w2, weights, ids, out=out, **kwargs)
    assert y.data_ptr() == out.data_ptr()
    if x.dtype == torch.float32:
        ref = reference.fused_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)
    else:
        ref = reference.fused_moe(x, w13, w2, weights, ids)
    assert_close(y, ref, x.dtype, factor=ROUNDINGS)
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, experts, top_k, inter, hidden", SHAPES)
def test_fused_moe(tokens, experts, top_k, inter, hidden, dtype):
    check(*moe_inputs(tokens, experts, top_k, inter, hidden, dtype, renormalize=tokens % 2 == 1))


def config(block_m, block_n, block_k, **down):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 2, **down}


# Tile shapes: K a multiple of BLOCK_K or not (masked tails), N a multiple of BLOCK_N or not (wrapped
# columns), blocks mostly padding, GROUP_M not dividing the blocks, separate down tiles.
CONFIGS = [
    config(16, 16, 16),
    config(32, 32, 64, GROUP_M=3, DOWN_BLOCK_N=64, DOWN_BLOCK_K=32),
    config(64, 64, 32, GROUP_M=1, DOWN_BLOCK_N=16, DOWN_BLOCK_K=64),
    config(16, 64, 128, DOWN_BLOCK_N=32, DOWN_BLOCK_K=16, DOWN_WARPS=8, DOWN_STAGES=3),
    # A block per pair, no align: the expert of block b is topk_ids' b-th entry.
    config(16, 32, 64, PAIR_BLOCKS=1),
    config(32, 16, 16, GROUP_M=3, DOWN_BLOCK_N=64, PAIR_BLOCKS=1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_fused_moe_configs(cfg, dtype):
    check(*moe_inputs(17, 8, 2, 48, 32, dtype), config=cfg)
    check(*moe_inputs(5, 60, 8, 96, 64, dtype), config=cfg)


@pytest.mark.parametrize("cfg", [None, config(16, 32, 64, PAIR_BLOCKS=1), config(64, 32, 32)],
                         ids=["tuned", "pair-blocks", "64-rows"])
@pytest.mark.parametrize("tokens, real", [(17, 9), (260, 133), (40, 16)])
def test_fused_moe_rows_past_real_tokens_are_padding(cfg, tokens, real):
    # A CUDA graph's padding rows (x NaN here) may be skipped; the real rows equal the reference's.
    x, w13, w2, weights, ids = moe_inputs(tokens, 8, 8 if tokens > 200 else 2, 48, 32, torch.bfloat16)
    x[real:] = float("nan")
    real_tokens = torch.tensor([real], dtype=torch.int32, device=DEVICE)
    y = fused_moe(x, w13, w2, weights, ids, out=poisoned(*x.shape, dtype=x.dtype), config=cfg,
                 real_tokens=real_tokens)
    ref = reference.fused_moe(x[:real], w13, w2, weights[:real], ids[:real])
    assert_close(y[:real], ref, x.dtype, factor=ROUNDINGS)


def test_fused_moe_many_pairs():
    # Far past moe_align's one-program size: its three-launch path, groups of many blocks.
    check(*moe_inputs(260, 8, 8, 48, 32, torch.bfloat16), config=config(64, 32, 32))


def test_fused_moe_one_expert_per_token_writes_y_directly():
    x, w13, w2, weights, ids = moe_inputs(9, 8, 1, 48, 32, torch.float16, renormalize=False)
    check(x, w13, w2, weights, ids)
    check(x, w13, w2, torch.rand_like(weights), ids)  # unnormalized weights are applied as given


def test_fused_moe_is_deterministic_and_takes_strided_rows():
    x, w13, w2, weights, ids = moe_inputs(17, 60, 8, 96, 64, torch.bfloat16)
    wide = randn(17, 100, dtype=torch.bfloat16)
    wide[:, :64] = x
    y = check(wide[:, :64], w13, w2, weights, ids)
    assert torch.equal(y, fused_moe(x, w13, w2, weights, ids))


@pytest.mark.parametrize("tokens", [1, 2, 3])  # pair blocks (the default at 1-2 tokens), then moe_align
def test_fused_moe_takes_int64_ids(tokens):
    x, w13, w2, weights, ids = moe_inputs(tokens, 8, 2, 48, 32, torch.float16)
    assert torch.equal(check(x, w13, w2, weights, ids.long()), fused_moe(x, w13, w2, weights, ids))


def test_fused_moe_same_expert_for_every_token():
    x, w13, w2, weights, _ = moe_inputs(17, 4, 2, 48, 32, torch.bfloat16)
    ids = torch.tensor([[2, 0]] * 17, dtype=torch.int32, device=DEVICE)
    check(x, w13, w2, weights, ids, config=config(16, 16, 32))


def test_fused_moe_empty_and_bad_shapes():
    x, w13, w2, weights, ids = moe_inputs(3, 8, 2, 48, 32, torch.float16)
    out = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 32) and out.dtype == torch.float16
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :16], weights, ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x.float(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="topk"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
