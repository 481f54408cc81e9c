"""Log-probability of one chosen token per row: one online max / sum-exp pass over the logits."""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.tuning import Tunable, dtype_name, pow2


@triton.jit
def _compute_logprobs_kernel(logits_ptr, stride, token_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    m = float("-inf")
    z = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        # An all -inf prefix keeps m = -inf: rescale against 0 there, not -inf (NaN).
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        z = z * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), 0)
        m = m_new
    x_token = tl.load(row_ptr + tl.load(token_ptr + row).to(tl.int64)).to(tl.float32)
    tl.store(out_ptr + row, x_token - m - tl.log(z))


def _space(dtype, vocab):
    return [{"BLOCK": block, "num_warps": warps} for block in (1024, 2048, 4096, 8192) for warps in (4, 8, 16)
            if block <= max(vocab, 1024)]


def _default(dtype, vocab):
    return {"BLOCK": min(4096, max(vocab, 128)), "num_warps": 8}


_TUNING = Tunable("compute_logprobs", _space, _default)


def compute_logprobs_bucket(dtype: torch.dtype, vocab: int) -> tuple:
    """The tuning bucket of compute_logprobs on [B, vocab] logits of `dtype` (any B)."""
    return dtype_name(dtype), pow2(vocab)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits.float())[b, token_ids[b]] for every row b.

    logits [B, V] float32/float16/bfloat16 (rows may be strided); token_ids [B] int32/int64, each
    in [0, V). Returns float32 [B]; nothing is modified in place.
    """
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out

    def launch(config):
        _compute_logprobs_kernel[(batch,)](logits, logits.stride(0), token_ids, out, vocab, **config)

    launch(_TUNING.config(compute_logprobs_bucket(logits.dtype, vocab), launch))
    return out
