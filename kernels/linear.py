"""y = x W^T for the few rows of a small decode step (M <= MAX_ROWS), split over K.

With a handful of rows a projection is a read of W [N, K]: its time is W's bytes plus how soon
every SM has loads in flight. cuBLAS's kernels for these shapes read W well below the copy ceiling,
some as a split-K GEMM plus a second reduction launch (bench/NOTES-engine.md has the timings).
Here a program computes BLOCK_N rows of y^T = W x^T (W's rows are the MMA's M; x's few rows its N,
padded to BLOCK_M) over one of SPLIT_K runs of K. With SPLIT_K > 1 each program writes its float32
partial, then counts its arrival on the tile's int32 counter; the last to arrive adds the partials
in split order (so the sum does not depend on which program finished last), writes y and sets the
counter back to 0. A caller that keeps a zeroed counter buffer across calls (the engine's layers)
thus launches one kernel a projection, CUDA-graph capturable. Which of this kernel and cuBLAS
serves a bucket is a tuning choice (config TORCH 1: torch.nn.functional.linear, also the default
where a bucket has no tuned entry); other inputs always go to torch.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tritonllm.kernels import tuning
from tritonllm.kernels.norm import fused_add_rms_norm, rms_norm
from tritonllm.kernels.silu_and_mul import silu_and_mul
from tritonllm.kernels.tuning import Tunable, dtype_name, pow2

MAX_ROWS = 16  # past this cuBLAS's tiles win (bench/NOTES-engine.md)
BLOCK_M = 16  # the MMA's smallest N: x's rows, padded
MIN_BLOCK_N = 16  # the MMA's smallest M: a counter buffer serves every tile of at least this many rows of W
MIN_PROGRAMS = 132  # about one program an SM (H200) before K is split further


PLAIN, NORM, ADD_NORM, SILU_AND_MUL = (tl.constexpr(v) for v in range(4))  # PROLOGUE: x before the dot


@triton.jit
def _load_cols(ptrs, cols, K, EVEN_K: tl.constexpr):
    """The [BLOCK_K, BLOCK_M] values at ptrs (x^T's layout) of columns `cols` (0 past K)."""
    if EVEN_K:
        values = tl.load(ptrs + cols[:, None])
    else:
        values = tl.load(ptrs + cols[:, None], mask=cols[:, None] < K, other=0.0)
    return values


@triton.jit
def _round(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 x rounded to dtype, to nearest even: Triton's interpreter truncates to bfloat16."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _input_tile(x_cols, r_cols, h_cols, norm_w_ptr, cols, rstd, K, store_h, m_mask, EVEN_K: tl.constexpr,
                PROLOGUE: tl.constexpr, INTERPRET: tl.constexpr):
    """x^T [BLOCK_K, BLOCK_M] of K columns `cols` as the dot takes it, in x's dtype: x itself; HF's RMSNorm
    of x (NORM) or of h = x + residual rounded (ADD_NORM, which also stores h where store_h); or
    silu(gate) * up of x = [gate | up] (SILU_AND_MUL), each with HF's roundings."""
    x = _load_cols(x_cols, cols, K, EVEN_K)
    dtype = x.dtype
    if PROLOGUE == SILU_AND_MUL:
        gate = x.to(tl.float32)
        up = _load_cols(x_cols + K, cols, K, EVEN_K).to(tl.float32)
        tile = _round(_round(gate * tl.sigmoid(gate), dtype, INTERPRET).to(tl.float32) * up, dtype, INTERPRET)
    elif PROLOGUE == PLAIN:
        tile = x
    else:
        h = x
        if PROLOGUE == ADD_NORM:
            h = _round(x.to(tl.float32) + _load_cols(r_cols, cols, K, EVEN_K).to(tl.float32), dtype, INTERPRET)
            tl.store(h_cols + cols[:, None], h, mask=(cols[:, None] < K) & m_mask[None, :] & store_h)
        weight = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        normed = _round(h.to(tl.float32) * rstd[None, :], dtype, INTERPRET).to(tl.float32)
        tile = _round(weight[:, None] * normed, dtype, INTERPRET)
    return tile


@triton.jit(do_not_specialize=["M", "eps"])
def _linear_kernel(x_ptr, w_ptr, y_ptr, partial_ptr, count_ptr, r_ptr, h_ptr, norm_w_ptr, M, N, K, K_SPLIT,
                   stride_x, stride_w, stride_y, stride_r, stride_h, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   EVEN_K: tl.constexpr, PROLOGUE: tl.constexpr, INTERPRET: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N and M wrap onto real rows, so the loads need no row mask; the stores drop them.
    w_rows = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_w
    rows = (offs_m % M).to(tl.int64)
    x_cols = x_ptr + rows[None, :] * stride_x
    r_cols = r_ptr + rows[None, :] * stride_r
    h_cols = h_ptr + rows[None, :] * stride_h
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == NORM or PROLOGUE == ADD_NORM:
        # Every program needs each row's norm over all of K: a pass over the rows (a few KB, from L2).
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            h = _load_cols(x_cols, k + offs_k, K, EVEN_K)
            if PROLOGUE == ADD_NORM:
                h = _round(h.to(tl.float32) + _load_cols(r_cols, k + offs_k, K, EVEN_K).to(tl.float32), h.dtype,
                           INTERPRET)
            h = h.to(tl.float32)
            squares += tl.sum(h * h, axis=0)
        rstd = tl.rsqrt(squares / K + eps)
    k_begin = pid_k * K_SPLIT
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        cols = k + offs_k
        if EVEN_K:
            w = tl.load(w_rows + cols[None, :])
        else:
            w = tl.load(w_rows + cols[None, :], mask=cols[None, :] < K, other=0.0)
        # The programs of the first column tile store h, each over its own run of K.
        x_t = _input_tile(x_cols, r_cols, h_cols, norm_w_ptr, cols, rstd, K, pid_n == 0, offs_m < M, EVEN_K, PROLOGUE,
                          INTERPRET)
        if INTERPRET:  # the interpreter's tl.dot multiplies raw bfloat16 bits
            w, x_t = w.to(tl.float32), x_t.to(tl.float32)
        acc = tl.dot(w, x_t, acc)

    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_y + offs_n[:, None]
    y_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tile = partial_ptr + (pid_n.to(tl.int64) * SPLIT_K * BLOCK_N + tl.arange(0, BLOCK_N))[:, None] * BLOCK_M \
            + offs_m[None, :]
        real = (offs_m < M)[None, :]
        tl.store(tile + pid_k * (BLOCK_N * BLOCK_M), acc, mask=real)
        # Every thread's partial is written before the count releases it.
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                # .cg: from L2, where the other SMs wrote, never a stale L1 line of an earlier call.
                total += tl.load(tile + split * (BLOCK_N * BLOCK_M), mask=real, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)


def _splits(n: int, k: int, block_n: int, block_k: int) -> int:
    """The fewest splits of K (a power of two, at least two BLOCK_K steps each) for MIN_PROGRAMS programs."""
    splits = 1
    while triton.cdiv(n, block_n) * splits < MIN_PROGRAMS and k // (splits * 2) >= 2 * block_k:
        splits *= 2
    return splits


TORCH = {"TORCH": 1}


def _space(dtype, n_bucket, k_bucket, rows_bucket):
    # Buckets hold N and K in (bucket / 2, bucket]: splits are sized on the smallest K.
    min_k = max(1, k_bucket // 2)
    configs = [TORCH]
    for block_n in (32, 64, 128):
        for block_k in (64, 128, 256):
            base = _splits(n_bucket, min_k, block_n, block_k)
            for splits in sorted({max(1, base // 2), base, base * 2}):
                if min_k // splits >= block_k:
                    for stages in (3, 4):
                        if (block_n + BLOCK_M) * block_k * 2 * stages <= 160 * 1024:  # shared memory
                            configs.append({"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": splits,
                                            "num_warps": 4, "num_stages": stages})
    return configs


def _default(dtype, n_bucket, k_bucket, rows_bucket):
    return TORCH


LINEAR_TUNABLE = Tunable("linear", _space, _default)


def linear_bucket(dtype: torch.dtype, n: int, k: int, rows: int) -> tuple:
    """The tuning bucket of linear: x's dtype, then N, K and the rows M as powers of two."""
    return dtype_name(dtype), pow2(n), pow2(k), pow2(rows)


def linear_counts(n: int, device=None) -> torch.Tensor:
    """A zeroed int32 counter buffer that serves every linear call with weights of n rows (N)."""
    return torch.zeros(triton.cdiv(n, MIN_BLOCK_N), dtype=torch.int32, device=device)


def _torch_linear(x, weight, bias, out):
    y = F.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


def _check(x, weight, k, counts, out):
    if x.dtype != weight.dtype:
        raise TypeError(f"weight's dtype {weight.dtype} must be x's {x.dtype}")
    rows, n = x.shape[0], weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must be [N, {k}], got {tuple(weight.shape)}")
    if out is not None and (out.shape != (rows, n) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be [{rows}, {n}] {x.dtype} with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if counts is not None and (counts.dtype != torch.int32 or counts.numel() < triton.cdiv(n, MIN_BLOCK_N)):
        raise ValueError(f"counts must be int32 with at least {triton.cdiv(n, MIN_BLOCK_N)} entries "
                         f"(linear_counts({n}))")


def _triton_rows(x, weight) -> bool:
    """Whether the Triton kernel may take x (the tuned config still decides)."""
    if not (x.dtype in (torch.float16, torch.bfloat16) and 1 <= x.shape[0] <= MAX_ROWS):
        return False
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need contiguous rows (stride 1 along K)")
    return True


def _project(x, weight, k, counts, out, config, torch_path, prologue=PLAIN, residual=None, h=None, norm_weight=None,
             eps=0.0):
    """(y, whether the Triton kernel ran): y = (x after the prologue) @ weight.T through the bucket's
    config, torch_path() where it is TORCH."""
    rows, n = x.shape[0], weight.shape[0]

    def launch(cfg):
        if cfg.get("TORCH"):
            return torch_path()
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device) if out is None else out
        block_n, block_k, splits = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
        grid = (triton.cdiv(n, block_n), splits)
        if splits > 1:
            partials = torch.empty(grid[0] * splits * block_n * BLOCK_M, dtype=torch.float32, device=x.device)
            counters = linear_counts(n, x.device) if counts is None else counts
        else:
            partials = counters = y  # not touched with one split
        r = x if residual is None else residual
        h_out = x if h is None else h
        _linear_kernel[grid](x, weight, y, partials, counters, r, h_out, weight if norm_weight is None else norm_weight,
                             rows, n, k, triton.cdiv(triton.cdiv(k, splits), block_k) * block_k,
                             x.stride(0), weight.stride(0), y.stride(0), r.stride(0), h_out.stride(0), eps,
                             BLOCK_M=BLOCK_M, EVEN_K=k % block_k == 0, PROLOGUE=prologue.value,
                             INTERPRET=tuning.INTERPRET, **cfg)
        return y

    if config is None:
        bucket = linear_bucket(x.dtype, n, k, rows)
        config = LINEAR_TUNABLE.config(bucket, tuning.graph_replay(launch) if x.is_cuda else launch)
    return launch(config), not config.get("TORCH")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           counts: torch.Tensor | None = None, out: torch.Tensor | None = None,
           config: dict | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias): torch.nn.functional.linear's meaning.

    x: [M, K] with contiguous rows; weight: [N, K] of x's dtype with contiguous rows; bias: [N] or
    None. float16/bfloat16 x of 1 to MAX_ROWS rows and no bias run the split-K Triton kernel
    (float32 accumulation, the split partials added in a fixed order, one rounding to x's dtype; no
    host sync) where the tuned config says so, else cuBLAS; anything else calls torch. counts: the
    int32 counters of a split launch, linear_counts(N) (zero before the call and zero again after
    it: pass the same buffer to every call, and calls that share it must not run concurrently);
    None: a zeroed buffer per call. out: optional [M, N] of x's dtype, written in place. config:
    overrides the tuned/default launch config (tests, benchmarks). Returns y [M, N].
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    _check(x, weight, x.shape[1], counts, out)
    if bias is not None or not _triton_rows(x, weight):
        return _torch_linear(x, weight, bias, out)
    return _project(x, weight, x.shape[1], counts, out, config, lambda: _torch_linear(x, weight, None, out))[0]


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, *,
                    residual: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                    config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual rounded to x's dtype (x itself without a residual), y = linear(rms_norm(h,
    norm_weight, eps), weight), with rms_norm's and linear's roundings; the normalized rows are not stored.

    x, residual: [M, K] of one dtype, rows contiguous; norm_weight [K]; weight [N, K]. Where the
    Triton kernel takes the call, h is a new tensor and x and residual are only read; otherwise
    (cuBLAS, more than MAX_ROWS rows) fused_add_rms_norm runs in place, so x and residual may be
    overwritten either way. counts and config as linear's.
    """
    _check(x, weight, x.shape[1], counts, None)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x: got {tuple(residual.shape)} {residual.dtype}")

    def torch_path():
        if residual is None:
            return F.linear(rms_norm(x, norm_weight, eps), weight)
        fused_add_rms_norm(x, residual, norm_weight, eps)
        return F.linear(x, weight)

    if not _triton_rows(x, weight) or (residual is not None and residual.stride(1) != 1):
        return torch_path(), x if residual is None else residual
    h = None if residual is None else torch.empty_like(x)
    y, ran_triton = _project(x, weight, x.shape[1], counts, None, config, torch_path,
                             NORM if residual is None else ADD_NORM, residual, h, norm_weight, eps)
    if h is None:
        return y, x
    return y, h if ran_triton else residual  # the cuBLAS path left h in `residual`, in place


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor, *, counts: torch.Tensor | None = None,
                        config: dict | None = None) -> torch.Tensor:
    """y = linear(silu_and_mul(x), weight): x [M, 2I] (gate, then up), weight [N, I], with silu_and_mul's
    and linear's roundings; the activation is not stored. counts and config as linear's."""
    inter = x.shape[1] // 2
    _check(x, weight, inter, counts, None)
    if not _triton_rows(x, weight):
        return F.linear(silu_and_mul(x), weight)
    return _project(x, weight, inter, counts, None, config, lambda: F.linear(silu_and_mul(x), weight),
                    SILU_AND_MUL)[0]
