"""SiLU-and-mul, the gated activation of Qwen3's MLP."""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.checks import FLOATS, check_dtype, check_writable
from tritonllm.kernels.tuning import Tunable, dtype_name, pow2


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, inter, x_stride, y_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # HF rounds silu(gate) to the model dtype before the product.
    act = (gate * tl.sigmoid(gate)).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * y_stride + cols, act * up, mask=mask)


def _space(dtype, inter_bucket, rows_bucket):
    return [
        {"BLOCK": block, "num_warps": warps, "num_stages": 1}
        for block in (256, 512, 1024, 2048, 4096)
        for warps in (1, 2, 4, 8)
        if block <= max(256, inter_bucket) and warps * 32 <= block
    ]


def _default(dtype, inter_bucket, rows_bucket):
    block = min(1024, max(256, inter_bucket))
    return {"BLOCK": block, "num_warps": max(1, block // 256), "num_stages": 1}


_TUNING = Tunable("silu_and_mul", _space, _default)


def silu_and_mul_bucket(dtype: torch.dtype, inter: int, n_rows: int) -> tuple:
    """The tuning bucket of silu_and_mul on x [n_rows, 2 * inter] of `dtype`."""
    return dtype_name(dtype), pow2(inter), pow2(n_rows)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = silu(x[:, :I]) * x[:, I:] for x [T, 2I] float32/float16/bfloat16 (rows may be strided).

    Returns y [T, I] of x's dtype, written into `out` when given.
    """
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, 2I] with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    check_dtype("x", x, FLOATS)
    n_rows, inter = x.shape[0], x.shape[1] // 2
    if out is not None and (out.shape != (n_rows, inter) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be [{n_rows}, {inter}] {x.dtype} with contiguous rows, got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    check_writable("out", out)
    y = torch.empty(n_rows, inter, dtype=x.dtype, device=x.device) if out is None else out
    if n_rows == 0:
        return y

    def launch(config):
        grid = (n_rows, triton.cdiv(inter, config["BLOCK"]))
        _silu_and_mul_kernel[grid](x, y, inter, x.stride(0), y.stride(0), **config)

    launch(_TUNING.config(silu_and_mul_bucket(x.dtype, inter, n_rows), launch))
    return y
