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
from tritonllm.kernels.checks import check_writable
from tritonllm.kernels.tuning import Tunable, dtype_name, pow2

MAX_ROWS = 16  # past this cuBLAS's tiles win (bench/NOTES-engine.md)
BLOCK_M = 16  # the MMA's smallest N: x's rows, padded
MIN_BLOCK_N = 16  # the MMA's smallest M: a counter buffer serves every tile of at least this many rows of W
MIN_PROGRAMS = 132  # about one program an SM (H200) before K is split further


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, y_ptr, partial_ptr, count_ptr, M, N, K, K_SPLIT, stride_x, stride_w, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N and M wrap onto real rows, so the loads need no row mask; the stores drop them.
    w_rows = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_w
    x_cols = x_ptr + (offs_m % M).to(tl.int64)[None, :] * stride_x
    k_begin = pid_k * K_SPLIT
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_begin, tl.minimum(k_begin + K_SPLIT, K), BLOCK_K):
        cols = k + offs_k
        if EVEN_K:
            w = tl.load(w_rows + cols[None, :])
            x_t = tl.load(x_cols + cols[:, None])
        else:
            w = tl.load(w_rows + cols[None, :], mask=cols[None, :] < K, other=0.0)
            x_t = tl.load(x_cols + cols[:, None], mask=cols[:, None] < K, other=0.0)
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


TILE_KEYS = {"BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"}
LINEAR_TUNABLE = Tunable("linear", _space, _default, key_sets=[set(TORCH), TILE_KEYS])


def linear_bucket(dtype: torch.dtype, n: int, k: int, rows: int) -> tuple:
    """The tuning bucket of linear: x's dtype, then N, K and the rows M as powers of two."""
    return dtype_name(dtype), pow2(n), pow2(k), pow2(rows)


def linear_counts(n: int, device=None) -> torch.Tensor:
    """A zeroed int32 counter buffer that serves every linear call with weights of n rows (N)."""
    return torch.zeros(triton.cdiv(n, MIN_BLOCK_N), dtype=torch.int32, device=device)


def _torch_linear(x, weight, bias, out):
    y = F.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


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
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"weight's dtype {weight.dtype} must be x's {x.dtype}")
    rows, (n, k) = x.shape[0], weight.shape
    if out is not None and (out.shape != (rows, n) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be [{rows}, {n}] {x.dtype} with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype}")
    check_writable("out", out)
    if bias is not None or x.dtype == torch.float32 or not 1 <= rows <= MAX_ROWS:
        return _torch_linear(x, weight, bias, out)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need contiguous rows (stride 1 along K)")
    if counts is not None and (counts.dtype != torch.int32 or counts.numel() < triton.cdiv(n, MIN_BLOCK_N)):
        raise ValueError(f"counts must be int32 with at least {triton.cdiv(n, MIN_BLOCK_N)} entries "
                         f"(linear_counts({n}))")

    def launch(cfg):
        if cfg.get("TORCH"):
            return _torch_linear(x, weight, None, out)
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device) if out is None else out
        block_n, block_k, splits = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
        grid = (triton.cdiv(n, block_n), splits)
        if splits > 1:
            partials = torch.empty(grid[0] * splits * block_n * BLOCK_M, dtype=torch.float32, device=x.device)
            counters = linear_counts(n, x.device) if counts is None else counts
        else:
            partials = counters = y  # not touched with one split
        _linear_kernel[grid](x, weight, y, partials, counters, rows, n, k,
                             triton.cdiv(triton.cdiv(k, splits), block_k) * block_k,
                             x.stride(0), weight.stride(0), y.stride(0), BLOCK_M=BLOCK_M, EVEN_K=k % block_k == 0,
                             INTERPRET=tuning.INTERPRET, **cfg)
        return y

    if config is None:
        bucket = linear_bucket(x.dtype, n, k, rows)
        config = LINEAR_TUNABLE.config(bucket, tuning.graph_replay(launch) if x.is_cuda else launch)
    return launch(config)
