"""Repetition, frequency and presence penalties on the logits, from token counts kept on the device.

Each sequence with penalties owns a row of two [R, V] buffers: `counts` (int32, how often each
token was generated) and `prompt_mask` (uint8, which tokens its prompt holds). `count_tokens`
adds a step's sampled ids to the counts on the device, so the host never loops over the
vocabulary nor waits for the ids; `apply_penalties` reads a batch row's buffer row through
`rows` (-1: no penalties, the logits row is left as is). Both have grids fixed by the shapes and
never sync the host, so they can be captured in a CUDA graph.
"""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.checks import INDICES, ROW_FLOATS, check_logits, check_rows, check_writable

PENALTY_BLOCK = 1024  # vocabulary elements a program; a row's tiles spread over the SMs
COUNT_BLOCK = 128  # (row, token) pairs a program


# The penalties may be rows of one packed tensor, at any offset: one compile whatever their alignment.
@triton.jit(do_not_specialize_on_alignment=["presence_ptr", "frequency_ptr", "repetition_ptr"])
def _apply_penalties_kernel(logits_ptr, stride, counts_ptr, counts_stride, mask_ptr, mask_stride, rows_ptr,
                            presence_ptr, frequency_ptr, repetition_ptr, V, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    slot = tl.load(rows_ptr + b).to(tl.int64)
    if slot >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < V
        ptrs = logits_ptr + b.to(tl.int64) * stride + offs
        x = tl.load(ptrs, mask=valid, other=0.0).to(tl.float32)
        count = tl.load(counts_ptr + slot * counts_stride + offs, mask=valid, other=0)
        in_prompt = tl.load(mask_ptr + slot * mask_stride + offs, mask=valid, other=0) != 0
        rep = tl.load(repetition_ptr + b).to(tl.float32)
        # HF / vLLM: a seen token's positive logit is divided by the penalty, a negative one multiplied.
        x = tl.where((count > 0) | in_prompt, tl.where(x > 0, tl.div_rn(x, rep), x * rep), x)
        x = x - tl.load(frequency_ptr + b).to(tl.float32) * count.to(tl.float32)
        x = x - tl.where(count > 0, tl.load(presence_ptr + b).to(tl.float32), 0.0)
        tl.store(ptrs, x.to(logits_ptr.dtype.element_ty), mask=valid)


# N varies with the batch, and a request's token ids start wherever its pairs split: one compile.
@triton.jit(do_not_specialize=["N"], do_not_specialize_on_alignment=["rows_ptr", "token_ptr"])
def _count_tokens_kernel(counts_ptr, stride, rows_ptr, token_ptr, N, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(rows_ptr + offs, mask=offs < N, other=-1).to(tl.int64)
    tokens = tl.load(token_ptr + offs, mask=offs < N, other=0).to(tl.int64)
    on = rows >= 0
    ptrs = counts_ptr + tl.maximum(rows, 0) * stride + tokens
    if ACCUMULATE:  # a token may repeat within one call: atomics
        tl.atomic_add(ptrs, tl.full([BLOCK], 1, tl.int32), mask=on, sem="relaxed")
    else:
        tl.store(ptrs, tl.full([BLOCK], 1, tl.uint8), mask=on)


def _check_buffer(name: str, buffer: torch.Tensor, dtypes, vocab: int) -> None:
    if buffer.dim() != 2 or buffer.shape[1] != vocab or buffer.stride(1) != 1 or buffer.dtype not in dtypes:
        raise ValueError(f"{name} must be [rows, {vocab}] of {' or '.join(map(str, dtypes))} with contiguous rows, "
                         f"got {tuple(buffer.shape)} {buffer.dtype}")


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, rows: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalize logits [B, V] in place (float32 math, one rounding to the logits' dtype) and return them.

    Row b with r = rows[b] >= 0, c = counts[r] (int32 [R, V]), seen = (c > 0) | prompt_mask[r]
    (uint8 [R, V]): x = x / repetition[b] where seen and x > 0, x * repetition[b] where seen and
    x <= 0; then x -= frequency[b] * c + presence[b] * (c > 0). Rows with rows[b] < 0 are untouched.
    rows [B] int32/int64; presence, frequency, repetition [B] float (1 and 0s: no change).
    """
    batch, vocab = check_logits(logits)
    if logits.stride(1) != 1:
        raise ValueError("apply_penalties works in place: logits rows must be contiguous")
    check_writable("logits", logits)
    check_rows(batch, INDICES, rows=rows)
    check_rows(batch, ROW_FLOATS, presence=presence, frequency=frequency, repetition=repetition)
    _check_buffer("counts", counts, (torch.int32,), vocab)
    _check_buffer("prompt_mask", prompt_mask, (torch.uint8,), vocab)
    if batch == 0:
        return logits
    _apply_penalties_kernel[(batch, triton.cdiv(vocab, PENALTY_BLOCK))](
        logits, logits.stride(0), counts, counts.stride(0), prompt_mask, prompt_mask.stride(0), rows,
        presence, frequency, repetition, vocab, BLOCK=PENALTY_BLOCK, num_warps=4)
    return logits


def count_tokens(counts: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """In place: counts[rows[i], token_ids[i]] += 1 for an int32 counts buffer, = 1 for a uint8
    mask; pairs with rows[i] < 0 are skipped. rows, token_ids [N] int32/int64, tokens in [0, V)."""
    _check_buffer("counts", counts, (torch.int32, torch.uint8), counts.shape[-1] if counts.dim() else 0)
    check_writable("counts", counts)
    n = rows.numel()
    check_rows(n, INDICES, rows=rows, token_ids=token_ids)
    if n == 0:
        return
    _count_tokens_kernel[(triton.cdiv(n, COUNT_BLOCK),)](
        counts, counts.stride(0), rows, token_ids, n, ACCUMULATE=counts.dtype == torch.int32, BLOCK=COUNT_BLOCK,
        num_warps=4)
