"""prefill_attention against the float64 reference, on a NaN-poisoned paged cache.

Every cache row that no sequence owns is NaN and the block-table entries past each sequence point
at NaN blocks (kernel_utils.paged_kv); outputs are NaN-poisoned buffers. A kernel that reads a key
it must not, or skips a row, produces NaN and fails. fp8: the same over an e4m3 cache whose rows
and scales no sequence owns are NaN; the reference dequantizes exactly the values stored, so the
tolerances are those of the model-dtype cache.
"""
import importlib

import pytest
import torch
from kernel_utils import ATTN, DEVICE, DTYPES, assert_close, exact, key_major, poisoned, prefill_inputs, rel_err

from tritonllm.kernels import prefill_attention, reference, tuning
from tritonllm.kernels.kv_cache import is_key_major
from tritonllm.kernels.prefill_attention import PREFILL_TUNABLE, prefill_attention_bucket

# The package exports the function under the module's name: fetch the module itself.
prefill_module = importlib.import_module("tritonllm.kernels.prefill_attention")

# Triton 3.6's interpreter converts loop bounds through a NumPy path that NumPy 2.x deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


FP8 = pytest.mark.parametrize("fp8", [False, True], ids=["model-cache", "fp8-cache"])


def spy_tma(monkeypatch):
    """A list that gets, per launch, whether prefill_attention took the TMA path (cache descriptors)."""
    taken, original = [], prefill_module._cache_descriptors

    def spy(*args):
        descriptors = original(*args)
        taken.append(descriptors is not None)
        return descriptors

    monkeypatch.setattr(prefill_module, "_cache_descriptors", spy)
    return taken


def tma_expected(block_n, block_size):
    """Whether a launch takes the TMA path: tiles inside a block, under the interpreter (CPU tensors)
    or on a GPU with TMA (fresh caches are 16-byte aligned)."""
    return block_n <= block_size and (DEVICE == "cpu" or tuning.has_tma(torch.cuda.current_device()))


def run_prefill(q, k_cache, v_cache, cu, seq_lens, tables, scales, **kwargs):
    out = prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, out=poisoned(*q.shape, dtype=q.dtype),
                            **scales, **kwargs)
    ref = reference.prefill_attention(q.double(), exact(k_cache), exact(v_cache), cu, seq_lens, tables,
                                      kwargs.get("scale"), **scales)
    return out, ref


# (head_dim, Hq, Hkv, block_size, q_lens): GQA 1, 2, 4, 8 and 3; lengths 1, block_size +- 1,
# not multiples of the tile; D 256 takes the narrower default key tiles.
PREFILL_CASES = [
    (64, 4, 4, 16, [1, 15, 16, 17, 70]),
    (128, 4, 2, 32, [31, 32, 33, 100]),
    (64, 8, 2, 64, [1, 65, 130]),
    (128, 8, 1, 128, [127, 129]),
    (64, 6, 2, 256, [1, 255, 257]),
    (256, 2, 1, 16, [1, 17, 40]),
]


@FP8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, num_q_heads, num_kv_heads, block_size, q_lens", PREFILL_CASES)
def test_prefill_matches_reference(head_dim, num_q_heads, num_kv_heads, block_size, q_lens, dtype, fp8):
    inputs = prefill_inputs([0] * len(q_lens), q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, fp8)
    before = [t.clone() for t in (inputs[1], inputs[2], *inputs[6].values())]
    out, ref = run_prefill(*inputs)
    assert_close(out, ref, dtype, ATTN)
    after = (inputs[1], inputs[2], *inputs[6].values())
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before))  # only read


# Prefix-cache hits: (cached, new) pairs around block boundaries, including one new token.
@FP8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, num_q_heads, num_kv_heads, block_size", [(128, 4, 2, 16), (64, 8, 2, 64)])
def test_prefill_prefix_hits(head_dim, num_q_heads, num_kv_heads, block_size, dtype, fp8):
    pairs = [(1, 1), (block_size - 1, 2), (block_size, 30), (37, 64), (2 * block_size + 1, 3), (200, 1)]
    context_lens, q_lens = [c for c, _ in pairs], [n for _, n in pairs]
    inputs = prefill_inputs(context_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, fp8)
    out, ref = run_prefill(*inputs)
    assert_close(out, ref, dtype, ATTN)


