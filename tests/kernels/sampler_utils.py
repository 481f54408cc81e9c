"""Oracle helpers of the sampler tests: parameters, a NumPy replica of the kernel's race, checks.

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
import torch
from kernel_utils import DEVICE

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
    u = np.maximum(np.where(bits < 0, -bits - 1, bits).astype(np.float32) * np.float32(4.6566127342e-10),
                   np.float32(2.0**-32))
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
    """Logits [vocab] of N(0, scale^2) from a fixed seed, on DEVICE."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=generator) * scale).to(DEVICE)
