"""The experts of a Qwen3-MoE layer: two grouped GEMMs over the token-expert pairs and a sum.

1. moe_align (moe_routing.py) lays the T*k pairs out grouped by expert, each group padded to
   BLOCK_M slots, so that every block of BLOCK_M slots belongs to one expert (block_expert).
2. `_moe_gate_up_kernel`: a program per (block, BLOCK_N columns of the intermediate) gathers its
   pairs' token rows of x and multiplies them with the expert's gate and up rows of w13 (two dots
   into two float32 accumulators); SiLU-and-mul in the epilogue, with HF's roundings, writes the
   intermediate [P, N] in slot order (padding slots hold x[0]'s, never read back into a result).
3. `_moe_down_kernel`: a program per (block, BLOCK_N columns of H) multiplies the intermediate
   rows with the expert's w2, scales each row by its pair's routing weight in float32 and writes it,
   rounded to x's dtype, to the pair's row of a [T*k, H] buffer (to y directly when k == 1).
4. `_moe_sum_kernel` adds each token's k rows in float32 in order j = 0..k-1 and rounds once.

Where their rows are 16-byte multiples (every real shape), the expert weights, and the down GEMM's
intermediate rows, arrive as TMA tiles through tensor descriptors; x's gathered token rows, and
every operand otherwise, through pointers.

A few tokens (config PAIR_BLOCKS) skip step 1: block b is pair b alone (expert topk_ids[b], its
other BLOCK_M - 1 slots padding), so the GEMMs read the ids directly and there is no align launch.
An expert that two pairs share is then read by both blocks.

Grids depend on the shapes only (P // BLOCK_M blocks; those past the used ones exit at once), so
decode steps can be captured in CUDA graphs. Programs walk GROUP_M blocks down a column of tiles
before moving right, so the blocks of one expert read its weight tile while it is in L2.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tritonllm.kernels import tuning
from tritonllm.kernels.checks import FLOATS, INDICES, check_dtype, check_writable
from tritonllm.kernels.moe_routing import moe_align
from tritonllm.kernels.paged import dot_precision


@triton.jit
def _tile(block_expert_ptr, num_n, GROUP_M: tl.constexpr):
    """This program's block, column tile and the block's expert (-1: an unused block)."""
    pid = tl.program_id(0)
    num_m = tl.num_programs(0) // num_n
    width = GROUP_M * num_n
    first_m = pid // width * GROUP_M
    group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group
    return pid_m, (pid % width) // group, tl.load(block_expert_ptr + pid_m)


@triton.jit
def _block_pairs(sorted_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    """The flat pair index of each slot of block pid_m (num_pairs: padding)."""
    if PAIR_BLOCKS:
        return tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    return tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))


# num_pairs changes every prefill step: unspecialized, one compile serves them all.
@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs, top_k, inter, hidden,
                        stride_x, stride_we, stride_wn, stride_out,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
                        TMA: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    # TMA: w_ptr is a descriptor over w13 as [E * 2N, H] of BLOCK_N x BLOCK_K tiles; rows past an
    # expert's gate (or up) rows belong to columns that are not stored, and K past H reads zeros.
    pid_m, pid_n, expert = _tile(block_expert_ptr, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = _block_pairs(sorted_ptr, pid_m, num_pairs, BLOCK_M, PAIR_BLOCKS)
    # Padding slots read token 0, so the loads need no row mask.
    tokens = tl.where(pairs < num_pairs, pairs // top_k, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    if TMA:
        gate_row = expert * (2 * inter) + pid_n * BLOCK_N
    else:
        # Columns past N wrap onto real weight rows (no mask in the loop); they are not stored.
        w_rows = (cols % inter).to(tl.int64)
        w_base = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None]
        gate_ptrs = w_base + w_rows[None, :] * stride_wn
        up_ptrs = w_base + (w_rows + inter)[None, :] * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(offs_k < hidden - k0)[None, :], other=0.0)
        if TMA:
            gate = tl.trans(w_ptr.load([gate_row, k0]))
            up = tl.trans(w_ptr.load([gate_row + inter, k0]))
        elif EVEN_K:
            gate = tl.load(gate_ptrs)
            up = tl.load(up_ptrs)
        else:
            k_mask = offs_k < hidden - k0
            gate = tl.load(gate_ptrs, mask=k_mask[:, None], other=0.0)
            up = tl.load(up_ptrs, mask=k_mask[:, None], other=0.0)
        if INTERPRET:
            # The interpreter's tl.dot multiplies raw bfloat16 bits: compute in float32 there.
            a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        if not TMA:
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
    # As HF and silu_and_mul: gate and up rounded to the model dtype, then silu(gate), then the product.
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)
    out_offsets = rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptr + out_offsets, act.to(dtype), mask=(cols < inter)[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, weights_ptr, num_pairs, inter, hidden,
                     stride_a, stride_we, stride_wn, stride_out,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
                     TMA: tl.constexpr, PAIR_BLOCKS: tl.constexpr):
    # TMA: a_ptr and w_ptr are descriptors over the intermediate [P, N] (BLOCK_M x BLOCK_K tiles) and
    # w2 as [E * H, N] (BLOCK_N x BLOCK_K tiles); K past N reads zeros.
    pid_m, pid_n, expert = _tile(block_expert_ptr, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = _block_pairs(sorted_ptr, pid_m, num_pairs, BLOCK_M, PAIR_BLOCKS)
    valid = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Every slot of a used block holds a finite intermediate row (padding: x[0]'s): no row mask.
    if not TMA:
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
        w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + (cols % hidden).to(tl.int64)[None, :] * stride_wn
                  + offs_k[:, None])
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if TMA:
            a = a_ptr.load([pid_m * BLOCK_M, k0])
            w = tl.trans(w_ptr.load([expert * hidden + pid_n * BLOCK_N, k0]))
        elif EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if INTERPRET:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if not TMA:
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_offsets = pairs.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols < hidden)[None, :])


@triton.jit
def _moe_sum_kernel(rows_ptr, y_ptr, top_k, hidden, stride_y, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in range(top_k):
        acc += tl.load(rows_ptr + (token * top_k + j) * hidden + cols, mask=mask, other=0.0)
    tl.store(y_ptr + token * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


# Up to this many tokens a block per pair beats the align launch it saves (its experts are distinct
# but for a few); past it, experts read twice by blocks of one pair cost more (bench/NOTES-moe.md).
_PAIR_BLOCKS_TOKENS = 2


def _rows_per_expert(experts, tokens):
    return tokens * 8 // experts  # Qwen3-MoE routes each token to 8 experts


# Candidate (BLOCK_N, BLOCK_K, num_warps, num_stages) of each GEMM: decode-sized blocks stream
# weights (narrow, deep tiles: enough programs to fill the SMs); prefill tiles feed wgmma.
_SMALL_UP = [(16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4)]
_SMALL_DOWN = [(32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3)]
_LARGE_UP = [(64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 8, 3)]
_LARGE_DOWN = [(128, 64, 4, 4), (128, 64, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4), (128, 128, 8, 3)]


def _config(block_m, up, down, group_m=8):
    return {"BLOCK_M": block_m, "BLOCK_N": up[0], "BLOCK_K": up[1], "GROUP_M": group_m, "num_warps": up[2],
            "num_stages": up[3], "DOWN_BLOCK_N": down[0], "DOWN_BLOCK_K": down[1], "DOWN_WARPS": down[2],
            "DOWN_STAGES": down[3], "PAIR_BLOCKS": 0}


def _space(dtype, experts, inter, hidden, tokens):
    if dtype == "float32":
        return [_config(block_m, (32, 32, 4, 2), (32, 32, 4, 2)) for block_m in (16, 32, 64)]
    rows = _rows_per_expert(experts, tokens)
    block_ms = (16,) if rows <= 8 else (16, 32, 64) if rows <= 64 else (64, 128)
    configs = [_config(block_m, up, down) for block_m in block_ms
               for up, down in ([(u, d) for u in _SMALL_UP for d in _SMALL_DOWN] if block_m <= 32 else
                                [(u, d) for u in _LARGE_UP for d in _LARGE_DOWN])]
    if tokens <= _PAIR_BLOCKS_TOKENS * 2:
        configs += [config | {"PAIR_BLOCKS": 1} for config in configs if config["BLOCK_M"] == 16]
    return configs


def _default(dtype, experts, inter, hidden, tokens):
    rows = _rows_per_expert(experts, tokens)
    block_m = 16 if rows <= 16 else 32 if rows <= 64 else 64 if rows <= 256 else 128
    pairs = {"PAIR_BLOCKS": int(tokens <= _PAIR_BLOCKS_TOKENS)}
    if dtype == "float32":  # exact float32 products run on FMA: small tiles
        return _config(min(block_m, 32), (32, 32, 4, 2), (32, 32, 4, 2)) | pairs
    if block_m <= 32:
        return _config(block_m, (32, 128, 4, 4), (64, 128, 4, 4)) | pairs
    if block_m == 64:
        return _config(block_m, (64, 64, 4, 4), (128, 64, 4, 4))
    return _config(block_m, (128, 64, 8, 4), (256, 64, 8, 4))


_TUNING = tuning.Tunable("fused_moe", _space, _default)


def fused_moe_bucket(dtype: torch.dtype, experts: int, inter: int, hidden: int, tokens: int) -> tuple:
    """The tuning bucket of fused_moe: x's dtype, E, N (w13 is [E, 2N, H]), H and T."""
    return tuning.dtype_name(dtype), tuning.pow2(experts), tuning.pow2(inter), tuning.pow2(hidden), tuning.pow2(tokens)


