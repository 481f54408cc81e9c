"""The Hopper (warp-specialized Gluon) path of prefill_attention against the float64 reference.

The same NaN-poisoned paged caches as test_prefill_attention.py: cache rows no sequence owns are
NaN, so a tile whose last cache block runs past the sequence must zero those V rows, and a
block-table entry read past the sequence would bring NaN. Run on an sm_90 GPU; elsewhere only the
path choice and its errors are checked (its sm_90 compile is in test_compile.py).
"""
import importlib

import pytest
import torch
from kernel_utils import ATTN, HOPPER, assert_close, prefill_inputs
from test_prefill_attention import PREFILL_CASES, check_chunked, run_prefill

from tritonllm.kernels import prefill_attention, reference
from tritonllm.kernels.prefill_attention import prefill_attention_bucket
from tritonllm.kernels.prefill_attention_hopper import HOPPER_TUNABLE

prefill_module = importlib.import_module("tritonllm.kernels.prefill_attention")
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel runs on sm_90 GPUs only")
HALF = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])


def spy_paths(monkeypatch):
    """A list that gets "hopper" for each launch of the Gluon kernel."""
    taken, original = [], prefill_module.prefill_attention_hopper

    def spy(*args):
        taken.append("hopper")
        return original(*args)

    monkeypatch.setattr(prefill_module, "prefill_attention_hopper", spy)
    return taken


