import pytest
import torch
from kernel_utils import DEVICE, DTYPES, randn

from tritonllm.kernels import reference, store_kv_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, head_dim, block_size", [(1, 1, 64, 16), (7, 8, 128, 16), (100, 2, 64, 256), (33, 3, 80, 32)])
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
