"""compute_logprobs against the float64 reference log_softmax."""
import math

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, randn

from tritonllm.kernels import compute_logprobs, reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, vocab", [(1, 7), (5, 100), (3, 1000), (2, 151936)])
def test_compute_logprobs(batch, vocab, dtype):
    logits = randn(batch, vocab, dtype=dtype, scale=3.0)
    tokens = torch.randint(0, vocab, (batch,), device=DEVICE, dtype=torch.int32 if batch == 5 else torch.int64)
    out = compute_logprobs(logits, tokens)
    assert out.dtype == torch.float32 and out.shape == (batch,)
    # logprob = logit - logsumexp: float32 rounding of both terms (a few units) makes the error
    # absolute, so a log-probability near 0 gets an absolute bound, not a relative one.
    torch.testing.assert_close(out.double(), reference.compute_logprobs(logits.double(), tokens), rtol=1e-5, atol=4e-6)


def test_compute_logprobs_strided_rows_and_masked_logits():
    # Rows of a wider buffer; -inf logits (masked tokens) fill the whole first 4096-wide tile.
    logits = randn(3, 6000, scale=3.0)[:, :5000]
    logits[:, :4500] = -math.inf
    tokens = torch.tensor([4500, 4999, 0], device=DEVICE)
    out = compute_logprobs(logits, tokens)
    assert out[2] == -math.inf
    assert_close(out[:2], reference.compute_logprobs(logits.double(), tokens)[:2], torch.float32)
