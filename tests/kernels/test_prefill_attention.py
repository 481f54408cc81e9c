"""prefill_attention against the float64 reference, on a NaN-poisoned paged cache.

Every cache row that no sequence owns is NaN and the block-table entries past each sequence point
at NaN blocks (kernel_utils.paged_kv); outputs are NaN-poisoned buffers. A kernel that reads a key
it must not, or skips a row, produces NaN and fails.
"""
import pytest
import torch
from kernel_utils import ATTN, DEVICE, DTYPES, assert_close, poisoned, prefill_inputs, rel_err

from tritonllm.kernels import prefill_attention, reference

# Triton 3.6's interpreter converts loop bounds through a NumPy path that NumPy 2.x deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def run_prefill(q, k_cache, v_cache, cu, seq_lens, tables, **kwargs):
    out = prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, out=poisoned(*q.shape, dtype=q.dtype), **kwargs)
    ref = reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, seq_lens, tables,
                                      kwargs.get("scale"))
    return out, ref


# (head_dim, Hq, Hkv, block_size, q_lens): GQA 1, 2, 4, 8 and 3; lengths 1, block_size +- 1,
# not multiples of the tile.
PREFILL_CASES = [
    (64, 4, 4, 16, [1, 15, 16, 17, 70]),
    (128, 4, 2, 32, [31, 32, 33, 100]),
    (64, 8, 2, 64, [1, 65, 130]),
    (128, 8, 1, 128, [127, 129]),
    (64, 6, 2, 256, [1, 255, 257]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, num_q_heads, num_kv_heads, block_size, q_lens", PREFILL_CASES)
def test_prefill_matches_reference(head_dim, num_q_heads, num_kv_heads, block_size, q_lens, dtype):
    inputs = prefill_inputs([0] * len(q_lens), q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    k_before = inputs[1].clone()
    out, ref = run_prefill(*inputs)
    assert_close(out, ref, dtype, ATTN)
    assert torch.equal(inputs[1].nan_to_num(7.0), k_before.nan_to_num(7.0))  # the cache is only read


# Prefix-cache hits: (cached, new) pairs around block boundaries, including one new token.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, num_q_heads, num_kv_heads, block_size", [(128, 4, 2, 16), (64, 8, 2, 64)])
def test_prefill_prefix_hits(head_dim, num_q_heads, num_kv_heads, block_size, dtype):
    pairs = [(1, 1), (block_size - 1, 2), (block_size, 30), (37, 64), (2 * block_size + 1, 3), (200, 1)]
    context_lens, q_lens = [c for c, _ in pairs], [n for _, n in pairs]
    inputs = prefill_inputs(context_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    out, ref = run_prefill(*inputs)
    assert_close(out, ref, dtype, ATTN)


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_equals_one_shot(dtype):
    head_dim, num_q_heads, num_kv_heads, block_size = 128, 4, 2, 32
    # Two sequences, chunked differently; a step holds the sequences that have a chunk in it.
    chunks = [[50, 1, 64, 35], [20, 57, 0, 1]]
    total = [sum(c) for c in chunks]
    q, k_cache, v_cache, cu, seq_lens, tables = prefill_inputs([0, 0], total, num_q_heads, num_kv_heads,
                                                               head_dim, block_size, dtype)
    one_shot = prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables)
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
        chunked[rows] = prefill_attention(q[rows], k_cache, v_cache, step_cu, step_lens, tables[seqs])
    ref = reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, seq_lens, tables)
    assert_close(one_shot, ref, dtype, ATTN)
    assert_close(chunked, ref, dtype, ATTN)
    assert_close(chunked, one_shot.double(), dtype, ATTN)


# Tilings the default config does not reach: a tile over several blocks (per-key lookup through
# pointers), several tiles per block (TMA descriptors), several query tiles per sequence, BLOCK_Q >
# BLOCK_N and the reverse, idle rows when BLOCK_M is not a multiple of the group (GQA 3). With 33
# cached keys, in every config some full query tile's last row sees exactly one key of a new key tile.
@pytest.mark.parametrize("num_q_heads, num_kv_heads, block_size, config", [
    (2, 2, 16, {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}),
    (2, 2, 64, {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}),
    (8, 2, 32, {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}),
    (6, 2, 16, {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}),
    (8, 1, 256, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}),
], ids=["multi-block-tile", "tile-in-block", "gqa4-bq4", "gqa3-idle-rows", "gqa8-bq16"])
def test_prefill_tilings(num_q_heads, num_kv_heads, block_size, config):
    inputs = prefill_inputs([0, 33, 3], [70, 100, 1], num_q_heads, num_kv_heads, 64, block_size, torch.float32)
    out, ref = run_prefill(*inputs, config=config)
    assert_close(out, ref, torch.float32, ATTN)


def test_prefill_non_contiguous_cache_takes_pointer_loads():
    # Caches padded in head_dim cannot be viewed as [rows, Hkv * D] for TMA: the same tiling as
    # "tile-in-block" then loads through pointers, with the padding (NaN) never read.
    q, k_cache, v_cache, cu, seq_lens, tables = prefill_inputs([0, 33, 3], [70, 100, 1], 2, 2, 64, 64, torch.float32)
    padded = [torch.cat([c, torch.full_like(c[..., :16], float("nan"))], -1)[..., :64] for c in (k_cache, v_cache)]
    assert not padded[0].is_contiguous()
    out, ref = run_prefill(q, *padded, cu, seq_lens, tables,
                           config={"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1})
    assert_close(out, ref, torch.float32, ATTN)


def test_prefill_scale_hint_and_out_buffer():
    q, k_cache, v_cache, cu, seq_lens, tables = prefill_inputs([5, 0], [20, 9], 4, 2, 64, 16, torch.float16)
    buffer = poisoned(*q.shape, dtype=q.dtype)
    # A generous max_q_len only launches query tiles that exit at once.
    out = prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale=0.3, max_q_len=100, out=buffer)
    assert out is buffer
    ref = reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, seq_lens, tables, 0.3)
    assert_close(out, ref, torch.float16, ATTN)
    assert rel_err(out, reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu,
                                                    seq_lens, tables)) > 0.05  # the scale mattered


def test_prefill_rejects_bad_inputs():
    q, k_cache, v_cache, cu, seq_lens, tables = prefill_inputs([0, 3], [4, 5], 4, 2, 64, 16, torch.float32)
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
