"""Sampling without sorting: temperature, top-k, top-p and min-p as logit thresholds, then a Gumbel race.

One program per row (rows without filters get a first launch, below). Every filter of the
contract keeps a superlevel set of the row's logits {x >= T} (temperature > 0 preserves the
order), so sampling reduces to finding one threshold T and running the race
argmax(x / t + Gumbel noise) over {x >= T}:

  pass 1 (read the row): per lane of the BLOCK-wide tiles, the max, its first index and the
         sum-exp against it (no cross-thread step in the loop); then the row max m, the sum-exp
         z = sum exp((x - m) / t) and the argmax (greedy rows stop here).
  bound: a logit `low` <= T. top-k: the k-th largest lane maximum (the lanes hold BLOCK distinct
         row elements, so at least k elements of the row are >= it; only for rows longer than
         the scratch); top-p alone: the mass below tau is under V * exp((tau - m) / t), so
         tau = m + t * log((1 - p) * z / V) still keeps p of the mass; min-p: m + t * log(min_p).
  pass 2 (read the row): copy the candidates {x >= low} (values and token ids) to a per-row
         scratch of CAP slots.
  search: on the order-preserving int32 image (key) of the float32 logits. top-k: the largest key
         whose set {x >= key} holds k elements; top-p: the largest key whose set (inside the top-k
         set) holds p of the top-k mass. A bisection over the scratch: each round splits the
         bracket [lo, hi) (the set at lo qualifies, the set at hi does not) at its middle key and
         snaps the moved bound onto an element, so the range at least halves (<= 32 rounds); it
         stops once [lo, hi) holds one element or one key, or the set at lo holds exactly k.
  overflow: candidates that do not fit the scratch (top-p alone on flat rows keeps ~10^5 tokens)
         are narrowed over the row first. A pass counts and weighs the elements at or above 16
         pivots inside the bracket, 8 evenly spaced in value (fast on logits) and 8 in key space
         (each pass cuts the key range 9x or more: at most 11 passes whatever the values), and
         snaps the bracket onto its extreme elements. Once the bracket holds CAP elements or fewer
         (2 or 3 passes on real logits) they are copied to the scratch and the bisection ends the
         search there, counting relative to the set at hi. The race then reads the row.
  race:  Gumbel-max over the candidates >= T with Philox noise that depends only on (seed, token).

Counts are exact and ties are kept; masses are float32 sums, so only a top-p/min-p boundary within
rounding can differ from the float64 reference. T is an element value, or on the overflow path
possibly a key between two elements (the same set).

Rows without filters skip both passes and only race: a first launch of B x chunks programs races
each 4-tile chunk of the row (skipping tiles that cannot beat the chunk's running winner), so one
row's reads and Philox work spread over many SMs, and the row's program takes the best chunk.

Conventions: NaN logits count as -inf, and -inf logits are never drawn (a filtered row's T is
finite); a row holding +inf puts all its mass on its +inf logits and returns the first of them,
as greedy does (T = +inf); a row whose logits are all -inf returns token 0; temperature <= 0 is
greedy; top_p <= 0 keeps the most likely token(s) only; min_p > 1 acts as 1. The two launches
have grids fixed by (B, V, BLOCK) and never sync the host.
"""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.tuning import Tunable, dtype_name, pow2

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # the largest float32
INT_MAX = tl.constexpr(2**31 - 1)
# The noise is g = -log(E) with E = max(-log(u), 5e-8), so g <= -log(5e-8) = 16.8 < G_MAX.
E_MIN = tl.constexpr(5e-8)
G_MAX = tl.constexpr(17.0)
RACE_CHUNK_TILES = 4  # tiles of a row one _race_chunks_kernel program races (8192 tokens at BLOCK 2048)
PIVOTS = tl.constexpr(16)  # keys a row-search pass tests: even slots spaced in value, odd ones in key space


@triton.jit
def _load_row(ptr, offs, n):
    """float32 values of ptr[offs] for offs < n, -inf past the end and for NaN, +0 for -0 (one key
    per value, so snapping a search bound onto an element always moves it)."""
    x = tl.load(ptr + offs, mask=offs < n, other=NEG_INF).to(tl.float32)
    return tl.where(x == x, tl.where(x == 0.0, 0.0, x), NEG_INF)


