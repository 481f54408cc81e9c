"""sample and compute_logprobs vs kernels.reference; sampling_probs is the exact oracle.

The kernel draws token argmax over {x >= T} of (x - max) / t + Gumbel(seed, token), with the noise
from Triton's Philox. Allowed sets are checked exactly through the per-row threshold T that
sample_with_threshold returns. For the frequencies, `draws` takes 32 draws from the kernel and
checks that a NumPy replica of the same race (Philox included) gives the very same tokens for
those seeds; the replica then supplies the 20000 draws a frequency test needs, which the
interpreter could not produce in time. On a GPU all 20000 draws come from the kernel (and the
first 256 must still equal the replica's).
"""
import math

import numpy as np
import pytest
import torch
from kernel_utils import DEVICE, DTYPES, assert_close, randn

from tritonllm.kernels import compute_logprobs, reference, sample
from tritonllm.kernels.sampler import sample_with_threshold

KERNEL_DRAWS = 20000 if DEVICE == "cuda" else 32
DRAWS = 20000


def params(batch, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Per-row parameter tensors (scalars broadcast to the batch)."""
    def column(value, dtype):
        return torch.as_tensor(value, dtype=dtype, device=DEVICE).expand(batch).contiguous()

    return (column(temperature, torch.float32), column(top_k, torch.int64), column(top_p, torch.float32),
            column(min_p, torch.float32))


def philox(seeds, counters):
    """Triton's Philox 4x32-10 as tl.randint4x computes it: key = int64 seed, counter = (counter, 0, 0, 0)."""
    low = np.uint64(0xFFFFFFFF)
    seeds = np.asarray(seeds, dtype=np.int64).view(np.uint64)
    k0, k1, c0 = np.broadcast_arrays(seeds & low, seeds >> np.uint64(32), np.asarray(counters, dtype=np.uint64))
    c1 = c2 = c3 = np.zeros_like(c0)
    for _ in range(10):
        p0, p2 = np.uint64(0xD2511F53) * c0, np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p2 >> np.uint64(32)) ^ c1 ^ k0, p2 & low, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & low
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low, (k1 + np.uint64(0xBB67AE85)) & low
    return c0, c1, c2, c3