@needs_hopper
@HALF
@pytest.mark.parametrize("head_dim, num_q_heads, num_kv_heads, block_size, q_lens", PREFILL_CASES)
def test_hopper_matches_reference_in_every_config(head_dim, num_q_heads, num_kv_heads, block_size, q_lens, dtype):
    inputs = prefill_inputs([0] * len(q_lens), q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    bucket = ("", head_dim, num_q_heads // num_kv_heads, block_size, max(q_lens))
    for config in HOPPER_TUNABLE.space(*bucket):
        out, ref = run_prefill(*inputs, path="hopper", config=config)
        assert_close(out, ref, dtype, ATTN)


@needs_hopper
@HALF
@pytest.mark.parametrize("head_dim, num_q_heads, num_kv_heads, block_size", [(128, 4, 2, 16), (64, 8, 2, 64),
                                                                              (128, 16, 8, 256)])
def test_hopper_prefix_hits(head_dim, num_q_heads, num_kv_heads, block_size, dtype):
    # Cached keys around block and tile boundaries, down to one new token; a 3-tile prefix.
    pairs = [(1, 1), (block_size - 1, 2), (block_size, 30), (37, 64), (2 * block_size + 1, 3), (200, 1), (385, 130)]
    inputs = prefill_inputs([c for c, _ in pairs], [n for _, n in pairs], num_q_heads, num_kv_heads, head_dim,
                            block_size, dtype)
    for config in ({"BLOCK_M": 64, "BLOCK_N": 64, "NUM_STAGES": 2}, {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_STAGES": 2}):
        out, ref = run_prefill(*inputs, path="hopper", config=config)
        assert_close(out, ref, dtype, ATTN)


@needs_hopper
@HALF
def test_hopper_chunked_prefill_equals_one_shot(dtype, monkeypatch):
    taken = spy_paths(monkeypatch)
    monkeypatch.setattr(prefill_module, "HOPPER_MIN_WORK", 0)  # "auto" takes the Gluon kernel for any size
    check_chunked(dtype, False)
    assert taken and set(taken) == {"hopper"}


@needs_hopper
def test_auto_takes_hopper_from_its_minimum_work(monkeypatch):
    # One sequence of S new tokens is S * S of work: the Gluon kernel from 2048 (2^22) on.
    taken = spy_paths(monkeypatch)
    for new_tokens, expected in [(2047, []), (2048, ["hopper"]), (64, [])]:
        taken.clear()
        inputs = prefill_inputs([0], [new_tokens], 4, 2, 64, 16, torch.bfloat16)
        out, ref = run_prefill(*inputs)
        assert taken == expected, new_tokens
        assert_close(out, ref, torch.bfloat16, ATTN)
    monkeypatch.setattr(prefill_module, "HOPPER_MIN_WORK", 64 * 64)
    run_prefill(*prefill_inputs([0], [64], 4, 2, 64, 16, torch.bfloat16))
    assert taken == ["hopper"]


@needs_hopper
def test_auto_takes_hopper_only_where_it_applies(monkeypatch):
    taken = spy_paths(monkeypatch)
    monkeypatch.setattr(prefill_module, "HOPPER_MIN_WORK", 0)
    for dtype, fp8, v_layout, expected in [(torch.bfloat16, False, "contiguous", ["hopper"]),
                                           (torch.float32, False, "contiguous", []),
                                           (torch.bfloat16, True, "contiguous", []),
                                           (torch.bfloat16, False, "key_major", [])]:
        taken.clear()
        inputs = prefill_inputs([3, 0], [40, 9], 4, 2, 64, 16, dtype, fp8, v_layout)
        out, ref = run_prefill(*inputs)
        assert taken == expected, (dtype, fp8, v_layout)
        assert_close(out, ref, dtype, ATTN)


def off_boundary(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of t (NaN if it is None) that starts `offset` elements past a 16-byte boundary."""
    shifted = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)[offset:].view(t.shape)
    return shifted.copy_(t)


@needs_hopper
@pytest.mark.parametrize("offset", [1, 4, 8, 16])
def test_q_and_out_off_16_byte_boundaries(offset, monkeypatch):
    # q 2 or 8 bytes off a 16-byte boundary (8 and 16 elements land on one), or rows D + offset elements
    # apart (Triton proves 16-byte alignment only from strides of multiples of 16): the Hopper kernel's
    # 16-byte cp.async cannot read such a q (its compile failed), so auto takes the portable kernel; an
    # out off the boundary is fine.
    taken = spy_paths(monkeypatch)
    monkeypatch.setattr(prefill_module, "HOPPER_MIN_WORK", 0)
    q, k_cache, v_cache, cu, seq_lens, tables, _ = prefill_inputs([3, 0], [40, 9], 4, 2, 64, 16, torch.bfloat16)
    ref = reference.prefill_attention(q.double(), k_cache.double(), v_cache.double(), cu, seq_lens, tables)
    nan = torch.full_like(q, float("nan"))
    for q_in, out in ((off_boundary(q, offset), nan.clone()), (q, off_boundary(nan, offset))):
        taken.clear()
        prefill_attention(q_in, k_cache, v_cache, cu, seq_lens, tables, out=out)
        assert taken == ([] if q_in.data_ptr() % 16 else ["hopper"])
        assert_close(out, ref, torch.bfloat16, ATTN)
    if offset % 8:
        with pytest.raises(ValueError, match="16-byte aligned"):
            prefill_attention(off_boundary(q, offset), k_cache, v_cache, cu, seq_lens, tables, path="hopper")
    wide = torch.empty(*q.shape[:2], q.shape[2] + offset, dtype=q.dtype, device=q.device)[..., :q.shape[2]]
    wide.copy_(q)  # rows q.shape[2] + offset elements apart
    taken.clear()
    out = prefill_attention(wide, k_cache, v_cache, cu, seq_lens, tables, out=nan.clone())
    assert taken == ([] if offset % 16 else ["hopper"])
    assert_close(out, ref, torch.bfloat16, ATTN)


def test_path_errors():
    q, k_cache, v_cache, cu, seq_lens, tables, _ = prefill_inputs([0, 3], [4, 5], 4, 2, 64, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="path must be one of"):
        prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, path="gluon")
    # float32 never takes the Gluon kernel; nor does anything off an sm_90 GPU.
    with pytest.raises(ValueError, match="path='hopper' needs"):
        prefill_attention(q.float(), k_cache.float(), v_cache.float(), cu, seq_lens, tables, path="hopper")
    if not HOPPER:
        with pytest.raises(ValueError, match="path='hopper' needs"):
            prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, path="hopper")
    # A config is the chosen path's: the portable kernel's keys differ from the Hopper kernel's.
    with pytest.raises(ValueError, match="config of the portable path takes the keys"):
        prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, path="portable",
                          config={"BLOCK_M": 64, "BLOCK_N": 64, "NUM_STAGES": 2})


@needs_hopper
@pytest.mark.parametrize("programs", [1, 2, 3])
def test_hopper_few_programs_walk_every_item(programs, monkeypatch):
    # Fewer programs than work items: each program runs many items in turn (the K/V ring's slots
    # and phases carried across items of different sequences, tiles past a query skipped).
    hopper_module = importlib.import_module("tritonllm.kernels.prefill_attention_hopper")
    monkeypatch.setattr(hopper_module, "_sm_count", lambda device: programs)
    pairs = [(0, 70), (33, 100), (3, 1), (200, 17), (0, 129), (15, 2)]
    inputs = prefill_inputs([c for c, _ in pairs], [n for _, n in pairs], 8, 2, 128, 16, torch.bfloat16)
    for config in ({"BLOCK_M": 64, "BLOCK_N": 64, "NUM_STAGES": 2}, {"BLOCK_M": 128, "BLOCK_N": 64, "NUM_STAGES": 3}):
        out, ref = run_prefill(*inputs, path="hopper", config=config)
        assert_close(out, ref, torch.bfloat16, ATTN)


def test_hopper_buckets_reach_longer_queries():
    # The portable kernel's buckets stop at 1k query rows; the Hopper kernel's go on to 16k.
    portable = [prefill_attention_bucket(torch.bfloat16, 128, 2, 16, n)[4] for n in (1000, 1025, 16384)]
    hopper = [prefill_attention_bucket(torch.bfloat16, 128, 2, 16, n, hopper=True)[4] for n in (1000, 1025, 16384, 99999)]
    assert portable == [1024, 1024, 1024] and hopper == [1024, 2048, 16384, 16384]