def check_chunked(dtype, fp8, v_layout="contiguous", config=None):
    head_dim, num_q_heads, num_kv_heads, block_size = 128, 4, 2, 32
    # Two sequences, chunked differently; a step holds the sequences that have a chunk in it.
    chunks = [[50, 1, 64, 35], [20, 57, 0, 1]]
    total = [sum(c) for c in chunks]
    q, k_cache, v_cache, cu, seq_lens, tables, scales = prefill_inputs([0, 0], total, num_q_heads, num_kv_heads,
                                                                       head_dim, block_size, dtype, fp8, v_layout)
    if config is not None:
        scales = {**scales, "config": config}
    one_shot = prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, **scales)
    chunked = poisoned(*q.shape, dtype=dtype)
    done = [0, 0]
    for step in range(4):
        rows, q_lens, lens, seqs = [], [], [], []
        for b in range(2):
            n = chunks[b][step]
            if n:
                rows.append(torch.arange(cu[b] + done[b], cu[b] + done[b] + n, device=DEVICE))
                done[b] += n
                q_lens.append(n)
                lens.append(done[b])
                seqs.append(b)
        rows = torch.cat(rows)
        step_cu = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
        step_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        chunked[rows] = prefill_attention(q[rows], k_cache, v_cache, step_cu, step_lens, tables[seqs], **scales)
    scales.pop("config", None)
    ref = reference.prefill_attention(q.double(), exact(k_cache), exact(v_cache), cu, seq_lens, tables, **scales)
    assert_close(one_shot, ref, dtype, ATTN)
    assert_close(chunked, ref, dtype, ATTN)
    assert_close(chunked, one_shot.double(), dtype, ATTN)


@FP8
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_equals_one_shot(dtype, fp8):
    check_chunked(dtype, fp8)


# Tilings the default config does not reach: a tile over several blocks (per-key lookup through
# pointers), several tiles per block (TMA descriptors), several query tiles per sequence, BLOCK_Q >
# BLOCK_N and the reverse, idle rows when BLOCK_M is not a multiple of the group (GQA 3). With 33
# cached keys, in every config some full query tile's last row sees exactly one key of a new key tile.
@FP8
@pytest.mark.parametrize("num_q_heads, num_kv_heads, block_size, config", [
    (2, 2, 16, {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}),
    (2, 2, 64, {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}),
    (8, 2, 32, {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}),
    (6, 2, 16, {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}),
    (8, 1, 256, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}),
], ids=["multi-block-tile", "tile-in-block", "gqa4-bq4", "gqa3-idle-rows", "gqa8-bq16"])
def test_prefill_tilings(num_q_heads, num_kv_heads, block_size, config, fp8):
    inputs = prefill_inputs([0, 33, 3], [70, 100, 1], num_q_heads, num_kv_heads, 64, block_size, torch.float32, fp8)
    out, ref = run_prefill(*inputs, config=config)
    assert_close(out, ref, torch.float32, ATTN)


# A key-major V (kernels/kv_cache.py, the engine's fp8 layout) through both load paths: TMA
# descriptors where BLOCK_N <= block_size (tiles of D x BLOCK_N in the block's key-major memory, at
# column offsets 0 or past it), pointers where a tile spans blocks; the tilings of test_prefill_tilings.
KEY_MAJOR_TILINGS = {
    "multi-block-tile": (2, 2, 16, {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}),
    "tile-in-block": (2, 2, 64, {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}),
    "gqa4-bq4": (8, 2, 32, {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}),
    "gqa8-bq16": (8, 1, 256, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}),
}


@pytest.mark.parametrize("fp8, tiling, scale_layout", [
    (True, "multi-block-tile", "contiguous"), (True, "tile-in-block", "contiguous"), (True, "gqa4-bq4", "contiguous"),
    (True, "gqa8-bq16", "contiguous"), (True, "multi-block-tile", "head_major"), (True, "tile-in-block", "head_major"),
    (False, "multi-block-tile", "contiguous"), (False, "tile-in-block", "contiguous"),
], ids=lambda x: {True: "fp8-cache", False: "model-cache", "head_major": "head-major-scales",
                  "contiguous": "scales-contiguous"}.get(x, x))
