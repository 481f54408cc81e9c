"""The threshold search of sample (kernels/sampler_search.py): on every path (the scratch, the
top-k lane bound, the row search past the scratch) the allowed set {x >= T} equals the support of
reference.sampling_probs exactly, and the draws keep its frequencies.
"""
import math

import pytest
import torch
from kernel_utils import DEVICE, randn
from sampler_utils import assert_allowed_sets, assert_frequencies, draws, flat_row, params

from tritonllm.kernels import reference
from tritonllm.kernels.sampler import sample_with_threshold


def test_ties_at_the_thresholds_are_kept():
    # Ten tokens share the largest logit: top-k 3, and top-p 0.05, both land inside the tie.
    x = torch.zeros(100, device=DEVICE)
    x[20:30] = 2.0
    x[50] = 1.0
    for top_k, top_p in ((3, 1.0), (0, 0.05), (3, 0.05)):
        probs = reference.sampling_probs(x[None], *params(1, 1.0, top_k, top_p))[0]
        assert int((probs > 0).sum()) == 10
        assert_frequencies(draws(x, 1.0, top_k, top_p), probs)


@pytest.mark.parametrize("vocab", [7, 100, 1000])
def test_allowed_sets_random_parameters(vocab):
    gen = torch.Generator().manual_seed(vocab)
    batch = 24
    logits = (torch.randn(batch, vocab, generator=gen) * torch.rand(batch, 1, generator=gen) * 6).to(DEVICE)
    logits[: batch // 3] = logits[: batch // 3].round()  # many ties
    temperature = (0.2 + 2 * torch.rand(batch, generator=gen)).to(DEVICE)

    def some(values, off, share):  # each filter is on in about `share` of the rows
        return values.where(torch.rand(batch, generator=gen) < share, torch.full_like(values, off)).to(DEVICE)

    top_k = some(torch.randint(0, vocab + 3, (batch,), generator=gen), 0, 0.7)
    top_p = some(torch.rand(batch, generator=gen), 1.0, 0.7)
    min_p = some(torch.rand(batch, generator=gen) * 0.3, 0.0, 0.5)
    ids, thr = sample_with_threshold(logits, temperature, top_k, top_p, min_p, torch.arange(batch, device=DEVICE))
    probs = reference.sampling_probs(logits, temperature, top_k, top_p, min_p)
    assert_allowed_sets(logits, thr, probs)
    assert (probs[torch.arange(batch), ids] > 0).all()


def test_nan_logits_count_as_minus_infinity():
    logits = flat_row(100).expand(4, -1).contiguous()
    logits[:, ::7] = float("nan")
    logits[:, 3] = float("nan")
    temperature, top_k, top_p, min_p = params(4, 1.0, [5, 0, 0, 0], [0.9, 0.8, 1.0, 1.0], [0.0, 0.0, 0.2, 0.0])
    ids, thr = sample_with_threshold(logits, temperature, top_k, top_p, min_p, torch.arange(4, device=DEVICE))
    probs = reference.sampling_probs(logits.nan_to_num(nan=-math.inf), temperature, top_k, top_p, min_p)
    assert_allowed_sets(logits[:3], thr[:3], probs[:3])
    assert (probs[torch.arange(4), ids] > 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    # Low precision logits tie a lot; the kernel sees exactly the upcast values.
    logits = randn(8, 1000, dtype=dtype, scale=2.0)
    temperature, top_k, top_p, min_p = params(8, 0.9, 40, 0.8, 0.02)
    ids, thr = sample_with_threshold(logits, temperature, top_k, top_p, min_p, torch.arange(8, device=DEVICE))
    probs = reference.sampling_probs(logits.float(), temperature, top_k, top_p, min_p)
    assert_allowed_sets(logits, thr, probs)
    assert (probs[torch.arange(8), ids] > 0).all()


def test_large_vocabulary():
    vocab = 151936
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, vocab, generator=gen) * torch.tensor([[3.0], [1.0]])).to(DEVICE)
    # Row 0 takes the candidate path; row 1 (top-p alone on flat logits keeps ~10^4 tokens)
    # overflows the scratch and searches the row itself.
    temperature, top_k, top_p, min_p = (torch.tensor(v, device=DEVICE)
                                        for v in ([0.8, 1.0], [50, 0], [0.9, 0.3], [0.01, 0.0]))
    seeds = torch.tensor([3, 4], device=DEVICE)
    ids, thr = sample_with_threshold(logits, temperature, top_k, top_p, min_p, seeds)
    probs = reference.sampling_probs(logits, temperature, top_k, top_p, min_p)
    assert 10 < int((probs[0] > 0).sum()) <= 50 and int((probs[1] > 0).sum()) > 4096
    assert_allowed_sets(logits, thr, probs)
    assert (probs[torch.arange(2), ids] > 0).all()