@triton.jit
def _key(x):
    """Order-preserving int32 image of a float32: a larger float has a larger key."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _unkey(key):
    """The float32 whose _key is `key` (an int64 holding an int32 key)."""
    bits = key.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _gumbel(seed, quad, lane):
    """Gumbel noise of token 4 * quad + lane: output `lane` of Philox at counter `quad`.

    The noise of a token depends only on (seed, token), whatever the tiling, and one Philox call
    serves four tokens. quad and lane broadcast against each other.
    """
    r0, r1, r2, r3 = tl.randint4x(seed, quad)
    r = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
    u = tl.uint_to_uniform_float(r)  # [0, 1 - 2^-24]
    return -tl.log(tl.maximum(-tl.log(u), E_MIN))


@triton.jit
def _row_stats(row_ptr, V, inv_t, BLOCK: tl.constexpr, WITH_MASS: tl.constexpr):
    """Pass 1: lane maxima [BLOCK], max m, sum of exp((x - m) * inv_t) (if WITH_MASS, else 0) and
    the argmax (lowest index). Each lane keeps its own max and sum-exp, so the loop has no reduction."""
    lanes = tl.full([BLOCK], NEG_INF, tl.float32)
    lane_arg = tl.zeros([BLOCK], tl.int32)  # first index of each lane's max
    lane_z = tl.zeros([BLOCK], tl.float32)  # sum of exp((x - lane max) * inv_t)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, V)
        better = x > lanes
        if WITH_MASS:
            # One exp: of the new element against the lane max, or of the old max against the new one.
            e = tl.exp(-tl.abs(x - tl.where(x == NEG_INF, 0.0, lanes)) * inv_t)  # 0 for x = -inf
            lane_z = tl.where(better, lane_z * e + 1.0, lane_z + e)
        lanes = tl.where(better, x, lanes)
        lane_arg = tl.where(better, offs, lane_arg)
    m = tl.max(lanes, 0)
    z = 0.0
    if WITH_MASS:
        z = tl.sum(tl.where(lanes > NEG_INF, lane_z * tl.exp((lanes - m) * inv_t), 0.0), 0)
    return lanes, m, z, tl.min(tl.where(lanes == m, lane_arg, INT_MAX), 0)


@triton.jit
def _collect(row_ptr, V, lo, hi, vals_ptr, idx_ptr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Append the row's elements in [lo, hi) (value, token id) to the scratch, in row order (the first
    CAP fit); returns how many there are. lo > -inf."""
    tl.debug_barrier()  # other threads may still be reading the scratch
    n = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, V)
        keep = (x >= lo) & (x < hi)
        count = tl.sum(keep.to(tl.int32), 0)
        if count > 0:  # most tiles hold no candidate: skip the scan
            pos = n + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(vals_ptr + pos, x, mask=keep & (pos < CAP))
            tl.store(idx_ptr + pos, offs, mask=keep & (pos < CAP))
        n += count
    tl.debug_barrier()  # the scratch written by some threads is read by others
    return n