def test_prefill_tilings_key_major_v(monkeypatch, fp8, tiling, scale_layout):
    num_q_heads, num_kv_heads, block_size, config = KEY_MAJOR_TILINGS[tiling]
    inputs = prefill_inputs([0, 33, 3], [70, 100, 1], num_q_heads, num_kv_heads, 64, block_size, torch.float32, fp8,
                            v_layout="key_major", scale_layout=scale_layout)
    v_cache = inputs[2]
    assert is_key_major(v_cache) and inputs[1].is_contiguous()
    before = v_cache.clone()
    taken = spy_tma(monkeypatch)
    out, ref = run_prefill(*inputs, config=config)
    assert taken == [tma_expected(config["BLOCK_N"], block_size)]
    assert_close(out, ref, torch.float32, ATTN)
    assert torch.equal(v_cache.view(torch.uint8) if fp8 else v_cache.nan_to_num(7.0),
                       before.view(torch.uint8) if fp8 else before.nan_to_num(7.0))  # only read


# Prefix-cache hits over a key-major e4m3 V, odd lengths around blocks of 16: the default config
# (BLOCK_N 128 > block_size, pointer loads) and one of BLOCK_N = block_size (TMA).
@pytest.mark.parametrize("config", [None, {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}],
                         ids=["default", "tma"])
def test_prefill_prefix_hits_key_major_v(monkeypatch, config):
    pairs = [(1, 1), (15, 2), (16, 30), (37, 64), (33, 3), (200, 1), (0, 19)]
    context_lens, q_lens = [c for c, _ in pairs], [n for _, n in pairs]
    inputs = prefill_inputs(context_lens, q_lens, 4, 2, 128, 16, torch.bfloat16, fp8=True, v_layout="key_major")
    taken = spy_tma(monkeypatch)
    out, ref = run_prefill(*inputs, config=config)
    if config is None and tuning.INTERPRET:  # the default (a GPU may have a tuned one): BLOCK_N 128 > 16
        config = prefill_module._prefill_default("bfloat16", 128, 2, 16, max(q_lens), "float8_e4m3fn")
        assert config["BLOCK_N"] > 16
    if config is not None:
        assert taken == [tma_expected(config["BLOCK_N"], 16)]
    assert_close(out, ref, torch.bfloat16, ATTN)


# Chunked prefill over a key-major e4m3 V (odd chunks: 1, 35, 57), pointer loads and TMA (BLOCK_N 32).
@pytest.mark.parametrize("config", [None, {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}],
                         ids=["default", "tma"])
def test_chunked_prefill_key_major_v(config):
    check_chunked(torch.bfloat16, True, "key_major", config)


@FP8
def test_prefill_non_contiguous_cache_takes_pointer_loads(fp8):
    # Caches padded in head_dim cannot be viewed as [rows, Hkv * D] for TMA: the same tiling as
    # "tile-in-block" then loads through pointers, with the padding (NaN) never read.
    q, k_cache, v_cache, cu, seq_lens, tables, scales = prefill_inputs([0, 33, 3], [70, 100, 1], 2, 2, 64, 64,
                                                                       torch.float32, fp8)
    padded = [torch.cat([c, torch.full_like(c[..., :16], float("nan"))], -1)[..., :64] for c in (k_cache, v_cache)]
    assert not padded[0].is_contiguous()
    out, ref = run_prefill(q, *padded, cu, seq_lens, tables, scales,
                           config={"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1})
    assert_close(out, ref, torch.float32, ATTN)


def test_prefill_scale_hint_and_out_buffer():
    q, k_cache, v_cache, cu, seq_lens, tables, _ = prefill_inputs([5, 0], [20, 9], 4, 2, 64, 16, torch.float16)
    buffer = poisoned(*q.shape, dtype=q.dtype)
    # A generous max_q_len only launches query tiles that exit at once.
    out = prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale=0.3, max_q_len=100, out=buffer)
    assert out is buffer
    ref = reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, seq_lens, tables, 0.3)
    assert_close(out, ref, torch.float16, ATTN)
    assert rel_err(out, reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu,
                                                    seq_lens, tables)) > 0.05  # the scale mattered


