"""The logit threshold T of a sampled row: the search half of kernels/sampler.py.

Every filter of the contract keeps a superlevel set {x >= T} of the row's logits, so a filtered
row needs one threshold. kernels/sampler.py's launches find it in four steps:

  stats (launch 1, per part of the row; `_row_stats`): per lane of the BLOCK-wide tiles, the max,
         its first index and the sum-exp against it (no cross-thread step in the loop); then the
         part's max, sum-exp and argmax, which give the row max m and z = sum exp((x - m) / t).
  bound (`_bound`): a logit `low` <= T. top-k: the largest over parts of each part's k-th largest
         lane maximum (a part's lanes hold BLOCK distinct elements, so at least k elements of the
         row are >= it); top-p alone: the mass below tau is under V * exp((tau - m) / t), so
         tau = m + t * log((1 - p) * z / V) still keeps p of the mass; min-p: m + t * log(min_p).
  collect (launch 2, per part; `_collect`): the candidates {x >= low} (values and token ids) to
         the part's scratch slots; the row's program gathers them to its CAP slots, or, if there
         are more than CAP, collects them from the row itself.
  search (`_threshold`): on the order-preserving int32 image (key) of the float32 logits. top-k: the largest key
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

Counts are exact and ties are kept; masses are float32 sums, so only a top-p/min-p boundary within
rounding can differ from the float64 reference. T is an element value, or on the overflow path
possibly a key between two elements (the same set).
"""
import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # the largest float32
INT_MAX = tl.constexpr(2**31 - 1)
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
def _row_stats(row_ptr, first, end, inv_t, BLOCK: tl.constexpr):
    """Pass 1 over the row's elements in [first, end) (first a multiple of BLOCK): lane maxima
    [BLOCK], max m, sum of exp((x - m) * inv_t) and the argmax (lowest index; first if all are
    -inf). Each lane keeps its own max and sum-exp, so the loop has no reduction."""
    lanes = tl.full([BLOCK], NEG_INF, tl.float32)
    lane_arg = tl.zeros([BLOCK], tl.int32) + first  # first index of each lane's max
    lane_z = tl.zeros([BLOCK], tl.float32)  # sum of exp((x - lane max) * inv_t)
    for start in range(first, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, end)
        better = x > lanes
        # One exp: of the new element against the lane max, or of the old max against the new one.
        e = tl.exp(-tl.abs(x - tl.where(x == NEG_INF, 0.0, lanes)) * inv_t)  # 0 for x = -inf
        lane_z = tl.where(better, lane_z * e + 1.0, lane_z + e)
        lanes = tl.where(better, x, lanes)
        lane_arg = tl.where(better, offs, lane_arg)
    m = tl.max(lanes, 0)
    z = tl.sum(tl.where(lanes > NEG_INF, lane_z * tl.exp((lanes - m) * inv_t), 0.0), 0)
    return lanes, m, z, tl.min(tl.where(lanes == m, lane_arg, INT_MAX), 0)


@triton.jit
def _row_totals(row, ref_ptr, best_ptr, token_ptr, kth_ptr, inv_t, num_chunks, num_parts, CHUNKS_POW2: tl.constexpr):
    """A filtered row's max m, sum-exp z against it, argmax (lowest index) and top-k bound, from
    its chunks' stats and its parts' bounds (the first num_parts of its num_chunks slots)."""
    offs = tl.arange(0, CHUNKS_POW2)
    slots = row.to(tl.int64) * num_chunks + offs
    valid = offs < num_chunks
    refs = tl.load(ref_ptr + slots, mask=valid, other=NEG_INF)
    m = tl.max(refs, 0)
    # A chunk of -inf adds nothing (and no NaN from -inf - -inf); z is not used unless m is finite.
    z = tl.sum(tl.where(refs > NEG_INF, tl.load(best_ptr + slots, mask=valid, other=0.0)
                        * tl.exp((refs - m) * inv_t), 0.0), 0)
    token = tl.min(tl.where(refs == m, tl.load(token_ptr + slots, mask=valid, other=INT_MAX), INT_MAX), 0)
    return m, z, token, tl.max(tl.load(kth_ptr + slots, mask=offs < num_parts, other=NEG_INF), 0)


@triton.jit
def _collect(row_ptr, first, end, lo, hi, vals_ptr, idx_ptr, CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Append the elements of the row's [first, end) with values in [lo, hi) (value, token id) to a
    scratch, in row order (the first CAP fit); returns how many there are. lo > -inf."""
    tl.debug_barrier()  # other threads may still be reading the scratch
    n = 0
    for start in range(first, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, end)
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
            n_s = _collect(row_ptr, 0, V, _unkey(lo), _unkey(hi), vals_ptr, idx_ptr, CAP, BLOCK)
            complete = base_cnt == 0
    lo, cnt, mass = _bisect(vals_ptr, n_s, lo, hi, cnt_lo - base_cnt, mass_lo - base_mass, need_cnt - base_cnt,
                            need_mass - base_mass, m, inv_t, BLOCK)
    return lo, cnt + base_cnt, mass + base_mass, n_s, complete


@triton.jit
def _min_p_bound(m, t, inv_t, log_min_p):
    """The smallest float32 x with (x - m) / t >= log(min_p): m + t log(min_p) rounds to the grid of
    m, which at large |m| and a small t is coarse in units of t, so step one key either way (x - m
    is exact near m)."""
    tau = m + t * log_min_p
    key = _key(tau).to(tl.int64)
    above, below = _unkey(key + 1), _unkey(key - 1)
    tau = tl.where((tau - m) * inv_t < log_min_p, above, tau)
    return tl.where((below - m) * inv_t >= log_min_p, below, tau)


@triton.jit
def _bound(m, z, t, k, p, min_p, inv_t, k_on, p_on, min_p_on, k_low, V):
    """A logit `low` <= T for a filtered row with a finite max m and sum-exp z (see the module doc),
    and min-p's own threshold (-inf when off). k_low: a top-k bound from distinct row elements (at
    least k of them are >= it), -inf if there is none."""
    log_min_p = tl.log(tl.where(min_p_on, min_p, 1.0))
    tau_min_p = tl.where(min_p_on, _min_p_bound(m, t, inv_t, log_min_p), NEG_INF)
    mass_bound = tl.where(p_on & ~k_on, (1.0 - p) * z / V, 0.0)
    low = tl.where(mass_bound > 0, m + t * tl.log(tl.where(mass_bound > 0, mass_bound, 1.0)), NEG_INF)
    low = tl.where(k_on, k_low, low)
    # Top-p measures mass inside the top-k set, so with both on only the top-k bound is safe.
    # The max always stays a candidate (z may round above V); -inf never does.
    low = tl.minimum(tl.where(k_on & p_on, low, tl.maximum(low, tau_min_p)), m)
    return tl.maximum(low, -FLT_MAX), tau_min_p


@triton.jit
def _threshold(row_ptr, V, m, z, t, k, p, inv_t, k_on, p_on, low, tau_min_p, row_vals, row_idx, n, complete,
               CAP: tl.constexpr, BLOCK: tl.constexpr):
    """The threshold T of a filtered row with a finite max m, once its scratch holds the elements
    >= low (complete: all n of them; else the first CAP, and the search narrows over the row).

    row_vals, row_idx: the row's CAP scratch slots. Returns (T, n, complete): complete when the
    first n scratch slots hold every element >= T (the race then reads them, else the row).
    """
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
    return tl.maximum(_unkey(lo), tau_min_p), n, complete