def test_scratch_overflow_path_matches_candidate_path():
    # CAP 16 sends most rows through the row-search path and makes rows with top-k use the lane
    # bound; BLOCK 64 cuts the row into 4 parts of 256, whose candidates the row gathers (CAP 512:
    # 128 slots a part) or, where a part has more than its slots (CAP 64: 16), collects from the
    # row; FILTER_TILES 64 makes the whole row one part. Tokens and allowed sets must not change.
    gen = torch.Generator().manual_seed(2)
    batch, vocab = 7, 1000
    logits = (torch.randn(batch, vocab, generator=gen) * 2).to(DEVICE)
    logits[4] = torch.linspace(-3, 3, vocab)  # the top 40 sit in distinct lanes: the lane bound is tight
    logits[5:] = 1.0  # one tie over the row: the row search closes at once, nothing to copy
    temperature, top_k, top_p, min_p = params(batch, 1.0, [0, 40, 0, 200, 40, 0, 10],
                                               [0.5, 0.9, 1.0, 0.95, 0.9, 0.5, 0.3], [0, 0, 0.02, 0, 0, 0, 0])
    seeds = torch.arange(batch, device=DEVICE) + 100
    args = (logits, temperature, top_k, top_p, min_p, seeds)
    ids, thr = sample_with_threshold(*args)
    assert_allowed_sets(logits, thr, reference.sampling_probs(logits, temperature, top_k, top_p, min_p))
    for config in ({"BLOCK": 128, "CAP": 16, "num_warps": 4, "FILTER_TILES": 4},
                   {"BLOCK": 256, "CAP": 1024, "num_warps": 4, "FILTER_TILES": 4},
                   {"BLOCK": 128, "CAP": 1, "num_warps": 4, "FILTER_TILES": 4},  # CAP 1: the row search runs to the end
                   {"BLOCK": 64, "CAP": 512, "num_warps": 4, "FILTER_TILES": 4},
                   {"BLOCK": 64, "CAP": 64, "num_warps": 4, "FILTER_TILES": 4},
                   {"BLOCK": 64, "CAP": 512, "num_warps": 4, "FILTER_TILES": 64}):  # one part: the whole row
        other_ids, other_thr = sample_with_threshold(*args, config=config)
        assert torch.equal(ids, other_ids), config
        assert torch.equal(logits >= thr[:, None], logits >= other_thr[:, None]), config


def test_overflow_path_frequencies():
    # Top-p alone on flat logits keeps ~85% of 1000 tokens, far more than CAP 128: the search narrows
    # over the row until the bracket fits the scratch, ends there, and the race runs over the row.
    x = flat_row(1000, scale=0.5)
    probs = reference.sampling_probs(x[None], *params(1, 0.8, 0, 0.95))[0]
    assert int((probs > 0).sum()) > 500
    config = {"BLOCK": 256, "CAP": 128, "num_warps": 4, "FILTER_TILES": 4}
    assert_frequencies(draws(x, 0.8, 0, 0.95, config=config), probs)


