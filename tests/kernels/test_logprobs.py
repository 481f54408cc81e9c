"""compute_logprobs and compute_top_logprobs against the float64 reference log_softmax."""
import math

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, randn

from tritonllm.kernels import compute_logprobs, compute_top_logprobs, reference


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


def check_top(logits, k):
    values, ids = compute_top_logprobs(logits, k)
    want_values, want_ids = reference.compute_top_logprobs(logits.double(), k)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64 and values.shape == ids.shape == (len(logits), k)
    assert torch.equal(ids, want_ids), (ids, want_ids)
    finite = want_values.isfinite()
    assert torch.equal(values.isfinite(), finite) and (values[~finite] == -math.inf).all()
    torch.testing.assert_close(values[finite].double(), want_values[finite], rtol=1e-5, atol=4e-6)
    assert (values[:, 1:] <= values[:, :-1]).all()
    return values, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, vocab, k", [(1, 7, 7), (3, 1000, 5), (5, 4099, 20), (2, 151936, 20)])
def test_compute_top_logprobs(batch, vocab, k, dtype):
    logits = randn(batch, vocab, dtype=dtype, scale=3.0)
    if vocab > 1000:
        logits[0] = torch.linspace(-5, 5, vocab, device=DEVICE)  # ascending: every tile moves entries in
    values, ids = check_top(logits, k)
    full = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(values.double(), full.gather(1, ids), rtol=1e-5, atol=4e-6)


def test_compute_top_logprobs_ties_infinities_and_nan():
    vocab = 5000
    logits = randn(4, vocab, scale=3.0).round()  # many ties, within and across 2048-wide tiles
    logits[0, [10, 2100, 4999]] = 50.0  # equal maxima in three tiles: lowest id first
    logits[1] = -math.inf
    logits[1, [4000, 7]] = 1.0  # two finite entries, then -inf ones by id
    logits[2] = -math.inf  # all -inf: ids 0..k-1, values -inf
    logits[3, :3000] = float("nan")  # NaN counts as -inf
    values, ids = check_top(logits, 6)
    assert ids[0, :3].tolist() == [10, 2100, 4999]
    assert ids[1].tolist() == [7, 4000, 0, 1, 2, 3] and values[1, 0].item() == values[1, 1].item() == pytest.approx(math.log(0.5))
    assert ids[2].tolist() == list(range(6)) and (values[2] == -math.inf).all()
    assert (ids[3] >= 3000).all()
    check_top(logits[:, :4097], 1)  # k = 1, a one-element last tile
    infinite = randn(1, 300)
    infinite[0, 7] = math.inf  # all the mass: its own logprob NaN (inf - inf, as log_softmax), the others -inf
    values, ids = compute_top_logprobs(infinite, 5)
    want_values, want_ids = reference.compute_top_logprobs(infinite.double(), 5)
    assert torch.equal(ids, want_ids) and ids[0, 0] == 7
    assert values[0, 0].isnan() and want_values[0, 0].isnan() and (values[0, 1:] == want_values[0, 1:]).all()
    with pytest.raises(ValueError, match="k=21"):
        compute_top_logprobs(logits, 21)
    with pytest.raises(ValueError, match="k=8"):
        compute_top_logprobs(logits[:, :7], 8)