def _split(config: dict) -> tuple[dict, dict]:
    """The gate/up and down launch configs of a fused_moe config; DOWN_* default to the gate/up ones."""
    up = {key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    up["GROUP_M"] = config.get("GROUP_M", 8)
    down_keys = {"BLOCK_N": "DOWN_BLOCK_N", "BLOCK_K": "DOWN_BLOCK_K", "num_warps": "DOWN_WARPS",
                 "num_stages": "DOWN_STAGES"}
    down = up | {key: config.get(name, up[key]) for key, name in down_keys.items()}
    return up, down


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, out: torch.Tensor | None = None, config: dict | None = None,
              real_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate) * up), e = topk_ids[t, j], [gate; up] = w13[e] @ x[t].

    x: [T, H] float32/float16/bfloat16 (rows may be strided). w13: [E, 2N, H] of x's dtype, rows
    0..N-1 the gate projection, N..2N-1 the up projection; w2: [E, H, N] of x's dtype (both
    contiguous in the last dim). topk_weights: [T, k] float32, topk_ids: [T, k] int32 in [0, E),
    both contiguous (moe_route's). Gate and up are rounded to x's dtype, silu(gate) rounded, the
    product rounded (as HF and silu_and_mul); the down projection accumulates in float32, is
    multiplied by the float32 weight and rounded to x's dtype (as HF rounds each expert's term), and
    the k terms are summed in float32 in order j = 0..k-1 and rounded once, so the result is the
    same on every run.

    No host sync; the grids and the scratch (the [P, N] intermediate, a [T*k, H] of x's dtype when
    k > 1) are fixed by the shapes and the config. out: optional [T, H] output written in place.
    config: overrides the tuned config (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages
    of the gate/up GEMM; DOWN_BLOCK_N, DOWN_BLOCK_K, DOWN_WARPS, DOWN_STAGES of the down GEMM,
    each defaulting to its gate/up counterpart; PAIR_BLOCKS 1: a block per pair, no align).
    real_tokens: optional int32 [1] on x's device; rows t >= real_tokens[0] are padding (a CUDA
    graph's), their pairs may be skipped and their rows of y are unspecified.
    Returns y [T, H] of x's dtype (`out` if given).
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    num_tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != hidden or w13.stride(2) != 1:
        raise ValueError(f"w13 must be [E, 2N, H = {hidden}] contiguous in H, got {tuple(w13.shape)}")
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if experts < 1 or inter < 1:
        raise ValueError(f"w13 must hold E >= 1 experts of width N >= 1, got {tuple(w13.shape)}")
    if tuple(w2.shape) != (experts, hidden, inter) or w2.stride(2) != 1:
        raise ValueError(f"w2 must be [E, H, N] = {(experts, hidden, inter)} contiguous in N, got {tuple(w2.shape)}")
    check_dtype("x", x, FLOATS)
    check_dtype("topk_ids", topk_ids, INDICES)
    if not x.dtype == w13.dtype == w2.dtype:
        raise ValueError(f"x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    top_k = topk_ids.shape[-1] if topk_ids.dim() else 0
    if top_k < 1 or topk_ids.shape != (num_tokens, top_k) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights and topk_ids must be [T = {num_tokens}, k >= 1], got "
                         f"{tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32 or not (topk_weights.is_contiguous() and topk_ids.is_contiguous()):
        raise ValueError("topk_weights must be float32, and both routing tensors contiguous")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be [T, H] = {tuple(x.shape)} of {x.dtype} with contiguous rows")
    check_writable("out", out)
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if num_tokens == 0:
        return y
    precision = dot_precision(x.dtype)

    def descriptor(t, rows, block):
        """A TMA descriptor over t as [rows, t.shape[-1]] of `block` tiles, or t itself (pointers)
        where TMA does not apply: rows not 16-byte multiples, t not contiguous or aligned, no TMA."""
        if not (t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0):
            return t
        if t.is_cuda and not tuning.has_tma(t.device.index):
            return t
        shape = [rows, t.shape[-1]]
        return TensorDescriptor(t.view(shape), shape, [shape[1], 1], block)

    def launch(cfg):
        up, down = _split(cfg)
        pair_blocks = bool(cfg.get("PAIR_BLOCKS", 0))
        if pair_blocks:  # block b is pair b: its expert is topk_ids' b-th entry, no slot table
            block_expert = sorted_ids = topk_ids.view(-1).to(torch.int32)  # TMA offsets are 32-bit
        else:
            sorted_ids, block_expert, _ = moe_align(topk_ids, experts, up["BLOCK_M"], real_tokens=real_tokens)
        num_blocks = block_expert.shape[0]
        act = torch.empty(num_blocks * up["BLOCK_M"], inter, dtype=x.dtype, device=x.device)
        w13_tiles = descriptor(w13, experts * 2 * inter, [up["BLOCK_N"], up["BLOCK_K"]])
        _moe_gate_up_kernel[(num_blocks * triton.cdiv(inter, up["BLOCK_N"]),)](
            x, w13_tiles, act, sorted_ids, block_expert, topk_ids.numel(), top_k, inter, hidden,
            x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
            EVEN_K=hidden % up["BLOCK_K"] == 0, DOT_PRECISION=precision, INTERPRET=tuning.INTERPRET,
            TMA=w13_tiles is not w13, PAIR_BLOCKS=pair_blocks, **up)
        # Rows summed in a fixed order by a second launch: atomics would reorder the adds run to run.
        rows = y if top_k == 1 else torch.empty(topk_ids.numel(), hidden, dtype=x.dtype, device=x.device)
        w2_tiles = descriptor(w2, experts * hidden, [down["BLOCK_N"], down["BLOCK_K"]])
        act_tiles = descriptor(act, act.shape[0], [down["BLOCK_M"], down["BLOCK_K"]])
        tma = w2_tiles is not w2 and act_tiles is not act
        _moe_down_kernel[(num_blocks * triton.cdiv(hidden, down["BLOCK_N"]),)](
            act_tiles if tma else act, w2_tiles if tma else w2, rows, sorted_ids, block_expert, topk_weights,
            topk_ids.numel(), inter, hidden, act.stride(0), w2.stride(0), w2.stride(1), rows.stride(0),
            EVEN_K=inter % down["BLOCK_K"] == 0, DOT_PRECISION=precision, INTERPRET=tuning.INTERPRET, TMA=tma,
            PAIR_BLOCKS=pair_blocks, **down)
        if top_k > 1:
            block_h = min(1024, tuning.pow2(hidden))
            _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
                rows, y, top_k, hidden, y.stride(0), BLOCK_H=block_h, num_warps=4)

    if config is None:
        bucket = fused_moe_bucket(x.dtype, experts, inter, hidden, num_tokens)
        config = _TUNING.config(bucket, tuning.tuning_launcher(launch, x.is_cuda, num_tokens))
    launch(config)
    return y