@triton.jit
def _kth_largest(lanes, k):
    """The k-th largest value of the register tensor `lanes` (k <= its size): _bisect's search."""
    lo = _key(tl.min(lanes, 0)).to(tl.int64)
    hi = _key(tl.max(lanes, 0)).to(tl.int64) + 1
    cnt_lo = tl.sum((lanes >= _unkey(lo)).to(tl.int32), 0)
    cnt_hi = cnt_lo * 0
    while (hi - lo > 1) & (cnt_lo - cnt_hi > 1) & (cnt_lo != k):
        above = lanes >= _unkey(lo + (hi - lo) // 2)
        cnt = tl.sum(above.to(tl.int32), 0)
        up = _key(tl.min(tl.where(above, lanes, POS_INF), 0)).to(tl.int64)
        down = _key(tl.max(tl.where(above, NEG_INF, lanes), 0)).to(tl.int64)
        ok = cnt >= k
        lo, cnt_lo = tl.where(ok, up, lo), tl.where(ok, cnt, cnt_lo)
        hi, cnt_hi = tl.where(ok, hi, down + 1), tl.where(ok, cnt_hi, cnt)
    return _unkey(lo)


@triton.jit
def _above(src_ptr, n, pivot, m, inv_t, BLOCK: tl.constexpr):
    """Over the first n values of src: count and mass sum exp((x - m) * inv_t) of those >= pivot,
    the smallest value >= pivot and the largest value < pivot (+-inf if none)."""
    cnt = 0
    mass = 0.0
    up = POS_INF
    down = NEG_INF
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(src_ptr, offs, n)
        keep = (x >= pivot) & (offs < n)
        cnt += tl.sum(keep.to(tl.int32), 0)
        mass += tl.sum(tl.where(keep, tl.exp((x - m) * inv_t), 0.0), 0)
        up = tl.minimum(up, tl.min(tl.where(keep, x, POS_INF), 0))
        down = tl.maximum(down, tl.max(tl.where(keep, NEG_INF, x), 0))
    return cnt, mass, up, down


@triton.jit
def _bisect(src_ptr, n, lo, hi, cnt_lo, mass_lo, need_cnt, need_mass, m, inv_t, BLOCK: tl.constexpr):
    """The largest key in [lo, hi) whose set {x >= key} holds >= need_cnt elements and >= need_mass.

    Invariant: the set at lo qualifies (cnt_lo, mass_lo are its count and mass), the set at hi
    (at first the key of the max + 1: empty) does not. Each round splits [lo, hi) at the middle key
    and then snaps the moved bound onto the nearest element (lo up to the smallest value >= mid,
    hi down to just above the largest value < mid: same sets), so the range at least halves and a
    run of equal values ends the search at once. Stops when lo and hi are adjacent keys, when
    [lo, hi) holds at most one element (the set at lo is then the answer's set), or when the set at
    lo has exactly need_cnt elements. Returns (lo, cnt_lo, mass_lo).
    """
    cnt_hi = cnt_lo * 0
    while (hi - lo > 1) & (cnt_lo - cnt_hi > 1) & (cnt_lo != need_cnt):
        cnt, mass, up, down = _above(src_ptr, n, _unkey(lo + (hi - lo) // 2), m, inv_t, BLOCK)
        ok = (cnt >= need_cnt) & (mass >= need_mass)
        lo, cnt_lo = tl.where(ok, _key(up).to(tl.int64), lo), tl.where(ok, cnt, cnt_lo)
        mass_lo = tl.where(ok, mass, mass_lo)
        hi, cnt_hi = tl.where(ok, hi, _key(down).to(tl.int64) + 1), tl.where(ok, cnt_hi, cnt)
    return lo, cnt_lo, mass_lo


@triton.jit
def _pivots(lo, hi):
    """PIVOTS keys in [lo, hi) (int64): even slots evenly spaced in value between the bracket's end
    values (where those are finite and distinct), odd slots evenly spaced in key space."""
    j = tl.arange(0, PIVOTS)
    step = (j // 2 + 1).to(tl.int64)  # 1 .. PIVOTS / 2
    by_key = lo + (hi - lo) * step // (PIVOTS // 2 + 1)
    lo_value = _unkey(lo)
    frac = step.to(tl.float32) / (PIVOTS // 2 + 1)
    by_value = _key(lo_value + (_unkey(hi - 1) - lo_value) * frac).to(tl.int64)
    inside = (by_value > lo) & (by_value < hi)  # false for the NaN or inf of infinite spans
    return tl.where((j % 2 == 0) & inside, by_value, by_key)


@triton.jit
def _scan_pivots(row_ptr, V, pivots, lo, hi, m, inv_t, TILE: tl.constexpr):
    """Over the row: count and mass sum exp((x - m) * inv_t) of the elements >= each pivot, and the
    smallest and largest element in [lo, hi) (+inf, -inf if none).

    [PIVOTS, TILE] accumulators, reduced once at the end; values load as [1, TILE], so every thread
    holds all the pivots for its own elements and nothing changes layout. Four tiles a step put
    four loads in flight (the loop is not pipelined).
    """
    cnt = tl.zeros([PIVOTS, TILE], tl.int32)
    mass = tl.zeros([PIVOTS, TILE], tl.float32)
    smallest = tl.full([1, TILE], POS_INF, tl.float32)
    largest = tl.full([1, TILE], NEG_INF, tl.float32)
    for start in range(0, V, TILE * 4):
        for u in tl.static_range(4):
            offs = start + u * TILE + tl.arange(0, TILE)[None, :]
            x = _load_row(row_ptr, offs, V)
            above = pivots[:, None] <= x
            cnt += above.to(tl.int32)
            mass += tl.where(above, tl.exp((x - m) * inv_t), 0.0)
            inside = (x >= lo) & (x < hi)
            smallest = tl.minimum(smallest, tl.where(inside, x, POS_INF))
            largest = tl.maximum(largest, tl.where(inside, x, NEG_INF))
    return tl.sum(cnt, 1), tl.sum(mass, 1), tl.min(tl.min(smallest, 1), 0), tl.max(tl.max(largest, 1), 0)


@triton.constexpr_function
def _scan_tile(block):
    """Values a row-search step tests: [PIVOTS, block // 16] holds as many as a streaming tile."""
    return max(block // 16, 128)


@triton.jit
def _open(lo, hi, cnt_lo, cnt_hi, need_cnt, limit):
    """Whether a search must go on: [lo, hi) spans keys and holds more than `limit` elements, and the
    set at lo has not exactly need_cnt (a smaller set would not qualify)."""
    return (hi - lo > 1) & (cnt_lo - cnt_hi > limit) & (cnt_lo != need_cnt)


@triton.jit
def _narrow(row_ptr, V, lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi, need_cnt, need_mass, limit, m, inv_t,
            TILE: tl.constexpr):
    """Narrow, over the row, the bracket [lo, hi) of the search for the largest key whose set
    {x >= key} holds >= need_cnt elements and >= need_mass, until it holds `limit` elements or fewer.

    The set at lo qualifies, the set at hi does not (cnt_*, mass_*: their counts and masses). Each
    round tests the keys of _pivots in one pass over the row and, in the same pass, finds the
    smallest and the largest element in [lo, hi). It snaps the bracket onto those (same sets; a
    bracket over one value, a run of ties, then closes), then moves lo up to the largest pivot that
    qualifies and hi down to the smallest that does not, with their counts and masses: the smallest
    (largest) among the qualifying (failing) pivots. Returns (lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi).
    """
    while _open(lo, hi, cnt_lo, cnt_hi, need_cnt, limit):
        pivots = _pivots(lo, hi)
        cnt, mass, smallest, largest = _scan_pivots(row_ptr, V, _unkey(pivots), _unkey(lo), _unkey(hi), m, inv_t, TILE)
        lo = tl.maximum(lo, _key(smallest).to(tl.int64))
        hi = tl.minimum(hi, _key(largest).to(tl.int64) + 1)
        ok = (cnt >= need_cnt) & (cnt > 0) & (mass >= need_mass)
        # Pivots below the snapped lo have its set; counts and masses fall as the pivot rises.
        lo, cnt_lo, mass_lo = (tl.maximum(lo, tl.max(tl.where(ok, pivots, lo), 0)),
                               tl.min(tl.where(ok, cnt, cnt_lo), 0), tl.min(tl.where(ok, mass, mass_lo), 0))
        hi, cnt_hi, mass_hi = (tl.minimum(hi, tl.min(tl.where(ok, hi, pivots), 0)),
                               tl.max(tl.where(ok, cnt_hi, cnt), 0), tl.max(tl.where(ok, mass_hi, mass), 0))
    return lo, hi, cnt_lo, mass_lo, cnt_hi, mass_hi


@triton.jit
def _search(row_ptr, V, vals_ptr, idx_ptr, n_s, complete, lo, cnt_lo, mass_lo, hi, need_cnt, need_mass, m, inv_t,
            CAP: tl.constexpr, BLOCK: tl.constexpr):
    """One filter's threshold: the largest key >= lo whose set holds >= need_cnt elements and
    >= need_mass. The set at lo qualifies (cnt_lo, mass_lo), the set at hi (above the max) does not.

    complete: the n_s scratch entries hold every element >= lo, and _bisect runs over them. Else
    _narrow cuts [lo, hi) over the row until its elements fit the scratch, they are copied there,
    and _bisect ends the search over them, counting relative to the set at hi. Returns (lo, cnt_lo,
    mass_lo, n_s, complete) for the next search and the race.
    """
    zero = cnt_lo * 0
    base_cnt, base_mass = zero, zero.to(tl.float32)  # count and mass of the set at hi, which the scratch lacks
    if ~complete:
        lo, hi, cnt_lo, mass_lo, base_cnt, base_mass = _narrow(row_ptr, V, lo, hi, cnt_lo, mass_lo, base_cnt, base_mass,
                                                               need_cnt, need_mass, CAP, m, inv_t, _scan_tile(BLOCK))
        if _open(lo, hi, cnt_lo, base_cnt, need_cnt, 1):  # else settled: _bisect does not read the scratch
            n_s = _collect(row_ptr, V, _unkey(lo), _unkey(hi), vals_ptr, idx_ptr, CAP, BLOCK)
            complete = base_cnt == 0
    lo, cnt, mass = _bisect(vals_ptr, n_s, lo, hi, cnt_lo - base_cnt, mass_lo - base_mass, need_cnt - base_cnt,
                            need_mass - base_mass, m, inv_t, BLOCK)
    return lo, cnt + base_cnt, mass + base_mass, n_s, complete


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
def _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, V):
    """A row's sampling parameters (t, k, p, min_p, 1 / t) and which filters are on: (sampled, k_on, p_on, min_p_on)."""
    t = tl.load(temperature_ptr + row).to(tl.float32)
    k = tl.load(top_k_ptr + row).to(tl.int64)
    p = tl.maximum(tl.load(top_p_ptr + row).to(tl.float32), 0.0)
    min_p = tl.minimum(tl.load(min_p_ptr + row).to(tl.float32), 1.0)
    sampled = t > 0
    inv_t = 1.0 / tl.where(sampled, t, 1.0)
    return t, k, p, min_p, inv_t, sampled, (k > 0) & (k < V), p < 1.0, min_p > 0.0


@triton.jit
def _race_chunks_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, score_ptr, token_ptr,
    V, num_chunks, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    """Rows without filters: the race over one CHUNK of the row per program, so that a row's reads
    spread over many SMs; _sample_kernel takes the best chunk. Other rows' programs exit at once."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    _, _, _, _, inv_t, sampled, k_on, p_on, min_p_on = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr,
                                                                    min_p_ptr, V)
    if sampled & ~(k_on | p_on | min_p_on):
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        first = chunk * CHUNK
        token, ref, best = _race_row(row_ptr, first, tl.minimum(first + CHUNK, V), NEG_INF, inv_t,
                                     tl.load(seeds_ptr + row), BLOCK)
        slot = row.to(tl.int64) * num_chunks + chunk
        tl.store(score_ptr + slot, ref * inv_t + best)  # +inf for a chunk holding +inf
        tl.store(token_ptr + slot, token)


@triton.jit
def _sample_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr,
    out_ptr, thr_ptr, vals_ptr, idx_ptr, chunk_score_ptr, chunk_token_ptr, V, num_chunks,
    CAP: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_POW2: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t, k, p, min_p, inv_t, sampled, k_on, p_on, min_p_on = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr,
                                                                        min_p_ptr, V)
    seed = tl.load(seeds_ptr + row)
    if ~sampled:
        _, thr, _, token = _row_stats(row_ptr, V, inv_t, BLOCK, False)
    elif ~(k_on | p_on | min_p_on):
        # The best of _race_chunks_kernel's chunks, the lowest token on ties: the first +inf if any,
        # token 0 if all are -inf.
        offs = tl.arange(0, CHUNKS_POW2)
        slots = row.to(tl.int64) * num_chunks + offs
        scores = tl.load(chunk_score_ptr + slots, mask=offs < num_chunks, other=NEG_INF)
        tokens = tl.load(chunk_token_ptr + slots, mask=offs < num_chunks, other=INT_MAX)
        top = tl.max(scores, 0)
        token = tl.min(tl.where(scores == top, tokens, INT_MAX), 0)
        thr = tl.where(top == POS_INF, POS_INF, NEG_INF)
    else:
        lanes, m, z, token = _row_stats(row_ptr, V, inv_t, BLOCK, True)
        thr = m
        if (m > NEG_INF) & (m < POS_INF):  # else the argmax: token 0 of an all -inf row, or the first +inf
            row_vals = vals_ptr + row.to(tl.int64) * CAP
            row_idx = idx_ptr + row.to(tl.int64) * CAP
            tau_min_p = tl.where(min_p_on, m + t * tl.log(tl.where(min_p_on, min_p, 1.0)), NEG_INF)
            mass_bound = tl.where(p_on & ~k_on, (1.0 - p) * z / V, 0.0)
            low = tl.where(mass_bound > 0, m + t * tl.log(tl.where(mass_bound > 0, mass_bound, 1.0)), NEG_INF)
            if k_on & (k <= BLOCK) & (V > CAP):  # a row that fits the scratch needs no bound
                low = _kth_largest(lanes, k)
            # Top-p measures mass inside the top-k set, so with both on only the top-k bound is safe.
            # The max always stays a candidate (z may round above V); -inf never does.
            low = tl.minimum(tl.where(k_on & p_on, low, tl.maximum(low, tau_min_p)), m)
            low = tl.maximum(low, -FLT_MAX)
            n = _collect(row_ptr, V, low, POS_INF, row_vals, row_idx, CAP, BLOCK)
            complete = n <= CAP
            if complete:
                cnt, mass, up, _ = _above(row_vals, n, low, m, inv_t, BLOCK)
            else:  # one more pass over the row, for the mass at low
                cnt, mass, up, _ = _above(row_ptr, V, low, m, inv_t, BLOCK)
            lo = _key(up).to(tl.int64)  # the smallest element >= low: same set
            hi = _key(m).to(tl.int64) + 1  # the set above the max is empty: it never qualifies
            # With top-p on, low is the top-k bound, so cnt >= k; without, fewer means T = low = tau_min_p.
            if k_on & (cnt >= k):
                lo, cnt, mass, n, complete = _search(row_ptr, V, row_vals, row_idx, n, complete, lo, cnt, mass, hi,
                                                     k, -1.0, m, inv_t, CAP, BLOCK)
            if p_on:
                # mass is now the top-k set's mass; without top-k, the whole row's (z) is the reference.
                need = p * tl.where(k_on, mass, z)
                if mass >= need:  # else top-p's threshold is below low = tau_min_p: min-p decides
                    lo, cnt, mass, n, complete = _search(row_ptr, V, row_vals, row_idx, n, complete, lo, cnt, mass,
                                                         hi, 1, need, m, inv_t, CAP, BLOCK)
            thr = tl.maximum(_unkey(lo), tau_min_p)
            if complete:
                token = _race_candidates(row_vals, row_idx, n, thr, m, inv_t, seed, BLOCK)
            else:
                token, _, _ = _race_row(row_ptr, 0, V, thr, inv_t, seed, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))
    tl.store(thr_ptr + row, thr)


def _sample_space(dtype, batch, vocab):
    return [
        {"BLOCK": block, "CAP": min(4096, vocab), "num_warps": warps}
        for block in (1024, 2048, 4096, 8192)
        for warps in (4, 8, 16)
        if block <= max(vocab, 1024)
    ]


def _sample_default(dtype, batch, vocab):
    # What the H200 sweep picked for B 1, 32 and 256 (bench/NOTES-sampler.md): 2048-wide tiles;
    # 8 warps while rows are few (more loads in flight per row), 4 once two programs share an SM.
    return {"BLOCK": min(2048, max(vocab, 128)), "CAP": min(4096, vocab), "num_warps": 4 if batch > 128 else 8}


_TUNING = Tunable("sample", _sample_space, _sample_default)


def sample_with_threshold(logits, temperature, top_k, top_p, min_p, seeds=None, config=None):
    """sample(), also returning each row's logit threshold T as float32 [B].

    A sampled row draws from {v : logits[b, v].float() >= T[b]} (NaN as -inf; -inf logits are
    never drawn); T is -inf for rows without filters, the row max for greedy rows and +inf for rows
    holding +inf (their first +inf is drawn). `config` overrides the tuned/default config.
    """
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if seeds is None:
        seeds = torch.randint(0, 2**62, (batch,), dtype=torch.int64, device=logits.device)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    thr = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out, thr

    def launch(config):
        vals = torch.empty(batch, config["CAP"], dtype=torch.float32, device=logits.device)
        idx = torch.empty(batch, config["CAP"], dtype=torch.int32, device=logits.device)
        chunk = RACE_CHUNK_TILES * config["BLOCK"]
        num_chunks = triton.cdiv(vocab, chunk)
        chunk_scores = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
        chunk_tokens = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
        _race_chunks_kernel[(batch, num_chunks)](
            logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, chunk_scores, chunk_tokens,
            vocab, num_chunks, BLOCK=config["BLOCK"], CHUNK=chunk, num_warps=config["num_warps"],
        )
        _sample_kernel[(batch,)](
            logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, out, thr, vals, idx,
            chunk_scores, chunk_tokens, vocab, num_chunks, CHUNKS_POW2=triton.next_power_of_2(num_chunks), **config,
        )

    launch(config or _TUNING.config((dtype_name(logits.dtype), pow2(batch), pow2(vocab)), launch))
    return out, thr


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row from softmax(logits / t) under top-k, then top-p, then min-p.

    logits [B, V] float32/float16/bfloat16 (computed in float32); temperature [B] float (<= 0:
    greedy argmax, lowest index on ties); top_k [B] int (0 or >= V: off); top_p [B] float (1: off);
    min_p [B] float (0: off); seeds [B] int64, or None to draw them with torch.randint on the
    device. Same seeds, same tokens. Returns int64 ids [B]; nothing is modified in place.
    Semantics are kernels.reference.sampling_probs'; NaN logits count as -inf, an all -inf row
    returns 0, a row holding +inf returns its first +inf (greedy or not). No host sync; two launches
    with grids fixed by (B, V, config) and float32 scratch allocated per call, so it can be captured
    in a CUDA graph.
    """
    return sample_with_threshold(logits, temperature, top_k, top_p, min_p, seeds)[0]


@triton.jit
def _logprobs_kernel(logits_ptr, stride, token_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    m = NEG_INF
    z = 0.0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < V, other=NEG_INF).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        ref = tl.where(m_new == NEG_INF, 0.0, m_new)
        z = z * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), 0)
        m = m_new
    x_token = tl.load(row_ptr + tl.load(token_ptr + row)).to(tl.float32)
    tl.store(out_ptr + row, x_token - m - tl.log(z))


def _logprobs_space(dtype, vocab):
    return [{"BLOCK": block, "num_warps": warps} for block in (1024, 2048, 4096, 8192) for warps in (4, 8, 16)
            if block <= max(vocab, 1024)]


def _logprobs_default(dtype, vocab):
    return {"BLOCK": min(4096, max(vocab, 128)), "num_warps": 8}


_LOGPROBS_TUNING = Tunable("compute_logprobs", _logprobs_space, _logprobs_default)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits.float())[b, token_ids[b]]: logits [B, V] float32/float16/bfloat16, token_ids [B]
    int32/int64 (in [0, V)). Returns float32 [B] (one online max/sum-exp pass a row); nothing in place."""
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return out

    def launch(config):
        _logprobs_kernel[(batch,)](logits, logits.stride(0), token_ids, out, vocab, **config)

    launch(_LOGPROBS_TUNING.config((dtype_name(logits.dtype), pow2(vocab)), launch))
    return out