def extreme_rows(vocab=2000):
    """Rows the value-spaced pivots handle badly: masked tokens at the float32 minimum, values over
    many decades on both sides of 0, bfloat16 ties, and integers with +-0. Returns (rows [4, vocab],
    the filters of each as (top_k, top_p) pairs: top-p only where float32 masses tell values apart;
    the float64 reference ties values whose probabilities round equal, so none are below 1e-15)."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(4, vocab, generator=gen)
    rows = base.clone()
    rows[0] = torch.where(torch.rand(vocab, generator=gen) < 0.3, torch.finfo(torch.float32).min, 3 * base[0])
    rows[1] = base[1].sign() * 10 ** (torch.rand(vocab, generator=gen) * 16.5 - 15)
    rows[2] = (4 * base[2]).bfloat16().float()
    rows[3] = (base[3] * 2).round() * 0.5  # -0.0 where base rounds to -0
    filters = [[(0, 0.9), (100, 0.95), (1000, 1.0)], [(10, 1.0), (500, 1.0), (1500, 1.0)],
               [(50, 1.0), (0, 0.9), (300, 0.5)], [(300, 1.0), (1, 1.0)]]
    return rows.to(DEVICE), filters


def test_min_p_at_large_logits_and_a_small_temperature():
    # m + t log(min_p) rounds to the grid of m: at 1e4 and t = 0.01 a grid step is about 10% of the
    # ratio p / p_max, so the rounded bound kept a token at ratio 0.458 for min_p 0.476.
    for top, min_p in ((1e4, 0.4759), (6e4, 0.5)):
        row = torch.tensor([top], dtype=torch.float32)
        for _ in range(10):
            row = torch.cat([row, torch.nextafter(row[-1:], torch.tensor(-math.inf))])
        logits = row[None].to(DEVICE)
        filters = params(1, 0.01, 0, 1.0, min_p)
        ids, thr = sample_with_threshold(logits, *filters, torch.arange(1, device=DEVICE))
        probs = reference.sampling_probs(logits, *filters)
        assert_allowed_sets(logits, thr, probs)
        assert probs[0, ids[0]] > 0


@pytest.mark.parametrize("config", [None, {"BLOCK": 256, "CAP": 64, "num_warps": 4, "FILTER_TILES": 4},
                                    {"BLOCK": 128, "CAP": 512, "num_warps": 4, "FILTER_TILES": 8}])
def test_allowed_sets_on_extreme_values(config):
    # CAP 64: most rows overflow the scratch and search the row; CAP 512: top-k <= 128 rows use the lane bound.
    rows, filters = extreme_rows()
    picks = [(b, k, p) for b in range(len(rows)) for k, p in filters[b]]
    logits = torch.stack([rows[b] for b, _, _ in picks])
    temperature, top_k, top_p, min_p = params(len(picks), 1.0, [k for _, k, _ in picks], [p for _, _, p in picks])
    ids, thr = sample_with_threshold(logits, temperature, top_k, top_p, min_p, torch.arange(len(picks), device=DEVICE),
                                     config=config)
    probs = reference.sampling_probs(logits, temperature, top_k, top_p, min_p)
    assert_allowed_sets(logits, thr, probs)
    assert (probs[torch.arange(len(picks)), ids] > 0).all()


def test_top_p_at_a_mass_boundary_does_not_move_with_the_part_size():
    # p is the float32 share of each row's top 20-42 tokens, so p * z sits within rounding of a
    # cumulative mass: T moves if z's float32 sum does. The part size (FILTER_TILES, which follows
    # the batch) must not change it: a row's draw never depends on its batch.
    gen = torch.Generator().manual_seed(7)
    batch, vocab = 12, 3000
    logits = torch.randn(batch, vocab, generator=gen)
    shares = []
    for b in range(batch):
        probs = torch.sort(torch.exp(logits[b] - logits[b].max()), descending=True).values.double()
        shares.append(float(probs[:20 + 2 * b].sum() / probs.sum()))
    temperature, top_k, _, min_p = params(batch, 1.0, 0, 1.0, 0.0)
    top_p = torch.tensor(shares, dtype=torch.float32, device=DEVICE)
    args = (logits.to(DEVICE), temperature, top_k, top_p, min_p, torch.arange(batch, device=DEVICE))
    ids, thr = sample_with_threshold(*args, config={"BLOCK": 64, "CAP": 1024, "num_warps": 4, "FILTER_TILES": 4})
    for tiles in (8, 64):
        other_ids, other_thr = sample_with_threshold(*args, config={"BLOCK": 64, "CAP": 1024, "num_warps": 4,
                                                                     "FILTER_TILES": tiles})
        assert torch.equal(thr, other_thr), tiles
        assert torch.equal(ids, other_ids), tiles
