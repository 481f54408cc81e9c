"""sample (kernels/sampler.py) and reference.sample against the exact distribution of
reference.sampling_probs: frequencies, greedy rows, infinite logits, seeds (sampler_utils.py has
the NumPy replica of the kernel's race that the frequency tests rely on).
"""
import math

import pytest
import torch
from kernel_utils import DEVICE, DTYPES, randn
from sampler_utils import assert_allowed_sets, assert_frequencies, draws, flat_row, params, philox, replica

from tritonllm.kernels import reference, sample
from tritonllm.kernels.sampler import sample_with_threshold


# (vocab, temperature, top_k, top_p, min_p)
CASES = {
    "plain V7": (7, 1.0, 0, 1.0, 0.0),
    "top-k": (100, 1.0, 10, 1.0, 0.0),
    "top-p": (100, 1.0, 0, 0.7, 0.0),
    "min-p": (100, 1.0, 0, 1.0, 0.1),
    "all three": (1000, 0.8, 50, 0.9, 0.05),
    "k=1": (100, 1.0, 1, 1.0, 0.0),
    "k=V": (7, 1.0, 7, 1.0, 0.0),
    "k>V": (7, 0.5, 1000, 1.0, 0.0),
    "p near 0": (100, 1.0, 0, 1e-6, 0.0),
    "p=1 with k": (100, 1.3, 30, 1.0, 0.0),
    "t=1e-3": (100, 1e-3, 0, 1.0, 0.0),
    "t=100": (7, 100.0, 0, 1.0, 0.0),
}


@pytest.mark.parametrize("case", CASES)
def test_frequencies_match_sampling_probs(case):
    vocab, temperature, top_k, top_p, min_p = CASES[case]
    x = flat_row(vocab)
    if temperature < 0.01:
        x[3] = x.max() + 1e-3  # a near tie, so the sharp distribution is not a point mass
    probs = reference.sampling_probs(x[None], *params(1, temperature, top_k, top_p, min_p))[0]
    ids = draws(x, temperature, top_k, top_p, min_p)
    assert_frequencies(ids, probs)
    if case in ("k=1", "p near 0"):
        assert (ids == int(torch.argmax(x))).all()


@pytest.mark.parametrize("config", [None, {"BLOCK": 128, "CAP": 128, "num_warps": 4, "FILTER_TILES": 4}])  # one race chunk, or ten
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_is_argmax(dtype, config):
    logits = randn(6, 5000, dtype=dtype, scale=3.0)
    logits[1, 10] = logits[1, 4106] = logits[1].max() + 1  # tie (also in one lane of a 4096 tile): lower index
    logits[2, :5] = float("nan")  # NaN counts as -inf
    logits[2, 900] = float("nan")
    logits[3] = float("-inf")  # all -inf: token 0
    logits[4, 4999] = logits[4].max() + 1  # the last element
    logits[5] = logits[5].round()  # many ties
    temperature, top_k, top_p, min_p = params(6, 0.0, 5, 0.5, 0.1)  # filters are ignored for greedy rows
    ids, thr = sample_with_threshold(logits, temperature, top_k, top_p, min_p, config=config)
    expected = torch.argmax(logits.float().nan_to_num(nan=-math.inf), dim=-1)
    assert torch.equal(ids, expected) and ids.dtype == torch.int64
    assert int(ids[1]) == 10 and int(ids[3]) == 0
    assert torch.equal(thr, logits.float().nan_to_num(nan=-math.inf, neginf=-math.inf).amax(-1))  # T: the row max


def test_sampled_edge_rows_match_the_exact_distribution():
    # Rows drawn at temperature 1: NaN logits (as -inf), an all -inf row (token 0), min_p past 1 (the top token).
    logits = randn(3, 300, scale=2.0)
    logits[0, ::3] = float("nan")
    logits[1] = float("-inf")
    temperature, top_k, top_p, min_p = params(3, 1.0, 0, 1.0, [0.0, 0.0, 2.0])
    probs = reference.sampling_probs(logits, temperature, top_k, top_p, min_p)
    row = logits[0].double()
    assert torch.allclose(probs[0], torch.softmax(row.masked_fill(row.isnan(), -math.inf), -1))
    assert probs[1, 0] == 1 and probs[1].sum() == 1
    assert probs[2, int(logits[2].argmax())] == 1 and probs[2].sum() == 1
    for ids in (sample(logits, temperature, top_k, top_p, min_p, torch.arange(3, device=DEVICE)),
                reference.sample(logits, temperature, top_k, top_p, min_p, torch.arange(3, device=DEVICE))):
        assert (probs[torch.arange(3), ids] > 0).all()


