"""y = x W^T for the few rows of a decode step, split over K where N alone gives too few programs.

At decode a projection's weight W [N, K] is read once for a few rows of x, so the GEMM is bound by
W's bytes and by how soon every SM has loads in flight. Each program owns a BLOCK_N x BLOCK_M tile
of y^T = W x^T (W's rows take the MMA's M side, so four rows of x do not pad a 64-row tile) over
one of SPLIT_K runs of K. With SPLIT_K > 1 the programs of a tile write float32 partials and count
their arrivals; the last one adds the partials in split order, so the sum does not depend on which
program finished last. Past MAX_ROWS rows, and for float32
or a bias, the wrapper calls torch (cuBLAS), which is near the FLOP ceiling there.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tritonllm.kernels import tuning
from tritonllm.kernels.tuning import Tunable, dtype_name, pow2

MAX_ROWS = 256
TARGET_PROGRAMS = 132  # about one program per H200 SM, before a tile's K is split further


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, y_ptr, partial_ptr, count_ptr, M, N, K, K_SPLIT, stride_x, stride_w, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N and M wrap onto real rows: the loads need no row mask, the stores drop them.
    w_rows = (offs_n % N).to(tl.int64) * stride_w
    x_rows = (offs_m % M).to(tl.int64) * stride_x
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(k_begin, k_end, BLOCK_K):
        cols = k + offs_k
        if EVEN_K:
            w = tl.load(w_ptr + w_rows[:, None] + cols[None, :])
            x_t = tl.load(x_ptr + x_rows[None, :] + cols[:, None])
        else:
            w = tl.load(w_ptr + w_rows[:, None] + cols[None, :], mask=cols[None, :] < K, other=0.0)
            x_t = tl.load(x_ptr + x_rows[None, :] + cols[:, None], mask=cols[:, None] < K, other=0.0)
        if INTERPRET:  # the interpreter's tl.dot multiplies raw bfloat16 bits
            w, x_t = w.to(tl.float32), x_t.to(tl.float32)
        acc = tl.dot(w, x_t, acc)

    y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_y + offs_n[:, None]
    y_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        tile_offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tile_base = partial_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M) + tile_offs
        tl.store(tile_base + pid_k * (BLOCK_N * BLOCK_M), acc)
        # Every thread's partial is written before one thread releases it with the count.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                # .cg: from L2, where the other SMs' partials are, never a stale L1 line of a past call.
                total += tl.load(tile_base + split * (BLOCK_N * BLOCK_M), cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)


def _splits(n_bucket, k_bucket, block_n, block_k, rows_bucket, block_m):
    """The fewest splits of K (a power of two, each at least two BLOCK_K steps of the bucket's
    smallest K) that give about TARGET_PROGRAMS programs."""
    tiles = triton.cdiv(n_bucket, block_n) * triton.cdiv(rows_bucket, block_m)
    splits = 1
    while tiles * splits < TARGET_PROGRAMS and _min_k(k_bucket) // (splits * 2) >= 2 * block_k:
        splits *= 2
    return splits


def _min_k(k_bucket):
    """The smallest K of a power-of-two bucket (K in (k_bucket / 2, k_bucket])."""
    return max(1, k_bucket // 2)


def _space(dtype, n_bucket, k_bucket, rows_bucket):
    block_m = min(max(16, rows_bucket), 64)
    configs = []
    for block_n in (16, 32, 64, 128):
        for block_k in (64, 128, 256):
            base = _splits(n_bucket, k_bucket, block_n, block_k, rows_bucket, block_m)
            for splits in sorted({base, max(1, base // 2), base * 2}):
                if _min_k(k_bucket) // splits >= block_k:
                    configs.append({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": splits,
                                    "num_warps": 4, "num_stages": 4})
    return configs


def _default(dtype, n_bucket, k_bucket, rows_bucket):
    block_m = min(max(16, rows_bucket), 64)
    block_n = 32 if rows_bucket <= 32 else 64
    splits = _splits(n_bucket, k_bucket, block_n, 128, rows_bucket, block_m)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128, "SPLIT_K": splits, "num_warps": 4,
            "num_stages": 4}


LINEAR_TUNABLE = Tunable("linear", _space, _default)


def linear_bucket(dtype: torch.dtype, n: int, k: int, rows: int) -> tuple:
    """The tuning bucket of linear: x's dtype, N, K and the row count M, as powers of two."""
    return dtype_name(dtype), pow2(n), pow2(k), pow2(rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias), torch.nn.functional.linear's meaning.

    x: [M, K] with contiguous rows; weight: [N, K] with contiguous rows, x's dtype; bias: [N] or None.
    float16/bfloat16 x of at most MAX_ROWS rows and no bias runs the split-K Triton kernel (float32
    accumulation, one rounding to x's dtype; no host sync, so CUDA-graph capturable: with SPLIT_K > 1
    a zeroed int32 count per output tile and float32 partials are allocated per call); anything else
    calls torch.nn.functional.linear. out: optional [M, N] buffer of x's dtype written in place.
    config: launch config overriding the tuned/default one (tests, benchmarks). Returns y [M, N].
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"weight's dtype {weight.dtype} must be x's {x.dtype}")
    rows, (n, k) = x.shape[0], weight.shape
    if bias is not None or x.dtype == torch.float32 or rows > MAX_ROWS or rows == 0:
        y = F.linear(x, weight, bias)
        return y if out is None else out.copy_(y)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need contiguous rows (stride 1 in K)")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device) if out is None else out

    def launch(cfg):
        cfg = dict(cfg)
        block_m, block_n, block_k, splits = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
        grid = (triton.cdiv(n, block_n), triton.cdiv(rows, block_m), splits)
        k_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
        if splits > 1:
            partials = torch.empty(grid[0] * grid[1] * splits * block_n * block_m, dtype=torch.float32,
                                   device=x.device)
            counts = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=x.device)
        else:
            partials = counts = y  # not touched with one split
        _linear_kernel[grid](x, weight, y, partials, counts, rows, n, k, k_split, x.stride(0), weight.stride(0),
                             y.stride(0), EVEN_K=k % block_k == 0,
                             INTERPRET=tuning.INTERPRET, **cfg)

    if config is None:
        bucket = linear_bucket(x.dtype, n, k, rows)
        config = LINEAR_TUNABLE.config(bucket, tuning.graph_replay(launch) if x.is_cuda else launch)
    launch(config)
    return y