def replica(x, threshold, temperature, seeds):
    """The kernel's race in NumPy: token ids [len(seeds)] for one row x (float32 numpy) and its threshold."""
    tokens = np.flatnonzero(x >= threshold)
    r = np.select([tokens % 4 == lane for lane in range(4)], philox(np.asarray(seeds)[:, None], tokens // 4))
    bits = r.astype(np.uint32).view(np.int32)
    u = np.where(bits < 0, -bits - 1, bits).astype(np.float32) * np.float32(4.6566127342e-10)
    with np.errstate(divide="ignore"):
        noise = -np.log(np.maximum(-np.log(u), np.float32(5e-8)))
    inv_t = np.float32(1) / np.float32(temperature)
    return tokens[np.argmax((x[tokens] - x.max()) * inv_t + noise, axis=1)]


def draws(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, n=DRAWS, config=None):
    """n draws for one row of logits [V] under the given filters, one seed each (see the module doc)."""
    batch = min(n, KERNEL_DRAWS)
    seeds = torch.arange(batch, device=DEVICE) * 1_000_003 - 2**40
    ids, thr = sample_with_threshold(logits_row.expand(batch, -1).contiguous(),
                                     *params(batch, temperature, top_k, top_p, min_p), seeds, config=config)
    assert (thr == thr[0]).all()
    ids = ids.cpu().numpy()
    x = logits_row.float().nan_to_num(nan=-math.inf).cpu().numpy()
    # Also pins the GPU's Philox stream to the interpreter's: both must match the replica.
    assert (ids[:256] == replica(x, float(thr[0]), temperature, seeds[:256].cpu().numpy())).all()
    if n > batch:
        more = np.arange(batch, n) * 1_000_003 - 2**40
        ids = np.concatenate([ids] + [replica(x, float(thr[0]), temperature, more[i:i + 4096])
                                      for i in range(0, len(more), 4096)])
    return ids


def assert_frequencies(ids, probs):
    """Every draw has probability > 0 and each token's frequency is within 5 sigma (+1/n) of probs."""
    probs = probs.cpu().numpy()
    assert (probs[ids] > 0).all(), f"drawn outside the allowed set: {sorted(set(ids[probs[ids] == 0]))}"
    n = len(ids)
    freq = np.bincount(ids, minlength=len(probs)) / n
    bound = 5 * np.sqrt(probs * (1 - probs) / n) + 1 / n
    worst = int(np.argmax(np.abs(freq - probs) - bound))
    assert (np.abs(freq - probs) <= bound).all(), f"token {worst}: frequency {freq[worst]:.4f}, p {probs[worst]:.4f}"


def assert_allowed_sets(logits, thr, probs):
    """Per sampled row, {x >= T} is exactly the support of sampling_probs."""
    x = logits.float().nan_to_num(nan=-math.inf, neginf=-math.inf)  # (nan_to_num's default makes -inf finite)
    for b in range(logits.shape[0]):
        mine, oracle = x[b] >= thr[b], probs[b] > 0
        assert torch.equal(mine, oracle), f"row {b}: {int(mine.sum())} allowed, oracle {int(oracle.sum())}"


def flat_row(vocab, scale=2.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=generator) * scale).to(DEVICE)


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_is_argmax(dtype):
    logits = randn(6, 5000, dtype=dtype, scale=3.0)
    logits[1, 10] = logits[1, 4106] = logits[1].max() + 1  # tie (also in one lane of a 4096 tile): lower index
    logits[2, :5] = float("nan")  # NaN counts as -inf
    logits[2, 900] = float("nan")
    logits[3] = float("-inf")  # all -inf: token 0
    logits[4, 4999] = logits[4].max() + 1  # the last element
    logits[5] = logits[5].round()  # many ties
    temperature, top_k, top_p, min_p = params(6, 0.0, 5, 0.5, 0.1)  # filters are ignored for greedy rows
    ids = sample(logits, temperature, top_k, top_p, min_p)
    expected = torch.argmax(logits.float().nan_to_num(nan=-math.inf), dim=-1)
    assert torch.equal(ids, expected) and ids.dtype == torch.int64
    assert int(ids[1]) == 10 and int(ids[3]) == 0


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
    # bound; tokens and allowed sets must not change.
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
    for config in ({"BLOCK": 128, "CAP": 16, "num_warps": 4}, {"BLOCK": 256, "CAP": 1024, "num_warps": 4},
                   {"BLOCK": 128, "CAP": 1, "num_warps": 4}):  # CAP 1: the row search runs to the end
        other_ids, other_thr = sample_with_threshold(*args, config=config)
        assert torch.equal(ids, other_ids), config
        assert torch.equal(logits >= thr[:, None], logits >= other_thr[:, None]), config


def test_overflow_path_frequencies():
    # Top-p alone on flat logits keeps ~85% of 1000 tokens, far more than CAP 128: the search narrows
    # over the row until the bracket fits the scratch, ends there, and the race runs over the row.
    x = flat_row(1000, scale=0.5)
    probs = reference.sampling_probs(x[None], *params(1, 0.8, 0, 0.95))[0]
    assert int((probs > 0).sum()) > 500
    config = {"BLOCK": 256, "CAP": 128, "num_warps": 4}
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


@pytest.mark.parametrize("config", [None, {"BLOCK": 256, "CAP": 64, "num_warps": 4},
                                    {"BLOCK": 128, "CAP": 512, "num_warps": 4}])
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


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf - inf, computed and then discarded
@pytest.mark.parametrize("config", [None, {"BLOCK": 128, "CAP": 128, "num_warps": 4}])
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, vocab", [(1, 7), (5, 100), (3, 1000), (2, 151936)])
def test_compute_logprobs(batch, vocab, dtype):
    logits = randn(batch, vocab, dtype=dtype, scale=3.0)
    tokens = torch.randint(0, vocab, (batch,), device=DEVICE, dtype=torch.int32 if batch == 5 else torch.int64)
    out = compute_logprobs(logits, tokens)
    assert out.dtype == torch.float32 and out.shape == (batch,)
    assert_close(out, reference.compute_logprobs(logits.double(), tokens), torch.float32)


def test_reference_sample():
    # The vectorized sort-based baseline: greedy rows, frequencies, and seeded reproducibility.
    x = flat_row(100)
    n = 20000
    logits = x.expand(n, -1).contiguous()
    row = params(1, 0.8, 20, 0.8, 0.02)
    ids = reference.sample(logits, *(v.expand(n) for v in row))
    assert_frequencies(ids.cpu().numpy(), reference.sampling_probs(x[None], *row)[0])
    greedy = params(3, 0.0, 5, 0.5)
    assert torch.equal(reference.sample(logits[:3], *greedy), torch.argmax(logits[:3], dim=-1))
    seeds = torch.arange(64, device=DEVICE)
    mixed = params(64, 1.0, 0, 0.9)
    assert torch.equal(reference.sample(logits[:64], *mixed, seeds), reference.sample(logits[:64], *mixed, seeds))
