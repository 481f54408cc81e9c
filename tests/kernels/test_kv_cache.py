import pytest
import torch
from kernel_utils import DEVICE, DTYPES, poisoned, randn
from test_fp8 import assert_e4m3_rows_match, e4m3_poisoned

from tritonllm.kernels import reference, store_kv_cache

# tokens, KV heads, head dim, block size
CASES = [(1, 1, 64, 16), (7, 8, 128, 16), (100, 2, 64, 256), (33, 3, 80, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, head_dim, block_size", CASES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_cache(tokens, heads, head_dim, block_size, dtype, slot_dtype):
    num_blocks = (tokens + block_size - 1) // block_size + 3
    k, v = randn(tokens, heads, head_dim, dtype=dtype), randn(tokens, heads, head_dim, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens].to(slot_dtype)
    slots[::5] = -1  # padding rows are skipped
    k_cache = torch.full((num_blocks, block_size, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(k, v, ref_k, ref_v, slots)
    store_kv_cache(k, v, k_cache, v_cache, slots)
    # Bitwise equal, NaN where nothing was stored.
    assert torch.equal(k_cache.nan_to_num(7.0), ref_k.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))
    assert int(torch.isfinite(k_cache).all(-1).all(-1).sum()) == int((slots >= 0).sum())


def fp8_caches(num_blocks, block_size, heads, head_dim):
    """k_cache, v_cache of NaN patterns and k_scale, v_scale of NaN: untouched rows stay NaN."""
    cache = e4m3_poisoned(num_blocks, block_size, heads, head_dim)
    scale = poisoned(num_blocks, block_size, heads, dtype=torch.float32)
    return cache, cache.clone(), scale, scale.clone()


def check_fp8(k, v, slots, block_size):
    """store_kv_cache of k, v into poisoned e4m3 caches against the reference."""
    tokens, heads, head_dim = k.shape
    num_blocks = (tokens + block_size - 1) // block_size + 3
    k_cache, v_cache, k_scale, v_scale = fp8_caches(num_blocks, block_size, heads, head_dim)
    ref = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    reference.store_kv_cache(k, v, ref[0], ref[1], slots, k_scale=ref[2], v_scale=ref[3])
    store_kv_cache(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert_e4m3_rows_match(k_cache, k_scale, ref[0], ref[2])
    assert_e4m3_rows_match(v_cache, v_scale, ref[1], ref[3])
    assert int((~k_scale.isnan()).sum()) == int((slots >= 0).sum()) * heads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, head_dim, block_size", CASES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_cache_fp8(tokens, heads, head_dim, block_size, dtype, slot_dtype):
    num_blocks = (tokens + block_size - 1) // block_size + 3
    # Rows of very different magnitudes, an all-zero K row and a V row with one outlier.
    magnitudes = torch.logspace(-8, 8, tokens * heads, base=2.0, device=DEVICE).view(tokens, heads, 1)
    k = (torch.randn(tokens, heads, head_dim, device=DEVICE) * magnitudes).to(dtype)
    v = (torch.randn(tokens, heads, head_dim, device=DEVICE) * magnitudes.flip(0)).to(dtype)
    k[-1, -1] = 0.0
    v[0, 0, head_dim // 2] = 3e3
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens].to(slot_dtype)
    slots[1::5] = -1  # padding rows: neither values nor scales written
    slots[3::7] = -9
    check_fp8(k, v, slots, block_size)


def test_store_kv_cache_fp8_strided_rows():
    # k with a head stride past D (a view of wider rows), v from a packed qkv row.
    tokens, heads, head_dim = 9, 2, 64
    k = randn(tokens, heads, head_dim + 16, dtype=torch.bfloat16)[:, :, :head_dim]
    v = randn(tokens, 8 * head_dim, dtype=torch.bfloat16)[:, 6 * head_dim:].view(tokens, heads, head_dim)
    check_fp8(k, v, torch.tensor([17, 3, -1, 0, 31, 16, 40, -2, 5], device=DEVICE), 16)


def test_store_kv_cache_from_packed_qkv():
    tokens, heads, head_dim = 5, 2, 64
    qkv = randn(tokens, 8 * head_dim)
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(tokens, heads, head_dim)
    v = qkv[:, 6 * head_dim :].view(tokens, heads, head_dim)
    k_cache = torch.zeros(2, 16, heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([17, 3, 0, 31, 16], device=DEVICE)
    store_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, heads, head_dim)[slots], k)
    assert torch.equal(v_cache.view(-1, heads, head_dim)[slots], v)


def test_store_kv_cache_rejects_bad_slot_mapping():
    k = randn(4, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_cache(k, k, torch.zeros(1, 16, 2, 64, device=DEVICE), torch.zeros(1, 16, 2, 64, device=DEVICE), torch.zeros(3, device=DEVICE))


def test_store_kv_cache_rejects_bad_scales():
    k = randn(4, 2, 64)
    slots = torch.zeros(4, dtype=torch.long, device=DEVICE)
    k_cache, v_cache, k_scale, v_scale = fp8_caches(1, 16, 2, 64)
    with pytest.raises(ValueError, match="k_scale is required"):
        store_kv_cache(k, k, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="v_scale is required"):
        store_kv_cache(k, k, k_cache, v_cache, slots, k_scale=k_scale)
    with pytest.raises(ValueError, match="k_scale is only for"):
        store_kv_cache(k, k, k_cache.bfloat16(), v_cache.bfloat16(), slots, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="v_scale must be"):
        store_kv_cache(k, k, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale[:, :, :1])
    with pytest.raises(ValueError, match="k_scale must be"):
        store_kv_cache(k, k, k_cache, v_cache, slots, k_scale=k_scale.double(), v_scale=v_scale)
    assert k_scale.isnan().all() and (k_cache.view(torch.uint8) == 0x7F).all()
