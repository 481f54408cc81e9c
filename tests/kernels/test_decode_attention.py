"""decode_attention against the float64 reference, on a NaN-poisoned paged cache.

Every cache row that no sequence owns is NaN and the block-table entries past each sequence point
at NaN blocks (kernel_utils.paged_kv); outputs are NaN-poisoned buffers. A kernel that reads a key
it must not, or skips a row, produces NaN and fails. fp8: the same over an e4m3 cache whose rows
and scales no sequence owns are NaN, at the tolerances of the model-dtype cache (the reference
dequantizes exactly the values stored).
"""
import importlib
import json

import pytest
import torch
from kernel_utils import (ATTN, DEVICE, DTYPES, assert_close, exact, key_major, paged_caches, poisoned, prefill_inputs,
                          randn, rel_err)

from tritonllm.kernels import decode_attention, prefill_attention, reference, tuning
from tritonllm.kernels.decode_attention import decode_attention_bucket
from tritonllm.kernels.kv_cache import is_key_major

# The package exports the function under the module's name: fetch the module itself.
decode_module = importlib.import_module("tritonllm.kernels.decode_attention")

# Triton 3.6's interpreter converts loop bounds through a NumPy path that NumPy 2.x deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


FP8 = pytest.mark.parametrize("fp8", [False, True], ids=["model-cache", "fp8-cache"])


def run_decode(q, k_cache, v_cache, seq_lens, tables, scales, **kwargs):
    buffer = poisoned(*q.shape, dtype=q.dtype)
    out = decode_attention(q, k_cache, v_cache, seq_lens, tables, out=buffer, **scales, **kwargs)
    assert out is buffer  # written in place: the engine's CUDA graphs read it there
    ref = reference.decode_attention(q.double(), exact(k_cache), exact(v_cache), seq_lens, tables,
                                     kwargs.get("scale"), **scales)
    return out, ref


def decode_config(num_splits, split_min, block_n):
    return {"BLOCK_N": block_n, "NUM_SPLITS": num_splits, "SPLIT_MIN": split_min, "num_warps": 4, "num_stages": 2}


# (head_dim, Hq, Hkv, block_size, seq_lens)
DECODE_CASES = [
    (64, 4, 4, 16, [1, 15, 16, 17, 300]),
    (128, 4, 2, 32, [31, 33, 100]),
    (64, 8, 2, 64, [1, 64, 65, 200]),
    (128, 8, 1, 128, [129, 3]),
    (64, 6, 2, 256, [255, 257, 1]),
]


@FP8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, num_q_heads, num_kv_heads, block_size, seq_lens", DECODE_CASES)
def test_decode_matches_reference(head_dim, num_q_heads, num_kv_heads, block_size, seq_lens, dtype, fp8):
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, num_kv_heads, head_dim, block_size, dtype, fp8)
    q = randn(len(seq_lens), num_q_heads, head_dim, dtype=dtype, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out, ref = run_decode(q, k_cache, v_cache, lens, tables, scales)
    assert_close(out, ref, dtype, ATTN)


# Split-KV: one split (o written directly), a few, many more than a sequence can use (unused splits
# exit and the merge skips them), tiles over several blocks (BLOCK_N 64 > block_size 16).
@FP8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits, split_min, block_n",
                         [(1, 256, 16), (3, 16, 16), (8, 32, 32), (64, 16, 16), (5, 16, 64)])
