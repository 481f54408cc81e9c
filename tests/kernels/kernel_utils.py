"""Shared helpers of the kernel tests: device, dtypes, tolerances, poisoning, relative error, paged caches."""
import torch
from numerics import rel_err  # noqa: F401  (re-exported for the kernel tests)

from tritonllm.kernels import reference
from tritonllm.kernels.fp8 import head_major_copy
from tritonllm.kernels.kv_cache import is_key_major, key_major_copy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# prefill_attention's Gluon kernel (kernels/prefill_attention_hopper.py) runs on sm_90 GPUs only.
HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The memory layouts of a V cache (kernels/kv_cache.py): k_cache's own, or key-major.
V_LAYOUTS = ["contiguous", "key_major"]
# The memory layouts of e4m3 scales (kernels/fp8.empty_kv_scales): contiguous, or head-major.
SCALE_LAYOUTS = ["contiguous", "head_major"]

# Relative error ||out - ref|| / ||ref|| allowed against a float64 reference: about one rounding
# of the output dtype (the interpreter truncates float32 -> bfloat16 instead of rounding).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Attention sums hundreds of products per output and, natively, rounds the probabilities to
# fp16/bf16 before the PV product (plus the output rounding, which the interpreter truncates for
# bf16): allow twice the elementwise tolerance (float32 2e-5, fp16 4e-3, bf16 2e-2).
ATTN = 2.0


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def poisoned(*shape, dtype):
    """A buffer full of NaN, so an element the kernel fails to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, factor: float = 1.0, tolerance=None):
    """Every element finite and the relative error within `factor` times the dtype's tolerance
    (from `tolerance`, by default TOLERANCE: against a float64 reference)."""
    limit = (tolerance or TOLERANCE)[dtype] * factor
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "output has NaN/inf: an element was not written"
    err = rel_err(out, ref)
    assert err <= limit, f"relative error {err:.3g} > {limit:.3g}"


def paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, spare_blocks=3, pad_columns=2):
    """K/V caches holding random keys of each sequence in shuffled blocks, NaN everywhere else.

    Every cache row that no sequence owns is NaN (unused blocks, the tail of each sequence's last
    block), so a kernel that reads a key it must not produces NaN. Returns k_cache, v_cache,
    block_tables [B, max_blocks + pad_columns] int32 whose entries past each sequence point at
    unused (NaN) blocks. paged_caches adds e4m3 caches with their scales.
    """
    blocks = [-(-n // block_size) for n in seq_lens]
    total = sum(blocks) + spare_blocks
    order = torch.randperm(total, device=DEVICE)
    unused = order[sum(blocks):]
    shape = (total, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = poisoned(*shape, dtype=dtype), poisoned(*shape, dtype=dtype)
    tables = unused[torch.randint(len(unused), (len(seq_lens), max(blocks) + pad_columns), device=DEVICE)]
    first = 0
    for b, (length, count) in enumerate(zip(seq_lens, blocks)):
        own = order[first:first + count]
        first += count
        tables[b, :count] = own
        slots = (own[:, None] * block_size + torch.arange(block_size, device=DEVICE)).flatten()[:length]
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = randn(length, num_kv_heads, head_dim, dtype=dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = randn(length, num_kv_heads, head_dim, dtype=dtype)
    return k_cache, v_cache, tables.to(torch.int32)


def key_major(cache):
    """A copy of a [num_blocks, block_size, Hkv, D] cache in the key-major layout (memory [num_blocks,
    Hkv, D, block_size], kernels/kv_cache.empty_kv_cache): the same values, bit for bit, through indexing."""
    copy = key_major_copy(cache)
    assert is_key_major(copy) and not copy.is_contiguous()
    assert torch.equal(copy.view(torch.uint8) if copy.element_size() == 1 else copy.nan_to_num(7.0),
                       cache.view(torch.uint8) if cache.element_size() == 1 else cache.nan_to_num(7.0))
    return copy


def with_v_layout(v_cache, v_layout):
    """v_cache as it is ("contiguous") or copied key-major ("key_major")."""
    assert v_layout in V_LAYOUTS, v_layout
    return key_major(v_cache) if v_layout == "key_major" else v_cache


def with_scale_layout(scale, scale_layout):
    """Scales [num_blocks, block_size, Hkv] as they are ("contiguous") or copied head-major
    ("head_major": memory [num_blocks, Hkv, block_size]), the same values bit for bit."""
    assert scale_layout in SCALE_LAYOUTS, scale_layout
    if scale_layout == "contiguous":
        return scale
    num_blocks, block_size, num_kv_heads = scale.shape
    copy = head_major_copy(scale)
    assert copy.stride() == (num_kv_heads * block_size, 1, block_size)
    assert torch.equal(copy.nan_to_num(7.0), scale.nan_to_num(7.0))
    return copy


def paged_caches(seq_lens, num_kv_heads, head_dim, block_size, dtype, fp8=False, v_layout="contiguous",
                 scale_layout="contiguous", **layout):
    """paged_kv's k_cache, v_cache, block_tables, and the scales to pass as keywords to the wrappers
    and references: {} for a cache of `dtype`, {"k_scale", "v_scale"} for an e4m3 cache (fp8).

    fp8: the random float32 rows are quantized with reference.quantize_e4m3, so the reference reads
    exactly the values stored; rows no sequence owns are NaN in the caches and the scales.
    v_layout "key_major": v_cache is a key-major copy of the same values (with_v_layout);
    scale_layout "head_major": the scales are head-major copies (with_scale_layout).
    """
    if not fp8:
        k_cache, v_cache, tables = paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, **layout)
        return k_cache, with_v_layout(v_cache, v_layout), tables, {}
    k, v, tables = paged_kv(seq_lens, num_kv_heads, head_dim, block_size, torch.float32, **layout)
    (k_cache, k_scale), (v_cache, v_scale) = reference.quantize_e4m3(k), reference.quantize_e4m3(v)
    # NaN rows stay NaN through the quantizer: e4m3 0x7F, and a NaN scale.
    assert (k_cache.view(torch.uint8)[k.isnan()] & 0x7F == 0x7F).all() and k_scale[k[..., 0].isnan()].isnan().all()
    scales = {"k_scale": with_scale_layout(k_scale, scale_layout), "v_scale": with_scale_layout(v_scale, scale_layout)}
    return k_cache, with_v_layout(v_cache, v_layout), tables, scales


def exact(cache):
    """A cache as the float64 reference reads it: float64, or e4m3 as stored (the reference
    dequantizes it with its scales)."""
    return cache if cache.dtype == torch.float8_e4m3fn else cache.double()


def prefill_inputs(context_lens, q_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, fp8=False,
                   v_layout="contiguous", scale_layout="contiguous"):
    """q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scales for sequences of cached + new
    tokens; scales ({} unless fp8) and the layouts as paged_caches gives them."""
    seq_lens = [c + n for c, n in zip(context_lens, q_lens)]
    k_cache, v_cache, tables, scales = paged_caches(seq_lens, num_kv_heads, head_dim, block_size, dtype, fp8,
                                                    v_layout, scale_layout)
    cu = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    # Scaled queries make the softmax peaked enough that a misplaced key shows.
    q = randn(sum(q_lens), num_q_heads, head_dim, dtype=dtype, scale=2.0)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), tables, scales