def test_mixed_batch():
    x = flat_row(1000, scale=3.0)
    logits = x.expand(4, -1).contiguous()
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.2], device=DEVICE)
    top_k = torch.tensor([0, 0, 0, 20], device=DEVICE)
    top_p = torch.tensor([1.0, 0.8, 1.0, 1.0], device=DEVICE)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05], device=DEVICE)
    seeds = torch.tensor([5, 6, 7, 8], device=DEVICE)
    ids, thr = sample_with_threshold(logits, temperature, top_k, top_p, min_p, seeds)
    probs = reference.sampling_probs(logits, temperature, top_k, top_p, min_p)
    assert int(ids[0]) == int(torch.argmax(x))
    assert_allowed_sets(logits[1:], thr[1:], probs[1:])
    assert math.isinf(thr[2]) and thr[2] < 0  # plain temperature: no threshold
    xs = x.float().cpu().numpy()
    for b in range(1, 4):  # each row is the race over its own set, with its own seed
        assert int(ids[b]) == replica(xs, float(thr[b]), float(temperature[b]), [int(seeds[b])])[0]


def test_temperatures_below_min_temperature_are_greedy():
    # 1 / t overflowed the race at t = 1e-40 (subnormal: id 2**31 - 1 came back) and at 1e-37 (a
    # token of probability 0 won). Below 1e-5 a row is greedy, filtered or not, as in the references.
    x = flat_row(20000, scale=3.0)
    x[15000] = 45.0
    x[100] = 40.0
    rows = [(t, k) for t in (1e-40, 1e-37, 9.9e-6) for k in (0, 50)]
    temperature = torch.tensor([t for t, _ in rows], device=DEVICE)
    top_k = torch.tensor([k for _, k in rows], device=DEVICE)
    top_p, min_p = torch.ones(len(rows), device=DEVICE), torch.zeros(len(rows), device=DEVICE)
    logits = x.expand(len(rows), -1).contiguous()
    seeds = torch.arange(len(rows), device=DEVICE)
    assert sample(logits, temperature, top_k, top_p, min_p, seeds).tolist() == [15000] * len(rows)
    assert reference.sample(logits, temperature, top_k, top_p, min_p, seeds).tolist() == [15000] * len(rows)
    assert (reference.sampling_probs(logits, temperature, top_k, top_p, min_p)[:, 15000] == 1).all()
    # At float32(1e-5) itself every form samples: two logits 1e-5 apart share the mass (1 : e).
    edge = torch.zeros(1, 8, device=DEVICE)
    edge[0, 3], edge[0, 4] = 1e-5, 2e-5
    probs = reference.sampling_probs(edge, *params(1, 1e-5))[0]
    assert float(probs[4] / probs[3]) == pytest.approx(math.e, rel=1e-3) and probs[3] > probs[0] > 0
    # A float64 t just under 1e-5 rounds to float32(1e-5): the kernel reads float32 and samples, so
    # the references must not call the row greedy (they compared in float64).
    t64 = torch.tensor([1e-5 - 1e-15], dtype=torch.float64, device=DEVICE)
    ones, zeros = torch.ones(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    no_k = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    probs = reference.sampling_probs(edge, t64, no_k, ones, zeros)[0]
    assert float(probs[4] / probs[3]) == pytest.approx(math.e, rel=1e-3)
    drawn = {int(sample(edge, t64, no_k, ones, zeros, torch.tensor([s], device=DEVICE))[0]) for s in range(16)}
    assert len(drawn) > 1
    assert {int(reference.sample(edge, t64, no_k, ones, zeros, torch.tensor([s], device=DEVICE))[0])
            for s in range(16)} != {4}


def test_a_tie_across_race_chunks_at_a_small_temperature():
    # Two equal logits in different 8192-token chunks of the race: each is drawn half the time. The
    # chunks' winners used to be compared as absolute scores x / t + noise, about 1.5e7 here, where
    # float32 rounds the noise to whole units and ties went to the lower chunk.
    x = flat_row(16389, scale=1.0)
    x[100] = x[12000] = 300.0
    probs = reference.sampling_probs(x[None], *params(1, 2e-5))[0]
    assert probs[100] == probs[12000] == 0.5
    assert_frequencies(draws(x, 2e-5, n=1000), probs)  # the kernel's draws equal the replica's exact race


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf - inf, computed and then discarded
@pytest.mark.parametrize("config", [None, {"BLOCK": 128, "CAP": 128, "num_warps": 4, "FILTER_TILES": 4}])
def test_infinite_logits(config):
    # +inf takes all the mass: a row holding it returns its first +inf, greedy or sampled, filtered
    # or not, with T = +inf. Without +inf, NaN and -inf logits are never drawn nor allowed (T > -inf).
    x = flat_row(1000)
    x[[3, 500]] = math.nan
    x[[10, 700]] = -math.inf
    with_inf = x.clone()
    with_inf[[300, 600]] = math.inf  # in different 128-wide tiles, and in different race chunks at BLOCK 128
    x[[300, 600]] = -math.inf
    finite = int(x.isfinite().sum())
    # (temperature, top_k, top_p, min_p) of each row: every path of the kernel
    rows = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (1.0, 20, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.1),
            (0.8, 50, 0.9, 0.05), (1.0, finite + 2, 1.0, 0.0), (1.0, finite + 2, 0.99, 0.0)]
    temperature, top_k, top_p, min_p = (torch.tensor(column, device=DEVICE) for column in zip(*rows))
    seeds = torch.arange(len(rows), device=DEVICE)
    ids, thr = sample_with_threshold(with_inf.expand(len(rows), -1).contiguous(), temperature, top_k, top_p, min_p,
                                     seeds, config=config)
    assert ids.tolist() == [300] * len(rows)
    assert (thr == math.inf).all()

    logits = x.expand(len(rows), -1).contiguous()
    ids, thr = sample_with_threshold(logits, temperature, top_k, top_p, min_p, seeds, config=config)
    probs = reference.sampling_probs(logits.nan_to_num(nan=-math.inf, neginf=-math.inf), temperature, top_k, top_p,
                                     min_p)
    assert (probs[torch.arange(len(rows)), ids] > 0).all()
    assert_allowed_sets(logits[2:], thr[2:], probs[2:])  # row 0's T is the max, row 1's -inf (no filter)


