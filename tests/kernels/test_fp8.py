import pytest
import torch
import triton
import triton.language as tl
from kernel_utils import DEVICE, DTYPES, rel_err

from tritonllm.kernels import reference
from tritonllm.kernels.fp8 import check_kv_scales, e4m3_scale, empty_kv_scales, from_e4m3, to_e4m3
from tritonllm.kernels.tuning import INTERPRET

E4M3 = torch.float8_e4m3fn
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _to_e4m3_kernel(x_ptr, scale_ptr, q_ptr, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    scale = tl.load(scale_ptr + offs, mask=mask, other=1.0)
    tl.store(q_ptr + offs, to_e4m3(x, scale, INTERPRET), mask=mask)


@triton.jit
def _from_e4m3_kernel(q_ptr, out_ptr, n, BLOCK: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, from_e4m3(tl.load(q_ptr + offs, mask=mask), DTYPE, INTERPRET), mask=mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, D: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + row * D + dims, mask=dims < D, other=0.0)
    scale = e4m3_scale(tl.max(tl.abs(x), axis=0))
    tl.store(q_ptr + row * D + dims, to_e4m3(x, scale, INTERPRET), mask=dims < D)
    tl.store(scale_ptr + row, scale)


def to_e4m3_bits(x, scale=None):
    """The kernel's to_e4m3(x, scale) of float32 x as uint8 bits (scale 1.0 by default)."""
    x = x.to(DEVICE, torch.float32).contiguous()
    scale = torch.ones_like(x) if scale is None else scale.to(DEVICE, torch.float32).contiguous()
    q = torch.empty(x.shape, dtype=E4M3, device=DEVICE)
    _to_e4m3_kernel[(1,)](x, scale, q, x.numel(), BLOCK=triton.next_power_of_2(x.numel()), INTERPRET=INTERPRET)
    return q.view(torch.uint8)


def torch_bits(x, scale=None):
    """The contract's rule in PyTorch (reference.quantize_e4m3's rounding) as uint8 bits."""
    y = x.float() if scale is None else x.float() / scale
    return y.clamp(-448, 448).to(E4M3).view(torch.uint8).to(DEVICE)


def e4m3_poisoned(*shape):
    """An e4m3 buffer of NaN patterns (0x7F), so a value the kernel fails to write stays NaN."""
    return torch.full(shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(E4M3)


def assert_e4m3_rows_match(cache, scale, ref_cache, ref_scale, rel_tolerance=None):
    """An e4m3 cache and its scales [num_blocks, block_size, Hkv] against the reference's, both
    written over the same poison (NaN scales): rows the reference left alone are bit for bit
    untouched; written scales agree to a few float32 ulps (sums in another order upstream) and the
    stored codes exactly, but for a rare one-step difference (such a rounding crossing a tie).
    With rel_tolerance (rows the kernel computes with other roundings than the reference, such as
    the interpreter's truncating float32 -> bfloat16), the written rows' values (code times scale)
    are compared instead: relative error within it."""
    written = ~ref_scale.isnan()
    assert torch.equal(scale.isnan(), ~written), "a scale was written where the reference wrote none, or not at all"
    assert torch.equal(cache.view(torch.uint8)[~written], ref_cache.view(torch.uint8)[~written])
    out, ref = cache[written].float(), ref_cache[written].float()
    assert not out.isnan().any(), "a written row holds a NaN pattern: an element was not written"
    if rel_tolerance is not None:
        error = rel_err(out * scale[written][:, None], ref * ref_scale[written][:, None])
        assert error <= rel_tolerance, f"relative error {error:.3g} > {rel_tolerance:.3g}"
        return
    torch.testing.assert_close(scale[written], ref_scale[written], rtol=1e-6, atol=0)
    differ = out != ref
    step = torch.exp2(torch.maximum(torch.maximum(out.abs(), ref.abs()).log2().floor(), torch.tensor(-6.0)) - 3)
    assert ((out - ref).abs()[differ] <= step[differ]).all(), "codes differ by more than one e4m3 step"
    assert int(differ.sum()) <= max(1, out.numel() // 1000), f"{int(differ.sum())} of {out.numel()} codes differ"


def finite_values():
    """Every finite e4m3 value, -0 included, as float32 (254 values)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    return values[~values.isnan()]


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_e4m3_every_bit_pattern(dtype):
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).to(DEVICE)
    out = torch.empty(256, dtype=dtype, device=DEVICE)
    _from_e4m3_kernel[(1,)](q, out, 256, BLOCK=256, DTYPE=TL_DTYPES[dtype], INTERPRET=INTERPRET)
    expected = q.float().to(dtype)
    assert int(expected.isnan().sum()) == 2  # 0x7F and 0xFF
    assert torch.equal(out.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(out[finite], expected[finite])
    assert torch.equal(out[finite].signbit(), expected[finite].signbit())  # -0 stays -0


def test_to_e4m3_exact_values_keep_their_bits():
    values = finite_values()
    assert torch.equal(to_e4m3_bits(values), torch_bits(values))


def test_to_e4m3_ties_round_to_nearest_even():
    magnitudes = finite_values().abs().unique()  # sorted, 0 to 448
    mids = (magnitudes[:-1] + magnitudes[1:]) / 2  # exact in float32: every tie, subnormal ones too
    below, above = torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 1e9))
    x = torch.cat([mids, below, above])
    x = torch.cat([x, -x])
    bits = to_e4m3_bits(x)
    assert torch.equal(bits, torch_bits(x))
    # Round to even: a tie lands on the neighbour whose last mantissa bit is 0.
    assert not (bits[:len(mids)] & 1).any()


def test_to_e4m3_saturates_never_nan():
    x = torch.tensor([448.0, 449.0, 463.9, 464.0, 479.0, 480.0, 1e6, 3.4e38, float("inf")])
    x = torch.cat([x, -x])
    bits = to_e4m3_bits(x)
    assert torch.equal(bits, torch_bits(x))
    assert torch.equal(bits.view(E4M3).float(), x.sign().to(DEVICE) * 448)


def test_to_e4m3_divides_exactly():
    # Values over the whole range, tiny ones included, divided by random scales: the kernel's
    # correctly rounded division then rounding give the reference's bits everywhere.
    x = torch.randn(4096) * torch.logspace(-12, 3, 4096, base=2.0)
    scale = torch.rand(4096) * 4 + 2.0 ** -8
    assert torch.equal(to_e4m3_bits(x, scale), torch_bits(x, scale))


@pytest.mark.parametrize("dim", [64, 80, 128])
def test_quantize_rows_matches_reference(dim):
    x = torch.randn(16, dim, device=DEVICE) * torch.logspace(-6, 6, 16, base=2.0, device=DEVICE)[:, None]
    x[3] = 0.0  # an all-zero row: scale 1, zeros stored
    x[5, 7] = 1e5  # one outlier: the rest of its row shrinks toward the subnormals
    q = torch.empty(x.shape, dtype=E4M3, device=DEVICE)
    scale = torch.empty(16, device=DEVICE)
    _quantize_rows_kernel[(16,)](x, q, scale, D=dim, BLOCK_D=triton.next_power_of_2(dim), INTERPRET=INTERPRET)
    ref_q, ref_scale = reference.quantize_e4m3(x)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    assert scale[3] == 1.0 and not q[3].view(torch.uint8).any()
    # The round trip: within half a step of e4m3 (2^-4 relative, or half the subnormal step).
    error = (ref_q.float() * ref_scale[:, None] - x).abs()
    assert (error <= torch.maximum(x.abs() * 2.0 ** -4, ref_scale[:, None] * 2.0 ** -10)).all()


def test_check_kv_scales():
    cache = torch.zeros(2, 16, 4, 64, dtype=E4M3)
    scale = torch.ones(2, 16, 4)
    assert check_kv_scales(cache, cache, scale, scale)
    assert not check_kv_scales(cache.float(), cache.float(), None, None)
    with pytest.raises(ValueError, match="v_scale is required"):
        check_kv_scales(cache, cache, scale, None)
    with pytest.raises(ValueError, match="k_scale is only for"):
        check_kv_scales(cache.bfloat16(), cache.bfloat16(), scale, None)
    with pytest.raises(ValueError, match="k_scale must be"):
        check_kv_scales(cache, cache, scale[:, :, :2], scale)
    with pytest.raises(ValueError, match="v_scale must be"):
        check_kv_scales(cache, cache, scale, scale.half())
    with pytest.raises(ValueError, match="v_scale must be"):
        check_kv_scales(cache, cache, scale, scale.transpose(0, 1).contiguous().transpose(0, 1))
    head_major = empty_kv_scales(2, 16, 4, head_major=True)
    assert head_major.shape == scale.shape and head_major.stride() == (64, 1, 16)
    assert check_kv_scales(cache, cache, head_major, head_major.clone())
    with pytest.raises(ValueError, match="v_scale must have k_scale's strides"):
        check_kv_scales(cache, cache, head_major, scale)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        check_kv_scales(cache, cache.half(), scale, scale)