def test_decode_splits(num_splits, split_min, block_n, dtype, fp8):
    seq_lens = [1, 17, 100, 300, 64]
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, 2, 64, 16, dtype, fp8)
    q = randn(len(seq_lens), 4, 64, dtype=dtype, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out, ref = run_decode(q, k_cache, v_cache, lens, tables, scales,
                          config=decode_config(num_splits, split_min, block_n))
    assert_close(out, ref, dtype, ATTN)


# The merge takes a head's columns in MERGE_BLOCK_D pieces: heads of one, two and four pieces.
@FP8
@pytest.mark.parametrize("head_dim", [32, 128, 256])
def test_decode_splits_merge_head_columns(head_dim, fp8):
    seq_lens = [100, 7, 300]
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, 2, head_dim, 16, torch.bfloat16, fp8)
    q = randn(len(seq_lens), 4, head_dim, dtype=torch.bfloat16, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out, ref = run_decode(q, k_cache, v_cache, lens, tables, scales, config=decode_config(5, 16, 16))
    assert_close(out, ref, torch.bfloat16, ATTN)


# A key-major V (kernels/kv_cache.py, the engine's fp8 layout): GQA 1 over blocks of 16 with lengths
# around them, GQA 8 over blocks of 128, an odd group over blocks of 256; e4m3 and model-dtype caches.
@pytest.mark.parametrize("dtype, fp8, scale_layout", [
    (torch.bfloat16, True, "contiguous"), (torch.bfloat16, True, "head_major"), (torch.float32, True, "contiguous"),
    (torch.float32, True, "head_major"), (torch.float32, False, "contiguous"),
], ids=["bf16-fp8-cache", "bf16-fp8-cache-head-major-scales", "fp32-fp8-cache", "fp32-fp8-cache-head-major-scales",
        "fp32-model-cache"])
@pytest.mark.parametrize("head_dim, num_q_heads, num_kv_heads, block_size, seq_lens",
                         [DECODE_CASES[0], DECODE_CASES[3], DECODE_CASES[4]], ids=["block16", "block128", "block256"])
def test_decode_key_major_v(head_dim, num_q_heads, num_kv_heads, block_size, seq_lens, dtype, fp8, scale_layout):
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, num_kv_heads, head_dim, block_size, dtype, fp8,
                                                    v_layout="key_major", scale_layout=scale_layout)
    assert is_key_major(v_cache) and k_cache.is_contiguous()
    q = randn(len(seq_lens), num_q_heads, head_dim, dtype=dtype, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out, ref = run_decode(q, k_cache, v_cache, lens, tables, scales)
    assert_close(out, ref, dtype, ATTN)


# Key-major V under splits, with tiles inside a block (BLOCK_N 16 = block_size) and over several
# blocks (BLOCK_N 64 > block_size 16: one block-table lookup per key); the same output as from a
# contiguous V holding the same values.
@pytest.mark.parametrize("num_splits, split_min, block_n", [(3, 16, 16), (5, 16, 64), (1, 256, 32)])
def test_decode_splits_key_major_v(num_splits, split_min, block_n):
    seq_lens = [1, 17, 100, 300, 64]
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, 2, 64, 16, torch.bfloat16, fp8=True,
                                                    scale_layout="head_major")  # as the engine keeps them
    q = randn(len(seq_lens), 4, 64, dtype=torch.bfloat16, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    config = decode_config(num_splits, split_min, block_n)
    out, ref = run_decode(q, k_cache, key_major(v_cache), lens, tables, scales, config=config)
    assert_close(out, ref, torch.bfloat16, ATTN)
    flat = decode_attention(q, k_cache, v_cache, lens, tables, config=config, **scales)
    # The interpreter computes the same tiles whatever the layout; compiled code may order sums otherwise.
    assert torch.equal(out, flat) if tuning.INTERPRET else rel_err(out, flat) <= 1e-2


def shipped_decode_configs():
    """The distinct split/tile choices of the tuned decode configs shipped for every GPU."""
    found = {}
    for path in sorted(tuning.CONFIG_DIR.glob("*.json")):
        for config in json.loads(path.read_text())["kernels"].get("decode_attention", {}).values():
            found.setdefault((config["NUM_SPLITS"], config["SPLIT_MIN"], config["BLOCK_N"]), config)
    return [found[key] for key in sorted(found)]


def fp8_space_tiles():
    """One config of the e4m3 tuning space for each of its tiles, split counts and split minimums (a
    small bucket)."""
    found = {}
    for config in decode_module.DECODE_TUNABLE.space("bfloat16", 64, 2, 2, 16, 4, 4096, "float8_e4m3fn"):
        found.setdefault((config["BLOCK_N"], config["NUM_SPLITS"], config["SPLIT_MIN"]), config)
    return list(found.values())


# The e4m3 tuning space (one-warp tiles of 16 and 32 keys, four-warp tiles of 128) over a key-major V.
# float32 q as well: its tolerance sees a key dropped from a long row, which bf16's would not.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", fp8_space_tiles(), ids=str)
def test_decode_fp8_space_configs(config, dtype):
    seq_lens = [1, 130, 300]
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, 2, 64, 16, dtype, True, v_layout="key_major")
    q = randn(len(seq_lens), 4, 64, dtype=dtype, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out, ref = run_decode(q, k_cache, v_cache, lens, tables, scales, config=config)
    assert_close(out, ref, dtype, ATTN)


def test_bf16_space_offers_one_warp_tiles_at_few_rows_only():
    def one_warp(dtype, batch):
        return [c for c in decode_module.DECODE_TUNABLE.space(dtype, 64, 2, 2, 16, batch, 4096) if c["num_warps"] == 1]
    few = one_warp("bfloat16", decode_module.ONE_WARP_MAX_BATCH)
    assert few and all(c["BLOCK_N"] == 16 and c["SPLIT_MIN"] == 64 and c["maxnreg"] == 128 for c in few)
    assert not one_warp("bfloat16", 2 * decode_module.ONE_WARP_MAX_BATCH) and not one_warp("float32", 1)


# The bf16 space's one-warp tiles over a bf16 cache, lengths across their 64-key splits.
@pytest.mark.parametrize("config", [c for c in decode_module.DECODE_TUNABLE.space("bfloat16", 64, 2, 2, 16, 4, 4096)
                                    if c["num_warps"] == 1], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_bf16_one_warp_configs(config, dtype):
    seq_lens = [1, 63, 65, 300]
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, 2, 64, 16, dtype, False)
    q = randn(len(seq_lens), 4, 64, dtype=dtype, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out, ref = run_decode(q, k_cache, v_cache, lens, tables, scales, config=config)
    assert_close(out, ref, dtype, ATTN)


# What the engine runs: lengths around SPLIT_MIN (128..512) and BLOCK_N (64, 128) boundaries.
@FP8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", shipped_decode_configs(),
                         ids=lambda c: f"splits{c['NUM_SPLITS']}-min{c['SPLIT_MIN']}-n{c['BLOCK_N']}")
def test_decode_shipped_configs(config, fp8, dtype):
    seq_lens = [1, 127, 129, 513, 1100]
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, 2, 64, 16, dtype, fp8)
    q = randn(len(seq_lens), 4, 64, dtype=dtype, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out, ref = run_decode(q, k_cache, v_cache, lens, tables, scales, config=config)
    assert_close(out, ref, dtype, ATTN)


@FP8
def test_decode_default_splits_on_a_large_gpu(monkeypatch, fp8):
    # The default rule as on an H200 (132 SMs): many splits, most of them unused at these lengths.
    monkeypatch.setattr(decode_module, "num_sms", lambda: 132)
    seq_lens = [700, 5, 260]
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, 2, 64, 32, torch.bfloat16, fp8)
    q = randn(3, 4, 64, dtype=torch.bfloat16, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    assert decode_module._decode_default("bfloat16", 64, 2, 2, 32, 4, 4096)["NUM_SPLITS"] == 16
    out, ref = run_decode(q, k_cache, v_cache, lens, tables, scales, max_seq_len=4096)
    assert_close(out, ref, torch.bfloat16, ATTN)


@FP8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [None, decode_config(6, 16, 16)], ids=["default", "6-splits"])
def test_decode_after_prefill_equals_last_prefill_row(dtype, config, fp8):
    q_lens = [1, 33, 90]
    q, k_cache, v_cache, cu, seq_lens, tables, scales = prefill_inputs([0, 0, 0], q_lens, 8, 2, 128, 32, dtype, fp8)
    prefill_out = prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, **scales)
    last = cu[1:].long() - 1
    decode_out, ref = run_decode(q[last].contiguous(), k_cache, v_cache, seq_lens, tables, scales, config=config)
    assert_close(decode_out, ref, dtype, ATTN)
    assert_close(decode_out, prefill_out[last].double(), dtype, ATTN)


