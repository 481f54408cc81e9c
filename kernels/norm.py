"""RMSNorm and fused residual-add + RMSNorm with HF Qwen3's rounding points."""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.checks import FLOATS, check_dtype, check_rows, check_writable
from tritonllm.kernels.tuning import Tunable, dtype_name, pow2


@triton.jit(do_not_specialize=["n_rows", "eps"])
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, h_ptr,
    n_rows, n_cols, x_stride, residual_stride, y_stride, h_stride, eps,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Loaded before the store of h, which the compiler cannot move it past (they might alias).
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + rows[:, None] * residual_stride + cols[None, :], mask=mask, other=0.0)
        # The new residual is rounded to the model dtype before it is normalized, as in HF.
        h = (x + residual.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * h_stride + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    # HF casts the normalized value to the model dtype before multiplying by the weight.
    normed = (x * rstd[:, None]).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], weight[None, :] * normed, mask=mask)


def _space(dtype, block_n, rows_bucket):
    return [
        {"ROWS": rows, "num_warps": warps, "num_stages": 1}
        for rows in (1, 2, 4, 8, 16, 32)
        for warps in (1, 2, 4, 8, 16)
        if rows * block_n <= 16384 and rows <= rows_bucket and warps * 32 <= rows * block_n
    ]


def _default(dtype, block_n, rows_bucket):
    # Short rows (per-head q/k norm) share a program; about 8 elements per thread.
    rows = max(1, min(16, 2048 // block_n, rows_bucket))
    return {"ROWS": rows, "num_warps": min(16, max(1, rows * block_n // 256)), "num_stages": 1}


_RMS_NORM = Tunable("rms_norm", _space, _default)
_FUSED_ADD_RMS_NORM = Tunable("fused_add_rms_norm", _space, _default)


def rms_norm_bucket(dtype: torch.dtype, n_cols: int, n_rows: int) -> tuple:
    """The tuning bucket of rms_norm and of fused_add_rms_norm on n_rows rows of n_cols elements."""
    return dtype_name(dtype), pow2(n_cols), pow2(n_rows)


def _norm(tunable, x, residual, weight, y, h, eps):
    n_rows, n_cols = x.shape
    if n_rows == 0 or n_cols == 0:
        return
    block_n = triton.next_power_of_2(n_cols)
    has_residual = residual is not None
    residual = x if residual is None else residual
    h = y if h is None else h

    def launch(config):
        grid = (triton.cdiv(n_rows, config["ROWS"]),)
        _rms_norm_kernel[grid](
            x, residual, weight, y, h, n_rows, n_cols,
            x.stride(0), residual.stride(0), y.stride(0), h.stride(0), eps,
            HAS_RESIDUAL=has_residual, BLOCK_N=block_n, **config,
        )

    restore = (x, residual) if has_residual else ()
    launch(tunable.config(rms_norm_bucket(x.dtype, n_cols, n_rows), launch, restore))


def _check(x, weight):
    if x.dim() == 0:
        raise ValueError("x must be [..., N], got a 0-d tensor")
    check_dtype("x", x, FLOATS)
    check_rows(x.shape[-1], FLOATS, weight=weight)  # the kernel reads weight[n] at weight_ptr + n


def _rows_in_place(name: str, t: torch.Tensor) -> torch.Tensor:
    """t [..., N] as a [rows, N] view, which the kernel writes in place: ValueError naming `name`
    unless its rows are contiguous and evenly spaced (no copy could be written back)."""
    try:
        rows = t.view(t.shape[:-1].numel(), t.shape[-1])
    except RuntimeError:
        rows = None
    if rows is None or (t.shape[-1] > 1 and rows.stride(1) != 1):
        raise ValueError(f"{name} must be [..., N] with contiguous, evenly spaced rows (written in place), "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")
    check_writable(name, rows)
    return rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """HF Qwen3RMSNorm over the last dim: weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype).

    x [..., N] float32/float16/bfloat16; weight [N] contiguous. Returns y of x's shape and dtype,
    written into `out` when given (x is never modified).
    """
    _check(x, weight)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty_like(x2) if out is None else out.view(x2.shape)
    _norm(_RMS_NORM, x2, None, weight, y, None, eps)
    return y.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """h = x + residual rounded to x.dtype (the new residual), y = rms_norm(h, weight, eps).

    x, residual [..., N] of one dtype, each viewable as [rows, N] with contiguous rows; weight [N]
    contiguous. In place: y is written into x and h into residual. Returns (x, residual), i.e. (y, h).
    """
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x: got {tuple(residual.shape)} {residual.dtype}, x is {tuple(x.shape)} {x.dtype}")
    x2, r2 = _rows_in_place("x", x), _rows_in_place("residual", residual)
    _norm(_FUSED_ADD_RMS_NORM, x2, r2, weight, x2, r2, eps)
    return x, residual
