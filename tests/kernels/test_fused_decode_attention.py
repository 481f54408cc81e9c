"""fused_decode_attention (the prologue inside decode attention) against reference.qk_norm_rotary_store
then reference.decode_attention, on NaN-poisoned paged caches.

Each sequence's last cache row, where the new token goes, holds NaN before the call: a program
that attends before that row is stored, or reads it from the wrong place, gives NaN. The caches
afterwards hold what the reference prologue stores, and nothing else changes.
"""
import pytest
import torch
from kernel_utils import ATTN, DEVICE, DTYPES, assert_close, exact, paged_caches, poisoned, randn, rel_err

from tritonllm.kernels import fused_decode_attention, reference
from tritonllm.layers import rotary

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

EPS = 1e-6


def config(num_splits, split_min, block_n, num_warps=4):
    return {"BLOCK_N": block_n, "NUM_SPLITS": num_splits, "SPLIT_MIN": split_min, "num_warps": num_warps,
            "num_stages": 2}


def slots_of_last(tables, seq_lens, block_size):
    last = torch.tensor(seq_lens, device=DEVICE) - 1
    return tables[torch.arange(len(seq_lens), device=DEVICE), last // block_size].long() * block_size + last % block_size


def poison_rows(cache, scale, slots):
    """NaN in the cache rows (and scales) at `slots`: e4m3 0x7F, a float NaN."""
    block_size = cache.shape[1]
    index = (slots // block_size, slots % block_size)
    if cache.dtype == torch.float8_e4m3fn:
        cache.view(torch.uint8)[index] = 0x7F
        scale[index] = float("nan")
    else:
        cache[index] = float("nan")


def rows(cache, scale, slots):
    """The values of cache rows at `slots` [n, Hkv, D] in float32 (e4m3: code times scale)."""
    block_size = cache.shape[1]
    index = (slots // block_size, slots % block_size)
    values = cache[index].float()
    return values * scale[index][..., None] if scale is not None else values


def check(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, fp8, cfg=None, skip=()):
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, num_kv_heads, head_dim, block_size, dtype, fp8,
                                                    v_layout="key_major" if fp8 else "contiguous",
                                                    scale_layout="head_major" if fp8 else "contiguous")
    batch = len(seq_lens)
    slots = slots_of_last(tables, seq_lens, block_size)
    stored = torch.ones(batch, dtype=torch.bool, device=DEVICE)
    stored[list(skip)] = False
    for cache, name in ((k_cache, "k_scale"), (v_cache, "v_scale")):
        poison_rows(cache, scales.get(name), slots[stored])
    slots[~stored] = -1  # not stored: those rows attend over the key already in their last slot
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = randn(batch, width + 8, dtype=dtype, scale=2.0)[:, :width]
    q_weight, k_weight = randn(head_dim, dtype=dtype), randn(head_dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    positions = (lens - 1).long()
    cos_sin = rotary.cos_sin_cache(head_dim, 4096, 1e6).to(DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_scales = {name: scale.clone() for name, scale in scales.items()}
    args = (positions, qkv, q_weight, k_weight, EPS, cos_sin)
    tail = (slots, lens, tables, num_q_heads, num_kv_heads)

    out = fused_decode_attention(*args, k_cache, v_cache, *tail, out=poisoned(batch, num_q_heads, head_dim,
                                                                                dtype=dtype), config=cfg, **scales)
    q = reference.qk_norm_rotary_store(*args, ref_k, ref_v, slots, num_q_heads, num_kv_heads, **ref_scales)
    ref = reference.decode_attention(q.double(), exact(ref_k), exact(ref_v), lens, tables, **ref_scales)
    assert_close(out, ref, dtype, ATTN)

    # The caches: the new rows as the reference stored them, every other byte untouched.
    written = slots[slots >= 0]
    for cache, ref_cache, name in ((k_cache, ref_k, "k_scale"), (v_cache, ref_v, "v_scale")):
        new, ref_new = rows(cache, scales.get(name), written), rows(ref_cache, ref_scales.get(name), written)
        assert not new.isnan().any(), "a new row was not stored"
        assert rel_err(new, ref_new) <= (2e-2 if fp8 or dtype == torch.bfloat16 else 2e-3)
        block = (written // block_size, written % block_size)
        cache[block], ref_cache[block] = 0, 0
        as_bytes = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t.nan_to_num(7.0))
        assert torch.equal(as_bytes(cache), as_bytes(ref_cache))
    for name, scale in scales.items():
        keep = torch.ones_like(scale, dtype=torch.bool)
        keep[written // block_size, written % block_size] = False
        assert torch.equal(scale[keep].nan_to_num(7.0), ref_scales[name][keep].nan_to_num(7.0))


# (head_dim, Hq, Hkv, block_size, seq_lens): GQA 1, 2, 4 and 3; a one-token sequence; last keys on
# and just past block boundaries.
CASES = [
    (64, 4, 4, 16, [1, 15, 16, 17, 300]),
    (128, 4, 2, 32, [31, 33, 100]),
    (64, 8, 2, 64, [1, 64, 65, 200]),
    (64, 6, 2, 256, [255, 257, 1]),
]


@pytest.mark.parametrize("fp8", [False, True], ids=["model-cache", "fp8-cache"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, num_q_heads, num_kv_heads, block_size, seq_lens", CASES)
def test_fused_decode_matches_reference(head_dim, num_q_heads, num_kv_heads, block_size, seq_lens, dtype, fp8):
    check(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, fp8)


# The split that holds the last key stores it: one split, several, more than a row can use, tiles
# over several blocks, and one-warp programs (the e4m3 default).
@pytest.mark.parametrize("fp8", [False, True], ids=["model-cache", "fp8-cache"])
@pytest.mark.parametrize("cfg", [config(1, 256, 16), config(3, 16, 16), config(64, 16, 16), config(5, 16, 64),
                                 config(4, 32, 32, num_warps=1)],
                         ids=["splits1", "splits3", "splits64", "splits5-tile64", "splits4-one-warp"])
def test_fused_decode_splits(cfg, fp8):
    check([1, 17, 100, 300, 64], 4, 2, 64, 16, torch.bfloat16, fp8, cfg)


@pytest.mark.parametrize("fp8", [False, True], ids=["model-cache", "fp8-cache"])
def test_fused_decode_skips_rows_without_a_slot(fp8):
    # slot -1 (a captured batch's padding): nothing stored for that row, which still attends.
    check([40, 7, 129, 1], 4, 2, 64, 16, torch.bfloat16, fp8, config(3, 16, 16), skip=(1, 3))


def test_fused_decode_bad_inputs():
    k_cache, v_cache, tables, _ = paged_caches([5], 2, 64, 16, torch.bfloat16)
    qkv = randn(1, 8 * 64, dtype=torch.bfloat16)
    weight = randn(64, dtype=torch.bfloat16)
    one = torch.zeros(1, dtype=torch.long, device=DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    cos_sin = rotary.cos_sin_cache(64, 64, 1e6).to(DEVICE)
    with pytest.raises(ValueError, match="qkv width"):
        fused_decode_attention(one, qkv, weight, weight, EPS, cos_sin, k_cache, v_cache, one, lens, tables, 3, 2)
    with pytest.raises(ValueError, match="q_weight"):
        fused_decode_attention(one, qkv, weight[:32], weight, EPS, cos_sin, k_cache, v_cache, one, lens, tables, 4, 2)
    with pytest.raises(ValueError, match="slot_mapping"):
        fused_decode_attention(one, qkv, weight, weight, EPS, cos_sin, k_cache, v_cache, one[:0], lens, tables, 4, 2)
