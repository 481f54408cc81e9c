import pytest
import torch
from kernel_utils import (DEVICE, DTYPES, SCALE_LAYOUTS, V_LAYOUTS, key_major, poisoned, randn, with_scale_layout,
                          with_v_layout)
from test_fp8 import assert_e4m3_rows_match, e4m3_poisoned

from tritonllm.kernels import gather_kv_blocks, reference, store_kv_cache
from tritonllm.kernels.kv_cache import check_cache_layouts, empty_kv_cache, is_key_major

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


def same_bits(a, b):
    """Equal values, NaN patterns included, whatever the memory layout."""
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def fp8_caches(num_blocks, block_size, heads, head_dim, scale_layout="contiguous"):
    """k_cache, v_cache of NaN patterns and k_scale, v_scale of NaN (in scale_layout): untouched rows stay NaN."""
    cache = e4m3_poisoned(num_blocks, block_size, heads, head_dim)
    scale = poisoned(num_blocks, block_size, heads, dtype=torch.float32)
    return cache, cache.clone(), with_scale_layout(scale, scale_layout), with_scale_layout(scale.clone(), scale_layout)


def check_fp8(k, v, slots, block_size, v_layout="contiguous", scale_layout="contiguous"):
    """store_kv_cache of k, v into poisoned e4m3 caches (V in v_layout, scales in scale_layout) against
    the reference; a key-major V also against the contiguous one stored by the kernel, bit for bit."""
    tokens, heads, head_dim = k.shape
    num_blocks = (tokens + block_size - 1) // block_size + 3
    k_cache, v_cache, k_scale, v_scale = fp8_caches(num_blocks, block_size, heads, head_dim, scale_layout)
    v_cache = with_v_layout(v_cache, v_layout)
    ref = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    ref[1] = with_v_layout(ref[1].contiguous(), v_layout)  # the reference writes the same layout
    reference.store_kv_cache(k, v, ref[0], ref[1], slots, k_scale=ref[2], v_scale=ref[3])
    store_kv_cache(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert is_key_major(v_cache) == (v_layout == "key_major") and is_key_major(ref[1]) == is_key_major(v_cache)
    assert_e4m3_rows_match(k_cache, k_scale, ref[0], ref[2])
    assert_e4m3_rows_match(v_cache, v_scale, ref[1], ref[3])
    assert int((~k_scale.isnan()).sum()) == int((slots >= 0).sum()) * heads
    if v_layout == "key_major":
        flat = fp8_caches(num_blocks, block_size, heads, head_dim)
        store_kv_cache(k, v, *flat[:2], slots, k_scale=flat[2], v_scale=flat[3])
        assert same_bits(v_cache, flat[1]) and same_bits(k_cache, flat[0])
        assert same_bits(v_scale, flat[3])


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


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf / inf, in the interpreter
def test_store_kv_cache_fp8_stores_nonfinite_values_as_nan():
    # A +-inf or NaN element is stored as NaN, as the GPU's conversion and the reference give; the
    # interpreter's own float32 -> e4m3 cast made it +-384 (a finite value, or -inf once scaled).
    k = randn(3, 1, 16, dtype=torch.float32)
    k[0, 0, 3], k[1, 0, 3], k[2, 0, 3] = float("inf"), float("nan"), float("-inf")
    k_cache, v_cache, k_scale, v_scale = fp8_caches(1, 16, 1, 16)
    store_kv_cache(k, k.clone(), k_cache, v_cache, torch.arange(3, device=DEVICE), k_scale=k_scale, v_scale=v_scale)
    for cache in (k_cache, v_cache):
        assert cache[0, :3, 0, 3].float().isnan().all()


def test_store_kv_cache_fp8_a_row_too_small_for_a_scale():
    # amax / 448 underflows float32 below about 6e-43: that row takes scale 1, as an all-zero one, not
    # a 0 scale that stores 0 / 0 = NaN codes; gathered back it is (close to) the row, never NaN.
    k = torch.zeros(2, 1, 16, dtype=torch.float32, device=DEVICE)
    k[0, 0, 0], k[1, 0, 5] = 1e-44, 3.0
    k_cache, v_cache, k_scale, v_scale = fp8_caches(1, 16, 1, 16)
    store_kv_cache(k, k.clone(), k_cache, v_cache, torch.arange(2, device=DEVICE), k_scale=k_scale, v_scale=v_scale)
    codes, scales = reference.quantize_e4m3(k)
    assert scales[0, 0] == 1.0 and k_scale[0, 0, 0] == 1.0 and not codes.float().isnan().any()
    assert torch.equal(k_cache[0, :2].view(torch.uint8), codes.view(torch.uint8))
    back, _ = gather_kv_blocks(k_cache, v_cache, torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.float32,
                               k_scale=k_scale, v_scale=v_scale)
    assert back[0, :2].isfinite().all() and back[0, 1, 0, 5] == 3.0


@pytest.mark.parametrize("v_layout", V_LAYOUTS)
def test_store_kv_cache_fp8_strided_rows(v_layout):
    # k with a head stride past D (a view of wider rows), v from a packed qkv row.
    tokens, heads, head_dim = 9, 2, 64
    k = randn(tokens, heads, head_dim + 16, dtype=torch.bfloat16)[:, :, :head_dim]
    v = randn(tokens, 8 * head_dim, dtype=torch.bfloat16)[:, 6 * head_dim:].view(tokens, heads, head_dim)
    check_fp8(k, v, torch.tensor([17, 3, -1, 0, 31, 16, 40, -2, 5], device=DEVICE), 16, v_layout)


# A key-major V (kernels/kv_cache.py): memory [num_blocks, Hkv, D, block_size], the same values
# through indexing. Stored against the reference into the same layout, and against the kernel's
# own contiguous result; rows of slot < 0 (padding) are not written.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, head_dim, block_size", CASES)
def test_store_kv_cache_key_major_v(tokens, heads, head_dim, block_size, dtype):
    num_blocks = (tokens + block_size - 1) // block_size + 3
    k, v = randn(tokens, heads, head_dim, dtype=dtype), randn(tokens, heads, head_dim, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens].to(torch.int32)
    slots[1::5] = -1  # padding rows; row 0 kept, so every case stores something
    slots[2::7] = -3
    k_cache = poisoned(num_blocks, block_size, heads, head_dim, dtype=dtype)
    v_cache = key_major(poisoned(num_blocks, block_size, heads, head_dim, dtype=dtype))
    ref_k, ref_v = k_cache.clone(), key_major(v_cache)
    flat_k, flat_v = k_cache.clone(), poisoned(num_blocks, block_size, heads, head_dim, dtype=dtype)
    reference.store_kv_cache(k, v, ref_k, ref_v, slots)
    store_kv_cache(k, v, k_cache, v_cache, slots)
    store_kv_cache(k, v, flat_k, flat_v, slots)
    assert is_key_major(v_cache) and is_key_major(ref_v) and flat_v.is_contiguous()
    assert same_bits(k_cache, ref_k) and same_bits(v_cache, ref_v)  # NaN where nothing was stored
    assert same_bits(k_cache, flat_k) and same_bits(v_cache, flat_v)
    # Each kept row is v[t] at its slot; every other row of the cache still all NaN.
    keep = slots >= 0
    kept = slots[keep].long()
    assert len(kept)
    assert torch.equal(v_cache[kept // block_size, kept % block_size], v[keep])
    written = torch.isfinite(v_cache).all(-1).all(-1)
    assert int(written.sum()) == int(keep.sum())
    assert int(torch.isnan(v_cache).all(-1).all(-1).sum()) == num_blocks * block_size - int(keep.sum())
    # The memory itself is key-major: a head's values of one block run over the block's keys.
    assert same_bits(v_cache.permute(0, 2, 3, 1).contiguous(), flat_v.permute(0, 2, 3, 1).contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, head_dim, block_size", [CASES[1], CASES[2], CASES[3]])
@pytest.mark.parametrize("scale_layout", SCALE_LAYOUTS)
def test_store_kv_cache_fp8_key_major_v(tokens, heads, head_dim, block_size, dtype, scale_layout):
    num_blocks = (tokens + block_size - 1) // block_size + 3
    magnitudes = torch.logspace(-8, 8, tokens * heads, base=2.0, device=DEVICE).view(tokens, heads, 1)
    k = (torch.randn(tokens, heads, head_dim, device=DEVICE) * magnitudes).to(dtype)
    v = (torch.randn(tokens, heads, head_dim, device=DEVICE) * magnitudes.flip(0)).to(dtype)
    v[0, 0, head_dim // 2] = 3e3
    v[-1, -1] = 0.0
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[1::5] = -1
    slots[3::7] = -9
    check_fp8(k, v, slots, block_size, "key_major", scale_layout)


def test_check_cache_layouts():
    k_cache = empty_kv_cache(3, 16, 2, 64, torch.bfloat16)
    assert k_cache.is_contiguous() and not is_key_major(k_cache)
    assert check_cache_layouts(k_cache, torch.empty_like(k_cache)) is False
    assert check_cache_layouts(k_cache, empty_kv_cache(3, 16, 2, 64, torch.bfloat16, key_major=True)) is True
    # Both caches with the same (here key-major) strides: V is read as K is.
    both = empty_kv_cache(3, 16, 2, 64, torch.bfloat16, key_major=True)
    assert check_cache_layouts(both, both.clone()) is False
    with pytest.raises(ValueError, match="v_cache"):
        check_cache_layouts(k_cache, k_cache.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match="v_cache"):
        check_cache_layouts(k_cache, empty_kv_cache(3, 32, 2, 64, torch.bfloat16, key_major=True))
    padded = torch.empty(3, 16, 2, 80, dtype=torch.bfloat16)[..., :64]
    with pytest.raises(ValueError, match="v_cache"):  # key-major only beside a contiguous k_cache
        check_cache_layouts(padded, empty_kv_cache(3, 16, 2, 64, torch.bfloat16, key_major=True))


@pytest.mark.parametrize("fp8", [False, True])
def test_store_kv_cache_rejects_bad_cache_layouts(fp8):
    k = randn(4, 2, 64)
    slots = torch.arange(4, device=DEVICE)
    if fp8:
        k_cache, _, k_scale, v_scale = fp8_caches(2, 16, 2, 64)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
    else:
        k_cache, scales = poisoned(2, 16, 2, 64, dtype=torch.float32), {}
    before = k_cache.clone()
    # V neither with k_cache's strides nor key-major: memory [blocks, block_size, D, Hkv].
    with pytest.raises(ValueError, match="v_cache"):
        store_kv_cache(k, k, k_cache, k_cache.transpose(2, 3).contiguous().transpose(2, 3), slots, **scales)
    with pytest.raises(ValueError, match="v_cache"):
        store_kv_cache(k, k, k_cache, key_major(k_cache)[:1], slots, **scales)
    # A non-contiguous k_cache: key-major (with V alike or contiguous), or padded in head_dim.
    with pytest.raises(ValueError, match="k_cache"):
        store_kv_cache(k, k, key_major(k_cache), key_major(k_cache), slots, **scales)
    with pytest.raises(ValueError, match="k_cache"):
        store_kv_cache(k, k, key_major(k_cache), k_cache.clone(), slots, **scales)
    padded = torch.cat([k_cache, k_cache[..., :16]], -1)[..., :64]
    with pytest.raises(ValueError, match="k_cache"):
        store_kv_cache(k, k, padded, padded.clone(), slots, **scales)
    assert same_bits(k_cache, before)


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


# Copies of cache blocks (gather_kv_blocks): blocks in random order with a repeat, from caches whose
# every other block is poison (NaN), so a copy of a wrong block or slot shows as NaN.
GATHER_CASES = [(8, 128, 16), (2, 64, 256), (3, 80, 32)]  # KV heads, head dim, block size
# One rounding to the copy's dtype (a truncation under the interpreter).
GATHER_TOLERANCE = {torch.float32: 0.0, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("cache_dtype", ["fp8", torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v_layout", V_LAYOUTS)
@pytest.mark.parametrize("heads, head_dim, block_size", GATHER_CASES)
def test_gather_kv_blocks(heads, head_dim, block_size, v_layout, dtype, cache_dtype):
    num_blocks, fp8 = 7, cache_dtype == "fp8"
    blocks = torch.tensor([5, 0, 3, 5, 2], dtype=torch.int32, device=DEVICE)
    if fp8:  # head-major scales beside a key-major V, as the engine keeps them
        scale_layout = "head_major" if v_layout == "key_major" else "contiguous"
        k_cache, v_cache, k_scale, v_scale = fp8_caches(num_blocks, block_size, heads, head_dim, scale_layout)
    else:
        k_cache, v_cache = (poisoned(num_blocks, block_size, heads, head_dim, dtype=cache_dtype) for _ in range(2))
        k_scale = v_scale = None
    v_cache = with_v_layout(v_cache, v_layout)
    slots = (blocks.unique().long()[:, None] * block_size + torch.arange(block_size, device=DEVICE)).flatten()
    # Rows of different magnitudes, so the scales differ from row to row.
    magnitudes = torch.logspace(-4, 4, len(slots), base=2.0, device=DEVICE)[:, None, None]
    k, v = (randn(len(slots), heads, head_dim) * magnitudes for _ in range(2))
    scales = {"k_scale": k_scale, "v_scale": v_scale} if fp8 else {}
    reference.store_kv_cache(k, v, k_cache, v_cache, slots, **scales)
    out = gather_kv_blocks(k_cache, v_cache, blocks, dtype, **scales)
    ref = reference.gather_kv_blocks(k_cache, v_cache, blocks, dtype, **scales)
    for o, r in zip(out, ref):
        assert o.dtype == dtype and o.shape == (5, block_size, heads, head_dim) and o.is_contiguous()
        assert torch.isfinite(o).all(), "a copied value is NaN: a wrong block or slot was read"
        torch.testing.assert_close(o.float(), r.float(), rtol=GATHER_TOLERANCE[dtype], atol=0)
    # The repeat is the same copy, and the caches were only read.
    assert torch.equal(out[0][0], out[0][3]) and torch.equal(out[1][0], out[1][3])
    assert k_cache.float().isnan().sum() == (num_blocks - 4) * block_size * heads * head_dim


def test_gather_kv_blocks_of_nothing_and_bad_inputs():
    k_cache, v_cache, k_scale, v_scale = fp8_caches(2, 16, 2, 64)
    k, v = gather_kv_blocks(k_cache, v_cache, torch.zeros(0, dtype=torch.int64, device=DEVICE), torch.bfloat16,
                            k_scale=k_scale, v_scale=v_scale)
    assert k.shape == v.shape == (0, 16, 2, 64) and k.dtype == torch.bfloat16
    blocks = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="blocks must be"):
        gather_kv_blocks(k_cache, v_cache, blocks.view(3, 1), torch.bfloat16, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(TypeError, match="blocks must be"):
        gather_kv_blocks(k_cache, v_cache, blocks.float(), torch.bfloat16, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="dtype must be"):
        gather_kv_blocks(k_cache, v_cache, blocks, torch.float8_e4m3fn, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="k_scale is required"):
        gather_kv_blocks(k_cache, v_cache, blocks, torch.bfloat16)
    with pytest.raises(ValueError, match="v_cache must have"):
        gather_kv_blocks(k_cache, v_cache[:1], blocks, torch.bfloat16, k_scale=k_scale, v_scale=v_scale)
    buffer = poisoned(3, 16, 2, 64, dtype=torch.bfloat16)
    for bad in (buffer[:2], buffer.float(), buffer[:, :8], buffer.transpose(1, 2)):
        with pytest.raises(ValueError, match=r"out\[1\] must be"):
            gather_kv_blocks(k_cache, v_cache, blocks, torch.bfloat16, k_scale=k_scale, v_scale=v_scale,
                             out=(buffer, bad))
    assert buffer.isnan().all()


@pytest.mark.parametrize("kernel", [gather_kv_blocks, reference.gather_kv_blocks], ids=["triton", "reference"])
def test_gather_kv_blocks_into_the_first_blocks_of_out(kernel):
    # out holds more blocks than are gathered: the first ones take the copies, the rest stay as they were.
    k_cache, v_cache, k_scale, v_scale = fp8_caches(4, 16, 2, 64, "head_major")
    slots = torch.arange(4 * 16, device=DEVICE)
    reference.store_kv_cache(randn(64, 2, 64), randn(64, 2, 64), k_cache, v_cache, slots, k_scale=k_scale,
                             v_scale=v_scale)
    blocks = torch.tensor([3, 1], dtype=torch.int64, device=DEVICE)
    out = tuple(poisoned(5, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    result = kernel(k_cache, v_cache, blocks, torch.bfloat16, k_scale=k_scale, v_scale=v_scale, out=out)
    new = kernel(k_cache, v_cache, blocks, torch.bfloat16, k_scale=k_scale, v_scale=v_scale)
    for o, r, n in zip(out, result, new):
        assert r is o
        assert torch.equal(o[:2], n) and o[2:].isnan().all()