@FP8
@pytest.mark.parametrize("config", [decode_config(1, 256, 16), decode_config(4, 16, 16)], ids=["1-split", "4-splits"])
def test_decode_zero_length_rows_give_zeros(config, fp8):
    # A CUDA-graph batch padded with seq_len 0 rows: zeros there, nothing read through their table.
    seq_lens = [40, 0, 7]
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, 2, 64, 16, torch.float32, fp8)
    q = randn(3, 4, 64, scale=2.0)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, lens, tables, out=poisoned(*q.shape, dtype=q.dtype), config=config,
                           **scales)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = torch.tensor([0, 2], device=DEVICE)
    ref = reference.decode_attention(q[keep].double(), exact(k_cache), exact(v_cache), lens[keep], tables[keep],
                                     **scales)
    assert_close(out[keep], ref, torch.float32, ATTN)


@FP8
def test_decode_launch_is_graph_capturable(monkeypatch, fp8):
    """No host sync in the wrapper, and the grid and scratch shapes depend on shapes only."""
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
                launches.append((self.name, grid, shapes, kwargs.get("NUM_SPLITS")))
            return launch

    monkeypatch.setattr(decode_module, "num_sms", lambda: 132)
    monkeypatch.setattr(decode_module, "_decode_attention_kernel", Recorder("attention"))
    monkeypatch.setattr(decode_module, "_merge_splits_kernel", Recorder("merge"))
    k_cache, v_cache, tables, scales = paged_caches([300, 5], 2, 64, 16, torch.bfloat16, fp8, pad_columns=30)
    q = randn(2, 4, 64, dtype=torch.bfloat16)

    def host_sync(*args, **kwargs):
        raise AssertionError("decode_attention synchronized with the host")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    for lens in ([300, 5], [1, 2]):
        decode_attention(q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32, device=DEVICE), tables, **scales)
    monkeypatch.undo()
    assert len(launches) == 4 and launches[0] == launches[2] and launches[1] == launches[3], launches
    assert launches[0][0] == "attention" and launches[1][0] == "merge" and launches[0][3] > 1, launches


