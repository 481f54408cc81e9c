import pytest
import torch
import kernel_utils
from kernel_utils import DEVICE, DTYPES, key_major, poisoned, randn, with_scale_layout, with_v_layout
from test_fp8 import assert_e4m3_rows_match, e4m3_poisoned

from tritonllm.kernels import gather_kv_blocks, qk_norm_rotary_store, reference
from tritonllm.kernels import qk_norm_rotary as module
from tritonllm.kernels.kv_cache import is_key_major
from tritonllm.kernels.tuning import INTERPRET, bucket_key
from tritonllm.layers import rotary

MAX_POS = 4096

# Relative error ||out - ref|| / ||ref|| against the same-dtype reference, which rounds at the same
# points: only float32 rounding-order differences remain. Under the interpreter float32 -> bf16
# casts truncate, at each of the three rounding points (normed, times weight, rotated): ~1e-2.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-4, torch.bfloat16: 2.5e-2 if INTERPRET else 2e-3}


def assert_close(out, ref, dtype):
    kernel_utils.assert_close(out, ref, dtype, tolerance=TOLERANCE)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def cos_sin_cache(max_pos, head_dim, yarn=None):
    return rotary.cos_sin_cache(head_dim, max_pos, 1e6, yarn).to(DEVICE)


def make_inputs(tokens, q_heads, kv_heads, head_dim, block_size, dtype, pad=0, index_dtype=torch.int64, slots=None):
    """Fresh random inputs; qkv is a [T, W] view of a [T, W + pad] buffer whose padding is NaN; slots
    random (some negative) unless given."""
    width = (q_heads + 2 * kv_heads) * head_dim
    buffer = randn(tokens, width + pad, dtype=dtype)
    buffer[:, width:] = float("nan")  # read by mistake, it would poison q or the caches
    qkv = buffer[:, :width]
    q_weight, k_weight = randn(head_dim, dtype=dtype), randn(head_dim, dtype=dtype)
    positions = torch.randperm(MAX_POS, device=DEVICE)[:tokens].to(index_dtype)  # random order
    num_blocks = (tokens + block_size - 1) // block_size + 2
    if slots is None:
        slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens].to(index_dtype)
        slots[3::4] = -1  # padding rows: no KV write, q still produced
        slots[7::8] = -5
    else:
        slots = slots.to(device=DEVICE, dtype=index_dtype)
        num_blocks = max(num_blocks, int(slots.max()) // block_size + 1)
    k_cache = poisoned(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    return buffer, qkv, q_weight, k_weight, positions, slots, k_cache, k_cache.clone()


def check(tokens, q_heads, kv_heads, head_dim, block_size, dtype, pad=0, index_dtype=torch.int64, with_out=False,
          yarn=None, fp8=False, v_layout="contiguous", scale_layout="contiguous", slots=None):
    buffer, qkv, q_weight, k_weight, positions, slots, k_cache, v_cache = make_inputs(
        tokens, q_heads, kv_heads, head_dim, block_size, dtype, pad, index_dtype, slots)
    scales = {}
    if fp8:  # e4m3 caches of NaN patterns, NaN scales
        k_cache, v_cache = e4m3_poisoned(*k_cache.shape), e4m3_poisoned(*k_cache.shape)
        scales = {name: with_scale_layout(poisoned(*k_cache.shape[:3], dtype=torch.float32), scale_layout)
                  for name in ("k_scale", "v_scale")}
    v_cache = with_v_layout(v_cache, v_layout)  # "key_major": the reference writes the same layout
    cache = cos_sin_cache(MAX_POS, head_dim, yarn)
    buffer_before = buffer.clone()
    ref_k, ref_v = k_cache.clone(), with_v_layout(v_cache.contiguous(), v_layout)
    ref_scales = {name: scale.clone() for name, scale in scales.items()}
    eps = 1e-6
    ref_q = reference.qk_norm_rotary_store(positions, qkv, q_weight, k_weight, eps, cache, ref_k, ref_v, slots,
                                           q_heads, kv_heads, **ref_scales)
    out = poisoned(tokens, q_heads, head_dim, dtype=dtype) if with_out else None
    q = qk_norm_rotary_store(positions, qkv, q_weight, k_weight, eps, cache, k_cache, v_cache, slots,
                             q_heads, kv_heads, out=out, **scales)

    assert q.shape == (tokens, q_heads, head_dim) and q.dtype == dtype and q.is_contiguous()
    if with_out:
        assert q.data_ptr() == out.data_ptr()
    assert_close(q, ref_q, dtype)
    assert is_key_major(v_cache) == is_key_major(ref_v) == (v_layout == "key_major")
    # Nothing but q and the cache slots is written: qkv (padding included) is untouched.
    assert torch.equal(buffer.nan_to_num(7.0), buffer_before.nan_to_num(7.0))
    written = slots[slots >= 0].long()
    if fp8:
        # V's codes and scales as the reference's; K's too, but where the interpreter truncates
        # K's bfloat16 roundings (normed, times weight): there its values within the q tolerance.
        k_tolerance = TOLERANCE[dtype] if INTERPRET and dtype == torch.bfloat16 else None
        assert_e4m3_rows_match(k_cache, scales["k_scale"], ref_k, ref_scales["k_scale"], k_tolerance)
        assert_e4m3_rows_match(v_cache, scales["v_scale"], ref_v, ref_scales["v_scale"])
        assert int((~scales["k_scale"].isnan()).sum()) == len(written) * kv_heads
        return
    # Cache: exactly the slots >= 0 written (the rest still NaN), k matching, v bit-exact.
    assert torch.equal(k_cache.isnan(), ref_k.isnan()) and torch.equal(v_cache.isnan(), ref_v.isnan())
    assert int(torch.isfinite(k_cache).all(-1).all(-1).sum()) == len(written)
    assert int(torch.isnan(k_cache).all(-1).all(-1).sum()) == k_cache.shape[0] * k_cache.shape[1] - len(written)
    if len(written):
        rows = lambda c: c.view(-1, kv_heads, head_dim)[written]  # noqa: E731
        assert_close(rows(k_cache), rows(ref_k), dtype)
    assert torch.equal(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0))


# tokens, q heads, kv heads (GQA 1/2/4/8), head dim, block size, qkv row padding
CASES = [
    (1, 2, 2, 64, 16, 0),
    (7, 4, 2, 128, 256, 0),
    (100, 8, 2, 64, 16, 0),
    (7, 8, 1, 128, 16, 24),
    (100, 2, 2, 128, 256, 64),
    (1, 16, 2, 128, 256, 0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim, block_size, pad", CASES)
def test_qk_norm_rotary_store(tokens, q_heads, kv_heads, head_dim, block_size, pad, dtype):
    check(tokens, q_heads, kv_heads, head_dim, block_size, dtype, pad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim, block_size, pad", CASES)
def test_qk_norm_rotary_store_fp8(tokens, q_heads, kv_heads, head_dim, block_size, pad, dtype):
    check(tokens, q_heads, kv_heads, head_dim, block_size, dtype, pad, fp8=True)


# A key-major V (kernels/kv_cache.py): the same checks, the reference storing into the same layout;
# GQA 4 over blocks of 16, one KV head over blocks of 16 with padded qkv rows, a head dim of 80.
@pytest.mark.parametrize("fp8, scale_layout", [(False, "contiguous"), (True, "contiguous"), (True, "head_major")],
                         ids=["model-cache", "fp8-cache", "fp8-cache-head-major-scales"])
@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim, block_size, pad, dtype", [
    (100, 8, 2, 64, 16, 0, torch.bfloat16),
    (7, 8, 1, 128, 256, 24, torch.float32),
    (5, 6, 2, 80, 16, 8, torch.float16),
])
def test_qk_norm_rotary_store_key_major_v(tokens, q_heads, kv_heads, head_dim, block_size, pad, dtype, fp8,
                                          scale_layout):
    check(tokens, q_heads, kv_heads, head_dim, block_size, dtype, pad, fp8=fp8, v_layout="key_major",
          scale_layout=scale_layout)


def test_key_major_v_equals_contiguous_v():
    # The same inputs into both layouts: the same V values, bit for bit, read through indexing.
    _, qkv, q_weight, k_weight, positions, slots, k_cache, _ = make_inputs(9, 4, 2, 64, 16, torch.bfloat16, pad=8)
    scales = [{name: poisoned(*k_cache.shape[:3], dtype=torch.float32) for name in ("k_scale", "v_scale")}
              for _ in range(2)]
    caches = [(e4m3_poisoned(*k_cache.shape), e4m3_poisoned(*k_cache.shape)) for _ in range(2)]
    caches[1] = caches[1][0], key_major(caches[1][1])
    cache = cos_sin_cache(MAX_POS, 64)
    for (k, v), scale in zip(caches, scales):
        qk_norm_rotary_store(positions, qkv, q_weight, k_weight, 1e-6, cache, k, v, slots, 4, 2, **scale)
    for flat, major in zip(*caches):  # K, then V
        assert torch.equal(flat.view(torch.uint8), major.view(torch.uint8))
    assert torch.equal(scales[0]["v_scale"].nan_to_num(7.0), scales[1]["v_scale"].nan_to_num(7.0))
    written = slots[slots >= 0].long()
    assert not caches[1][1][written // 16, written % 16].float().isnan().any()


def prompt_slots(tokens, block_size):
    """Slots as a prefill step's prompts take them: 40 from the first block start past key 100, 8 from
    key 8, 16 from key 67 (off every alignment), 34 from 16 keys into a later block (one run, 16 off a
    multiple of 32; across a block of 32's end), then single rows and padding (< 0)."""
    first = block_size * -(-100 // block_size)
    second = block_size * -(-(first + 40) // block_size) + 16
    runs = [torch.arange(first, first + 40), torch.arange(8, 16), torch.arange(67, 83),
            torch.arange(second, second + 34)]
    after = second + 34 + block_size
    rest = torch.tensor([after + 1, -1, after + 7, after + 8, -5])
    return torch.cat(runs + [rest])[:tokens]


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("tokens_per_program", [2, 4, 8])
@pytest.mark.parametrize("tokens, kv_heads, head_dim, block_size",
                         [(103, 2, 64, 16), (75, 3, 80, 64), (103, 1, 64, 32), (24, 2, 64, 6)])
def test_runs_of_a_prompts_slots(monkeypatch, tokens_per_program, direct, tokens, kv_heads, head_dim, block_size):
    # Into an e4m3 key-major V, a program whose tokens' slots are one aligned run stores each
    # (head, d) row's codes at once; other programs code by code. In blocks of 32 or more keys V goes
    # to programs of 32 tokens and a head instead, with the same rule: of the 32-token groups here
    # the first is a run, the second mixed, the third contiguous but unaligned, the last partial.
    # 3 KV heads and a head dim of 80 leave masked lanes in every row; blocks of 6 hold no aligned run.
    monkeypatch.setattr(module._TUNING, "default", lambda *bucket: {
        "TOKENS": tokens_per_program, "num_warps": 2, "num_stages": 1, "DIRECT_STORES": direct})
    check(tokens, 6, kv_heads, head_dim, block_size, torch.float16, fp8=True, v_layout="key_major",
          scale_layout="head_major", slots=prompt_slots(tokens, block_size))


# Copies (k_copy, v_copy, copy_slots), as prefill over an fp8 cache takes them: each stored row
# again at its copy slot, bit for bit what gather_kv_blocks copies out of the kernel's own cache
# (layers/attention.py mixes the two) and close to the reference store's copies; rows whose slot or
# copy slot is negative, and every other copy slot, stay NaN.
@pytest.mark.parametrize("fp8, v_layout, scale_layout", [(False, "contiguous", "contiguous"),
                                                         (True, "contiguous", "contiguous"),
                                                         (True, "key_major", "head_major")],
                         ids=["model-cache", "fp8-cache", "fp8-key-major-v-head-major-scales"])
@pytest.mark.parametrize("runs", [False, True], ids=["", "prompt-runs"])
@pytest.mark.parametrize("tokens, q_heads, kv_heads, head_dim, block_size, dtype", [
    (37, 8, 2, 64, 16, torch.bfloat16),
    (7, 4, 1, 128, 256, torch.float32),
    (5, 6, 2, 80, 16, torch.float16),
    (70, 4, 2, 64, 32, torch.bfloat16),
])
def test_copies_of_the_stored_rows(tokens, q_heads, kv_heads, head_dim, block_size, dtype, fp8, v_layout,
                                   scale_layout, runs, monkeypatch):
    slots = None
    if runs:  # 4 tokens a program over a prompt's runs of slots (copies of V's run stores, or of its own programs)
        monkeypatch.setattr(module._TUNING, "default", lambda *bucket: {
            "TOKENS": 4, "num_warps": 1, "num_stages": 1, "DIRECT_STORES": fp8})
        slots = prompt_slots(tokens, block_size)
    _, qkv, q_weight, k_weight, positions, slots, k_cache, v_cache = make_inputs(
        tokens, q_heads, kv_heads, head_dim, block_size, dtype, pad=8, slots=slots)
    scales = {}
    if fp8:
        k_cache, v_cache = e4m3_poisoned(*k_cache.shape), e4m3_poisoned(*k_cache.shape)
        scales = {name: with_scale_layout(poisoned(*k_cache.shape[:3], dtype=torch.float32), scale_layout)
                  for name in ("k_scale", "v_scale")}
    v_cache = with_v_layout(v_cache, v_layout)
    num_copies = -(-tokens // block_size) + 1
    copy_slots = torch.randperm(num_copies * block_size, device=DEVICE)[:tokens]
    copy_slots[2::5] = -1
    copies = [poisoned(num_copies, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    ref_caches = k_cache.clone(), with_v_layout(v_cache.contiguous(), v_layout)
    ref_scales = {name: scale.clone() for name, scale in scales.items()}
    ref_copies = [c.clone() for c in copies]
    cache, eps = cos_sin_cache(MAX_POS, head_dim), 1e-6
    qk_norm_rotary_store(positions, qkv, q_weight, k_weight, eps, cache, k_cache, v_cache, slots, q_heads, kv_heads,
                         **scales, k_copy=copies[0], v_copy=copies[1], copy_slots=copy_slots)
    reference.qk_norm_rotary_store(positions, qkv, q_weight, k_weight, eps, cache, *ref_caches, slots, q_heads,
                                   kv_heads, **ref_scales, k_copy=ref_copies[0], v_copy=ref_copies[1],
                                   copy_slots=copy_slots)

    keep = (slots >= 0) & (copy_slots >= 0)
    assert 0 < int(keep.sum()) < tokens or tokens < 5
    src, dst = slots[keep].long(), copy_slots[keep].long()
    held = gather_kv_blocks(k_cache, v_cache, torch.arange(k_cache.shape[0], device=DEVICE), dtype, **scales)
    untouched = torch.ones(num_copies * block_size, dtype=torch.bool, device=DEVICE)
    untouched[dst] = False
    for copy, ref_copy, values in zip(copies, ref_copies, held):
        rows = copy.view(-1, kv_heads, head_dim)
        assert torch.equal(rows[dst], values.view(-1, kv_heads, head_dim)[src])
        assert rows[untouched].isnan().all()
        assert_close(rows[dst], ref_copy.view(-1, kv_heads, head_dim)[dst], dtype)


def test_rejects_bad_copies():
    _, qkv, q_weight, k_weight, positions, slots, k_cache, v_cache = make_inputs(3, 4, 2, 64, 16, torch.float32)
    cache, copy = cos_sin_cache(MAX_POS, 64), poisoned(2, 16, 2, 64, dtype=torch.float32)

    def call(**copies):
        qk_norm_rotary_store(positions, qkv, q_weight, k_weight, 1e-6, cache, k_cache, v_cache, slots, 4, 2, **copies)

    with pytest.raises(ValueError, match="all three or none"):
        call(k_copy=copy, v_copy=copy.clone())
    with pytest.raises(ValueError, match="k_copy must be"):
        call(k_copy=copy.half(), v_copy=copy.clone(), copy_slots=slots)
    with pytest.raises(ValueError, match="v_copy must be"):
        call(k_copy=copy, v_copy=copy[:, :8], copy_slots=slots)
    with pytest.raises(ValueError, match="v_copy must have"):
        call(k_copy=copy, v_copy=copy[:1].clone(), copy_slots=slots)
    with pytest.raises(ValueError, match="copy_slots must be"):
        call(k_copy=copy, v_copy=copy.clone(), copy_slots=slots[:2])
    assert copy.isnan().all() and k_cache.isnan().all()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_strided_qkv_int32_indices_and_out_buffer(index_dtype):
    check(7, 4, 1, 64, 16, torch.bfloat16, pad=40, index_dtype=index_dtype, with_out=True)


@pytest.mark.parametrize("fp8", [False, True])
def test_head_dim_not_a_power_of_two(fp8):
    check(5, 6, 2, 80, 16, torch.float16, pad=8, fp8=fp8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_yarn_table(dtype):
    # YaRN's cos and sin carry its attention factor (~1.14 here): not a pure rotation.
    check(9, 4, 2, 128, 16, dtype, yarn={"factor": 4.0, "original_max_position_embeddings": 1024})


@pytest.mark.parametrize("fp8, direct", [(False, False), (True, False), (True, True)],
                         ids=["model-cache", "fp8-cache", "fp8-cache-direct-stores"])
@pytest.mark.parametrize("tokens_per_program", [1, 2, 4])
def test_every_tokens_per_program(monkeypatch, tokens_per_program, fp8, direct):
    # 7 tokens: the last program of 2 or 4 tokens is partly masked (masked lanes store nothing).
    monkeypatch.setattr(module._TUNING, "default", lambda *bucket: {
        "TOKENS": tokens_per_program, "num_warps": 1, "num_stages": 1, "DIRECT_STORES": direct})
    check(7, 4, 2, 64, 16, torch.float16, pad=16, fp8=fp8)
    check(7, 4, 2, 64, 16, torch.float16, pad=16, fp8=fp8, v_layout="key_major", scale_layout="head_major")


def test_config_space_and_default():
    for bucket in [("bfloat16", 4096, 16384), ("bfloat16", 4096, 1), ("float32", 512, 8), ("float16", 256, 4096),
                   ("bfloat16", 4096, 16384, "float8_e4m3fn"), ("bfloat16", 1024, 2048, "float8_e4m3fn"),
                   ("bfloat16", 4096, 256, "float8_e4m3fn")]:
        space = module._space(*bucket)
        default = module._default(*bucket)
        assert space and all(set(config) == set(default) for config in space)
        assert default in space
    # Many tokens into an e4m3 cache: 4 a program (adjacent bytes of a key-major V) with direct
    # stores; few tokens, and every bf16 cache, as before.
    assert module._default("bfloat16", 4096, 16384, "float8_e4m3fn")["TOKENS"] == 4
    assert module._default("bfloat16", 4096, 16384, "float8_e4m3fn")["DIRECT_STORES"]
    assert module._default("bfloat16", 4096, 256, "float8_e4m3fn") == module._default("bfloat16", 4096, 256)
    assert not any(config["DIRECT_STORES"] for config in module._space("bfloat16", 4096, 16384))


def test_an_e4m3_cache_has_its_own_bucket():
    _, qkv, q_weight, k_weight, positions, slots, k_cache, _ = make_inputs(3, 6, 2, 64, 16, torch.float16)
    scales = {name: poisoned(*k_cache.shape[:3], dtype=torch.float32) for name in ("k_scale", "v_scale")}
    caches = e4m3_poisoned(*k_cache.shape), e4m3_poisoned(*k_cache.shape)
    qk_norm_rotary_store(positions, qkv, q_weight, k_weight, 1e-6, cos_sin_cache(MAX_POS, 64), *caches, slots, 6, 2,
                         **scales)
    bucket = module.qk_norm_rotary_store_bucket(torch.float16, 6, 2, 64, 3, torch.float8_e4m3fn)
    assert module._TUNING.last_key == bucket_key(bucket) and bucket[-1] == "float8_e4m3fn"
    assert module.qk_norm_rotary_store_bucket(torch.float16, 6, 2, 64, 3, torch.float16) == bucket[:-1]


def test_no_tokens():
    qkv = randn(0, 8 * 64)
    k_cache = poisoned(2, 16, 2, 64, dtype=torch.float32)
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    q = qk_norm_rotary_store(empty, qkv, randn(64), randn(64), 1e-6, cos_sin_cache(16, 64), k_cache, k_cache.clone(),
                             empty, 4, 2)
    assert q.shape == (0, 4, 64) and torch.isnan(k_cache).all()


def test_rejects_bad_shapes():
    qkv, cache = randn(3, 8 * 64), cos_sin_cache(16, 64)
    k_cache = poisoned(2, 16, 2, 64, dtype=torch.float32)
    index = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="qkv width"):
        qk_norm_rotary_store(index, qkv, randn(64), randn(64), 1e-6, cache, k_cache, k_cache.clone(), index, 4, 3)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rotary_store(index, qkv, randn(64), randn(64), 1e-6, cache, k_cache, k_cache.clone(), index[:2], 4, 2)
    with pytest.raises(ValueError, match="k_cache"):
        qk_norm_rotary_store(index, qkv, randn(64), randn(64), 1e-6, cache, k_cache[:, :, :1], k_cache.clone(), index, 4, 2)
    # V neither with k_cache's strides nor key-major; a key-major V beside a non-contiguous k_cache.
    other = k_cache.transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(ValueError, match="v_cache"):
        qk_norm_rotary_store(index, qkv, randn(64), randn(64), 1e-6, cache, k_cache, other, index, 4, 2)
    with pytest.raises(ValueError, match="k_cache"):
        qk_norm_rotary_store(index, qkv, randn(64), randn(64), 1e-6, cache, key_major(k_cache), key_major(k_cache),
                             index, 4, 2)
    assert torch.isnan(k_cache).all()


def test_rejects_bad_scales():
    qkv, cache = randn(3, 8 * 64), cos_sin_cache(16, 64)
    index = torch.zeros(3, dtype=torch.long, device=DEVICE)
    k_cache, scale = e4m3_poisoned(2, 16, 2, 64), poisoned(2, 16, 2, dtype=torch.float32)

    def call(k_cache, **scales):
        qk_norm_rotary_store(index, qkv, randn(64), randn(64), 1e-6, cache, k_cache, k_cache.clone(), index, 4, 2,
                             **scales)

    with pytest.raises(ValueError, match="k_scale is required"):
        call(k_cache)
    with pytest.raises(ValueError, match="v_scale is required"):
        call(k_cache, k_scale=scale)
    with pytest.raises(ValueError, match="k_scale is only for"):
        call(poisoned(2, 16, 2, 64, dtype=torch.bfloat16), k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError, match="v_scale must be"):
        call(k_cache, k_scale=scale, v_scale=scale.view(2, 32, 1))
    assert scale.isnan().all() and (k_cache.view(torch.uint8) == 0x7F).all()