def test_seeds():
    logits = flat_row(1000, scale=0.5).expand(8, -1).contiguous()
    temperature, top_k, top_p, min_p = params(8, 1.0, [0, 300] * 4)
    seeds = torch.arange(8, device=DEVICE) * 7
    first = sample(logits, temperature, top_k, top_p, min_p, seeds)
    assert torch.equal(first, sample(logits, temperature, top_k, top_p, min_p, seeds.clone()))
    assert len(set(first.tolist())) > 5  # different seeds, different tokens
    assert not torch.equal(first, sample(logits, temperature, top_k, top_p, min_p, seeds + 1))
    unseeded = [sample(logits, temperature, top_k, top_p, min_p) for _ in range(2)]
    assert not torch.equal(*unseeded)


@pytest.mark.parametrize("backend", [sample, reference.sample], ids=["triton", "reference"])
def test_a_seeded_row_ignores_its_batch(backend):
    # A request's token must not depend on the requests that share its step: the same logits,
    # parameters and seed give the same token alone and at any position of a batch of other rows
    # (other logits, parameters and seeds).
    gen = torch.Generator().manual_seed(7)
    x = flat_row(1000, scale=0.5)  # flat: hundreds of likely tokens, so a draw that moves shows
    for row in ((1.0, 0, 1.0, 0.0), (0.9, 50, 0.9, 0.02)):  # the race alone, then every filter
        tokens = []
        for seed in (3, 2**40 + 11, 2**62 - 5):
            alone = backend(x[None], *params(1, *row), torch.tensor([seed], device=DEVICE))
            for batch, position in ((2, 1), (5, 3)):
                logits = (torch.randn(batch, 1000, generator=gen) * 0.5).to(DEVICE)
                logits[position] = x
                seeds = torch.randint(0, 2**62, (batch,), generator=gen).to(DEVICE)
                seeds[position] = seed
                others = [[value if b == position else other for b in range(batch)]
                          for value, other in zip(row, (0.7, 20, 0.95, 0.1))]
                ids = backend(logits, *params(batch, *others), seeds)
                assert int(ids[position]) == int(alone[0]), (row, seed, batch, position)
            tokens.append(int(alone[0]))
        assert len(set(tokens)) > 1, "the seed must matter"


def test_a_zero_uniform_does_not_lose_the_only_candidate():
    # Philox gives 0 for token 3 under this seed (2 of the 2^32 outputs map to u = 0): its noise must
    # stay finite, or a row whose only candidate is token 3 would return token 0, a -inf logit.
    seed = 1343428
    assert int(philox([seed], [0])[3][0]) == 0
    row = torch.full((1, 100), -math.inf, device=DEVICE)
    row[0, 3] = 0.5
    assert sample(row, *params(1), torch.tensor([seed], device=DEVICE)).tolist() == [3]
    row = randn(1, 100, dtype=torch.float32)
    row[0, 3] = 10.0
    for filters in ((1.0, 1), (1.0, 0, 1e-6), (1.0, 0, 1.0, 1.0)):  # top_k 1, top_p tiny, min_p 1
        assert sample(row, *params(1, *filters), torch.tensor([seed], device=DEVICE)).tolist() == [3], filters


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # -inf - -inf, computed and then discarded
@pytest.mark.parametrize("backend", [sample, reference.sample], ids=["triton", "reference"])
def test_all_minus_infinity_row_returns_token_0(backend):
    logits = torch.full((2, 100), -math.inf, device=DEVICE)
    assert backend(logits, *params(2, 1.0, [0, 5], [1.0, 0.5])).tolist() == [0, 0]


def test_reference_sample():
    # The vectorized sort-based baseline: frequencies unseeded and with a seed a row, greedy rows.
    x = flat_row(100)
    n = 20000
    logits = x.expand(n, -1).contiguous()
    row = params(1, 0.8, 20, 0.8, 0.02)
    probs = reference.sampling_probs(x[None], *row)[0]
    for seeds in (None, torch.arange(n, device=DEVICE) * 1_000_003 - 2**40):
        assert_frequencies(reference.sample(logits, *(v.expand(n) for v in row), seeds).cpu().numpy(), probs)
    greedy = params(3, 0.0, 5, 0.5)
    assert torch.equal(reference.sample(logits[:3], *greedy), torch.argmax(logits[:3], dim=-1))