def test_fp8_cache_has_its_own_tuning_bucket():
    # A cache of q's dtype keeps the keys of the shipped configs; an e4m3 cache's are tuned apart.
    bf16 = decode_attention_bucket(torch.bfloat16, 128, 2, 8, 16, 1, 1024)
    assert tuning.bucket_key(bf16) == "bfloat16/128/2/8/16/1/1024"
    assert decode_attention_bucket(torch.bfloat16, 128, 2, 8, 16, 1, 1024, torch.bfloat16) == bf16
    fp8 = decode_attention_bucket(torch.bfloat16, 128, 2, 8, 16, 1, 1024, torch.float8_e4m3fn)
    assert tuning.bucket_key(fp8) == "bfloat16/128/2/8/16/1/1024/float8_e4m3fn"
    k_cache, v_cache, tables, scales = paged_caches([5, 9], 2, 64, 16, torch.bfloat16, fp8=True)
    lens = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    decode_attention(randn(2, 4, 64, dtype=torch.bfloat16), k_cache, v_cache, lens, tables, max_seq_len=100, **scales)
    wanted = decode_attention_bucket(torch.bfloat16, 64, 2, 2, 16, 2, 100, torch.float8_e4m3fn)
    assert decode_module.DECODE_TUNABLE.last_key == tuning.bucket_key(wanted)


def test_decode_rejects_bad_inputs():
    q, k_cache, v_cache, _, seq_lens, tables, _ = prefill_inputs([0, 3], [4, 5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="v_cache"):
        decode_attention(q[:2], k_cache, v_cache[:, :, :1], seq_lens, tables)
    # V neither with k_cache's strides nor key-major; a key-major V beside a non-contiguous k_cache.
    with pytest.raises(ValueError, match="v_cache"):
        decode_attention(q[:2], k_cache, v_cache.transpose(2, 3).contiguous().transpose(2, 3), seq_lens, tables)
    padded = torch.cat([k_cache, k_cache[..., :16]], -1)[..., :64]
    with pytest.raises(ValueError, match="v_cache"):
        decode_attention(q[:2], padded, key_major(v_cache), seq_lens, tables)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(q[:3], k_cache, v_cache, seq_lens, tables)
    # Sequences are the grid's third dimension, which CUDA caps at 65535.
    many = decode_module.MAX_BATCH + 1
    with pytest.raises(ValueError, match="batch"):
        decode_attention(q[:1].expand(many, -1, -1), k_cache, v_cache, seq_lens[:1].repeat(many),
                         tables[:1].expand(many, -1))
    # The scale checks are prefill's (test_prefill_attention.py); here, that decode runs them.
    k8, v8, _, scales = paged_caches([4, 8], 2, 64, 16, torch.float32, fp8=True)
    with pytest.raises(ValueError, match="v_scale"):
        decode_attention(q[:2], k8, v8, seq_lens, tables, k_scale=scales["k_scale"])
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention(q[:2], k_cache, v_cache, seq_lens, tables, **scales)
