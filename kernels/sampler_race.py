"""The Gumbel race of a sampled row: the drawing half of kernels/sampler.py.

A row draws argmax over {x >= T} of (x - max) / t + g, g Gumbel noise from Philox keyed by (seed,
token): the same token whatever the tiling or the batch. Rows without filters race in chunks
(`_race_row` over a range of the row), filtered rows over their scratch candidates
(`_race_candidates`) or, where those overflowed, over the row. Greedy rows take the argmax in the
same chunks (`_argmax_run`).
"""
import triton
import triton.language as tl

from tritonllm.kernels.sampler_search import INT_MAX, NEG_INF, POS_INF, _load_row

# The noise is g = -log(E) with E = max(-log(u), 5e-8), so g <= -log(5e-8) = 16.8 < G_MAX.
E_MIN = tl.constexpr(5e-8)
U_MIN = tl.constexpr(2.0**-32)
G_MAX = tl.constexpr(17.0)


@triton.jit
def _gumbel(seed, quad, lane):
    """Gumbel noise of token 4 * quad + lane: output `lane` of Philox at counter `quad`.

    The noise of a token depends only on (seed, token), whatever the tiling, and one Philox call
    serves four tokens. quad and lane broadcast against each other.
    """
    r0, r1, r2, r3 = tl.randint4x(seed, quad)
    r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    # u is 0 for 2 of the 2^32 outputs: its noise would be -inf and a row's only candidate would lose.
    u = tl.maximum(tl.uint_to_uniform_float(r), U_MIN)  # [2^-32, 1 - 2^-24]
    return -tl.log(tl.maximum(-tl.log(u), E_MIN))


@triton.jit
def _race_candidates(vals_ptr, idx_ptr, n, thr, m, inv_t, seed, BLOCK: tl.constexpr):
    """Gumbel-max over the scratch candidates with value >= thr; returns the winning token id."""
    best = NEG_INF
    token = 0
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < n
        x = tl.load(vals_ptr + offs, mask=valid, other=NEG_INF)
        ids = tl.load(idx_ptr + offs, mask=valid, other=0)
        score = tl.where(valid & (x >= thr), (x - m) * inv_t + _gumbel(seed, ids >> 2, ids & 3), NEG_INF)
        block_best = tl.max(score, 0)
        block_token = tl.min(tl.where(score == block_best, ids, INT_MAX), 0)
        token = tl.where(block_best > best, block_token, token)
        best = tl.maximum(best, block_best)
    return token


@triton.jit
def _race_row(row_ptr, first, end, thr, inv_t, seed, BLOCK: tl.constexpr):
    """Gumbel-max over the row's elements in [first, end) that are >= thr, in [BLOCK // 4, 4] tiles
    (one Philox call per 4 tokens); first is a multiple of BLOCK.

    The running winner's score is kept relative to its own tile max `ref`, so no global max is needed
    and scores stay small numbers; a tile whose max plus the largest noise cannot beat it is skipped.
    A +inf logit takes all the mass: the first one wins and no later tile can beat ref = +inf.
    Returns (token, ref, best): the winner's score is ref * inv_t + best (-inf if none).
    """
    quad = tl.arange(0, BLOCK // 4)[:, None]
    lane = tl.arange(0, 4)[None, :]
    ref = 0.0  # any finite value before the first winner: best = -inf accepts any finite tile
    best = NEG_INF
    token = first
    for start in range(first, end, BLOCK):
        offs = start + quad * 4 + lane
        x = _load_row(row_ptr, offs, end)
        x = tl.where(x >= thr, x, NEG_INF)
        tile_max = tl.max(tl.max(x, 1), 0)
        if (tile_max - ref) * inv_t + G_MAX > best:
            score = (x - tile_max) * inv_t + _gumbel(seed, start // 4 + quad, lane)
            score = tl.where(tile_max == POS_INF, tl.where(x == POS_INF, 0.0, NEG_INF), score)
            tile_best = tl.max(tl.max(score, 1), 0)
            tile_token = tl.min(tl.min(tl.where(score == tile_best, offs, INT_MAX), 1), 0)
            wins = (tile_max - ref) * inv_t + tile_best > best
            token = tl.where(wins, tile_token, token)
            best = tl.where(wins, tile_best, best)
            ref = tl.where(wins, tile_max, ref)
    return token, ref, best


@triton.jit
def _argmax_run(row_ptr, first, end, BLOCK: tl.constexpr):
    """The max of the row's elements in [first, end) and its lowest index (first if all are -inf).
    Returns (token, ref, best) as _race_row does: ref is the max, best 0 (-inf if all are -inf)."""
    ref = NEG_INF
    token = first
    for start in range(first, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, end)
        tile_max = tl.max(x, 0)
        wins = tile_max > ref
        token = tl.where(wins, tl.min(tl.where(x == tile_max, offs, INT_MAX), 0), token)
        ref = tl.maximum(ref, tile_max)
    return token, ref, tl.where(ref > NEG_INF, 0.0, NEG_INF)