def test_fp8_cache_has_its_own_tuning_bucket():
    # A cache of q's dtype keeps the keys of the shipped configs; an e4m3 cache's are tuned apart.
    bf16 = prefill_attention_bucket(torch.bfloat16, 128, 2, 16, 4096)
    assert tuning.bucket_key(bf16) == "bfloat16/128/2/16/1024"
    assert prefill_attention_bucket(torch.bfloat16, 128, 2, 16, 4096, torch.bfloat16) == bf16
    fp8 = prefill_attention_bucket(torch.bfloat16, 128, 2, 16, 4096, torch.float8_e4m3fn)
    assert tuning.bucket_key(fp8) == "bfloat16/128/2/16/1024/float8_e4m3fn"
    q, k_cache, v_cache, cu, seq_lens, tables, scales = prefill_inputs([0, 3], [4, 5], 4, 2, 64, 16, torch.bfloat16,
                                                                       fp8=True)
    prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, max_q_len=5, **scales)
    wanted = prefill_attention_bucket(torch.bfloat16, 64, 2, 16, 5, torch.float8_e4m3fn)
    assert PREFILL_TUNABLE.last_key == tuning.bucket_key(wanted)


def test_prefill_rejects_bad_inputs():
    q, k_cache, v_cache, cu, seq_lens, tables, _ = prefill_inputs([0, 3], [4, 5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of k_cache heads"):
        prefill_attention(q[:, :3], k_cache, v_cache, cu, seq_lens, tables)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prefill_attention(q, k_cache, v_cache, cu[:-1], seq_lens, tables)
    with pytest.raises(ValueError, match="block_tables"):
        prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables[:1])
    with pytest.raises(ValueError, match="dtype"):
        prefill_attention(q.half(), k_cache, v_cache, cu, seq_lens, tables)
    with pytest.raises(ValueError, match="block_size"):
        odd = k_cache[:, :12]
        prefill_attention(q, odd, odd, cu, seq_lens, tables)
    # V neither with k_cache's strides nor key-major; a key-major V beside a non-contiguous k_cache.
    with pytest.raises(ValueError, match="v_cache"):
        prefill_attention(q, k_cache, v_cache.transpose(2, 3).contiguous().transpose(2, 3), cu, seq_lens, tables)
    padded = torch.cat([k_cache, k_cache[..., :16]], -1)[..., :64]
    with pytest.raises(ValueError, match="v_cache"):
        prefill_attention(q, padded, key_major(v_cache), cu, seq_lens, tables)


def test_a_loose_max_q_len_sizes_the_grid_by_the_tokens():
    # max_q_len only needs to bound the longest query; one far past every query (past what the grid
    # can hold) gives the same output, and more sequences than the grid holds is a named error.
    q, k_cache, v_cache, cu, seq_lens, tables, _ = prefill_inputs([0, 3], [4, 5], 4, 2, 64, 16, torch.float32)
    exact_bound = prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, max_q_len=5)
    assert torch.equal(prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, max_q_len=2**40), exact_bound)
    many = 65536
    with pytest.raises(ValueError, match="seq_lens"):
        prefill_attention(q[:0], k_cache, v_cache, torch.zeros(many + 1, dtype=torch.int32),
                          torch.zeros(many, dtype=torch.int32), torch.zeros(many, 1, dtype=torch.int32))


def test_prefill_rejects_bad_scales():
    # Every check names the argument at fault; all raise before any launch.
    q, k_cache, v_cache, cu, seq_lens, tables, scales = prefill_inputs([0, 3], [4, 5], 4, 2, 64, 16, torch.bfloat16,
                                                                       fp8=True)
    k_scale, v_scale = scales["k_scale"], scales["v_scale"]
    with pytest.raises(ValueError, match="k_scale"):
        prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables)
    with pytest.raises(ValueError, match="v_scale"):
        prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, k_scale=k_scale)
    with pytest.raises(ValueError, match="k_scale"):
        prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, k_scale=k_scale[:, :8], v_scale=v_scale)
    with pytest.raises(ValueError, match="v_scale"):
        prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, k_scale=k_scale, v_scale=v_scale.double())
    with pytest.raises(ValueError, match="v_scale"):
        prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, k_scale=k_scale,
                          v_scale=v_scale.transpose(0, 1).contiguous().transpose(0, 1))
    bf16 = [c.to(torch.bfloat16) for c in (k_cache, v_cache)]
    with pytest.raises(ValueError, match="k_scale"):
        prefill_attention(q, *bf16, cu, seq_lens, tables, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(ValueError, match="v_cache"):
        prefill_attention(q, k_cache, bf16[1], cu, seq_lens, tables, k_scale=k_scale, v_scale=v_scale)
    with pytest.raises(TypeError, match="q must be"):
        prefill_attention(q.to(torch.float8_e4m3fn), k_cache, v_cache, cu, seq_lens, tables, **scales)
