"""apply_penalties and count_tokens (kernels/penalties.py) against their references."""
import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, randn

from tritonllm.kernels import apply_penalties, count_tokens, reference


def buffers(num_rows, vocab, generated, prompts):
    """counts [R, V] int32 and prompt_mask [R, V] uint8 filled through count_tokens from token lists."""
    counts = torch.zeros(num_rows, vocab, dtype=torch.int32, device=DEVICE)
    mask = torch.zeros(num_rows, vocab, dtype=torch.uint8, device=DEVICE)
    for buffer, lists in ((counts, generated), (mask, prompts)):
        rows = torch.tensor([r for r, tokens in enumerate(lists) for _ in tokens], device=DEVICE)
        tokens = torch.tensor([t for tokens in lists for t in tokens], device=DEVICE)
        count_tokens(buffer, rows, tokens)
    return counts, mask


def test_count_tokens_counts_repeats_and_skips_negative_rows():
    vocab = 301
    generated = [[5, 5, 5, 300, 0], [], [7] * 200 + [8]]  # 206 pairs: two programs, repeats across them
    counts, mask = buffers(4, vocab, generated, [[1, 1, 299], [2], []])
    want = torch.zeros(4, vocab, dtype=torch.int32)
    for r, tokens in enumerate(generated):
        for t in tokens:
            want[r, t] += 1
    assert torch.equal(counts.cpu(), want)
    assert mask.sum() == 3 and mask[0, 1] == 1 and mask[0, 299] == 1 and mask[1, 2] == 1
    rows, tokens = torch.tensor([-1, 3, -5], device=DEVICE), torch.tensor([4, 4, 9], device=DEVICE, dtype=torch.int32)
    for fn in (count_tokens, reference.count_tokens):
        fn(counts, rows, tokens)
    assert counts[3].tolist() == [0] * 4 + [2] + [0] * (vocab - 5) and torch.equal(counts[:3].cpu(), want[:3])
    again = counts.clone()
    reference.count_tokens(again, torch.tensor([0, 0], device=DEVICE), torch.tensor([5, 5], device=DEVICE))
    assert again[0, 5] == 5  # the reference accumulates repeats too


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
def test_apply_penalties_matches_the_reference(dtype, batch):
    vocab = 2053  # odd, three tiles
    counts, mask = buffers(5, vocab, [[3, 3, 10, 2052], [], [100] * 7 + [0], [50], [9]],
                           [[3, 11, 12], [1, 2], [], [50, 51], []])
    logits = randn(batch, vocab, dtype=dtype, scale=3.0)
    logits[:, 3] = 2.0  # seen twice, positive
    logits[:, 11] = -2.0  # prompt only, negative
    logits[0, 10] = float("-inf")
    rows = torch.tensor([4, 0, -1][:batch] if batch == 3 else [0], device=DEVICE, dtype=torch.int32)
    presence = torch.tensor([0.5, -1.5, 2.0][:batch], device=DEVICE)
    frequency = torch.tensor([0.25, 2.0, -2.0][:batch], device=DEVICE)
    repetition = torch.tensor([1.3, 0.7, 1.0][:batch], device=DEVICE)
    if batch == 1:
        presence, frequency, repetition = presence[:1] * 0 + 0.5, frequency[:1] * 0 + 1.0, repetition[:1] * 0 + 1.3
    want = reference.apply_penalties(logits.double(), counts, mask, rows, presence, frequency, repetition)
    original = logits.clone()
    out = apply_penalties(logits, counts, mask, rows, presence, frequency, repetition)
    assert out is logits
    finite = want.isfinite()
    assert torch.equal(finite, logits.isfinite()) and (logits[~finite] == want[~finite].to(dtype)).all()
    assert_close(logits[finite], want[finite], dtype)
    for b, row in enumerate(rows.tolist()):
        if row < 0:  # a row without penalties is untouched, bit for bit
            assert torch.equal(logits[b], original[b])
    if batch == 1:  # by hand: token 3 seen (count 2, and in the prompt): 2.0 / 1.3 - 1.0 * 2 - 0.5
        assert logits[0, 3].double().item() == pytest.approx(2.0 / 1.3 - 2.5, rel=1e-2 if dtype != torch.float32 else 1e-6)
        assert logits[0, 11].double().item() == pytest.approx(-2.6, rel=1e-2)  # prompt only: -2.0 * 1.3
        assert torch.equal(logits[0, 13:2052], original[0, 13:2052])  # never seen


def test_default_penalties_change_nothing_and_nan_stays_nan():
    vocab = 777
    counts, mask = buffers(2, vocab, [[1, 2, 2], [5]], [[3], [6]])
    logits = randn(2, vocab)
    logits[1, 5] = float("nan")
    original = logits.clone()
    ones, zeros = torch.ones(2, device=DEVICE), torch.zeros(2, device=DEVICE)
    apply_penalties(logits, counts, mask, torch.tensor([0, 1], device=DEVICE), zeros, zeros, ones)
    assert torch.equal(logits[0], original[0]) and logits[1, 5].isnan()
    assert torch.equal(logits[1].nan_to_num(), original[1].nan_to_num())


def test_bad_buffers_are_errors():
    logits = randn(1, 10)
    counts, mask = buffers(1, 10, [[1]], [[2]])
    args = (torch.zeros(1, dtype=torch.int32, device=DEVICE), *[torch.ones(1, device=DEVICE)] * 3)
    with pytest.raises(ValueError, match="counts"):
        apply_penalties(logits, counts.long(), mask, *args)
    with pytest.raises(ValueError, match="prompt_mask"):
        apply_penalties(logits, counts, mask[:, :9], *args)
    with pytest.raises(ValueError, match="contiguous"):
        apply_penalties(randn(10, 2).t(), counts, mask, *args)
