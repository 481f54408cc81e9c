"""Shared helpers of the kernel tests: device, dtypes, tolerances, poisoning, relative error."""
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Relative error ||out - ref|| / ||ref|| allowed against a float64 reference: about one rounding
# of the output dtype (the interpreter truncates float32 -> bfloat16 instead of rounding).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def poisoned(*shape, dtype):
    """A buffer full of NaN, so an element the kernel fails to write fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, factor: float = 1.0):
    """Every element finite and the relative error within `factor` times the dtype's tolerance."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "output has NaN/inf: an element was not written"
    err = rel_err(out, ref)
    assert err <= TOLERANCE[dtype] * factor, f"relative error {err:.3g} > {TOLERANCE[dtype] * factor:.3g}"
