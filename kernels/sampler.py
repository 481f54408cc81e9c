"""Sampling without sorting: temperature, top-k, top-p and min-p as one logit threshold, then a Gumbel race.

One program per row (rows without filters get a first launch, below). Every filter of the
contract keeps a superlevel set of the row's logits {x >= T} (temperature > 0 preserves the
order), so sampling reduces to finding one threshold T (kernels/sampler_search.py: two passes
over the row, a bound, a copy of the candidates to a per-row scratch and a search there) and
running the race argmax(x / t + Gumbel noise) over {x >= T}, with Philox noise that depends only
on (seed, token): a row's draw depends on its logits, parameters and seed, never on its batch.

Rows without filters skip the search and only race: a first launch of B x chunks programs races
each 4-tile chunk of the row (skipping tiles that cannot beat the chunk's running winner), so one
row's reads and Philox work spread over many SMs, and the row's program takes the best chunk.
Greedy rows take the same two launches, each chunk's program finding the chunk's first max.

Conventions: NaN logits count as -inf, and -inf logits are never drawn (a filtered row's T is
finite); a row holding +inf puts all its mass on its +inf logits and returns the first of them,
as greedy does (T = +inf); a row whose logits are all -inf returns token 0; a temperature below
MIN_TEMPERATURE is greedy (1 / t would overflow the race's scores); top_p <= 0 keeps the most
likely token(s) only; min_p > 1 acts as 1. The two launches have grids fixed by (B, V, BLOCK)
and never sync the host.
"""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.checks import INDICES, ROW_FLOATS, check_logits, check_rows
from tritonllm.kernels.sampler_search import INT_MAX, NEG_INF, POS_INF, _load_row, _row_stats, _threshold
from tritonllm.kernels.tuning import Tunable, dtype_name, pow2

# The noise is g = -log(E) with E = max(-log(u), 5e-8), so g <= -log(5e-8) = 16.8 < G_MAX.
E_MIN = tl.constexpr(5e-8)
U_MIN = tl.constexpr(2.0**-32)
G_MAX = tl.constexpr(17.0)
RACE_CHUNK_TILES = 4  # tiles of a row one _race_chunks_kernel program races (8192 tokens at BLOCK 2048)
MIN_TEMPERATURE = 1e-5  # below it, greedy (vLLM's _SAMPLING_EPS)
_MIN_T = tl.constexpr(MIN_TEMPERATURE)  # kernels read globals only as constexprs


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


@triton.jit
def _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, V):
    """A row's sampling parameters (t, k, p, min_p, 1 / t) and which filters are on: (sampled, k_on, p_on, min_p_on)."""
    t = tl.load(temperature_ptr + row).to(tl.float32)
    k = tl.load(top_k_ptr + row).to(tl.int64)
    p = tl.maximum(tl.load(top_p_ptr + row).to(tl.float32), 0.0)
    min_p = tl.minimum(tl.load(min_p_ptr + row).to(tl.float32), 1.0)
    sampled = t >= _MIN_T
    inv_t = 1.0 / tl.where(sampled, t, 1.0)
    return t, k, p, min_p, inv_t, sampled, (k > 0) & (k < V), p < 1.0, min_p > 0.0


# A row parameter may be a row of one packed tensor, at any offset: one compile whatever its alignment.
_ROW_PARAMS = ["temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seeds_ptr"]


@triton.jit(do_not_specialize_on_alignment=_ROW_PARAMS)
def _race_chunks_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, ref_ptr, best_ptr, token_ptr,
    V, num_chunks, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    """Greedy rows and rows without filters: the argmax or the race over one CHUNK of the row per
    program, so that a row's reads spread over many SMs; _sample_kernel takes the best chunk.
    Filtered rows' programs exit at once."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    _, _, _, _, inv_t, sampled, k_on, p_on, min_p_on = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr,
                                                                    min_p_ptr, V)
    if ~sampled | ~(k_on | p_on | min_p_on):
        row_ptr = logits_ptr + row.to(tl.int64) * stride
        first = chunk * CHUNK
        end = tl.minimum(first + CHUNK, V)
        if sampled:
            token, ref, best = _race_row(row_ptr, first, end, NEG_INF, inv_t, tl.load(seeds_ptr + row), BLOCK)
        else:
            token, ref, best = _argmax_run(row_ptr, first, end, BLOCK)
        slot = row.to(tl.int64) * num_chunks + chunk
        tl.store(ref_ptr + slot, ref)  # the winner's score is ref * inv_t + best, kept apart for
        tl.store(best_ptr + slot, best)  # the merge to compare relative to the row's top ref
        tl.store(token_ptr + slot, token)


@triton.jit(do_not_specialize_on_alignment=_ROW_PARAMS)
def _sample_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr,
    out_ptr, thr_ptr, vals_ptr, idx_ptr, chunk_ref_ptr, chunk_best_ptr, chunk_token_ptr, V, num_chunks,
    CAP: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_POW2: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t, k, p, min_p, inv_t, sampled, k_on, p_on, min_p_on = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr,
                                                                        min_p_ptr, V)
    seed = tl.load(seeds_ptr + row)
    if ~sampled | ~(k_on | p_on | min_p_on):
        # The best of _race_chunks_kernel's chunks, the lowest token on ties: the first +inf if any,
        # token 0 if all are -inf. Scores relative to the top ref: absolute ones (ref / t, large at
        # small t) would round the noise away and break ties toward the lower chunk. A greedy row's
        # chunks hold their max (ref) and best 0, and its inv_t is 1: the first max wins.
        offs = tl.arange(0, CHUNKS_POW2)
        slots = row.to(tl.int64) * num_chunks + offs
        refs = tl.load(chunk_ref_ptr + slots, mask=offs < num_chunks, other=0.0)
        bests = tl.load(chunk_best_ptr + slots, mask=offs < num_chunks, other=NEG_INF)
        tokens = tl.load(chunk_token_ptr + slots, mask=offs < num_chunks, other=INT_MAX)
        valid = bests > NEG_INF
        top_ref = tl.max(tl.where(valid, refs, NEG_INF), 0)
        relative = tl.where(refs == top_ref, 0.0, (refs - top_ref) * inv_t)  # no inf - inf at a +inf top
        scores = tl.where(valid, relative + bests, NEG_INF)
        top = tl.max(scores, 0)
        token = tl.min(tl.where(scores == top, tokens, INT_MAX), 0)
        thr = tl.where(sampled, tl.where(top_ref == POS_INF, POS_INF, NEG_INF), top_ref)
    else:
        lanes, m, z, token = _row_stats(row_ptr, V, inv_t, BLOCK)
        thr = m
        if (m > NEG_INF) & (m < POS_INF):  # else the argmax: token 0 of an all -inf row, or the first +inf
            row_vals = vals_ptr + row.to(tl.int64) * CAP
            row_idx = idx_ptr + row.to(tl.int64) * CAP
            thr, n, complete = _threshold(row_ptr, V, lanes, m, z, t, k, p, min_p, inv_t, k_on, p_on, min_p_on,
                                          row_vals, row_idx, CAP, BLOCK)
            if complete:
                token = _race_candidates(row_vals, row_idx, n, thr, m, inv_t, seed, BLOCK)
            else:
                token, _, _ = _race_row(row_ptr, 0, V, thr, inv_t, seed, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))
    tl.store(thr_ptr + row, thr)


def _space(dtype, batch, vocab):
    return [
        {"BLOCK": block, "CAP": min(4096, vocab), "num_warps": warps}
        for block in (1024, 2048, 4096, 8192)
        for warps in (4, 8, 16)
        if block <= max(vocab, 1024)
    ]


def _default(dtype, batch, vocab):
    # What tuning picked at B 1, 32 and 256 (bench/NOTES-sampler.md): 2048-wide tiles; 8 warps
    # while rows are few (more loads in flight per row), 4 once two programs share an SM.
    return {"BLOCK": min(2048, max(vocab, 128)), "CAP": min(4096, vocab), "num_warps": 4 if batch > 128 else 8}


_TUNING = Tunable("sample", _space, _default)


def sample_bucket(dtype: torch.dtype, batch: int, vocab: int) -> tuple:
    """The tuning bucket of sample on [batch, vocab] logits of `dtype`."""
    return dtype_name(dtype), pow2(batch), pow2(vocab)


def sample_with_threshold(logits, temperature, top_k, top_p, min_p, seeds=None, config=None):
    """sample(), also returning each row's logit threshold T as float32 [B].

    A sampled row draws from {v : logits[b, v].float() >= T[b]} (NaN as -inf; -inf logits are
    never drawn); T is -inf for rows without filters, the row max for greedy rows and +inf for rows
    holding +inf (their first +inf is drawn). `config` overrides the tuned/default config.
    """
    batch, vocab = check_logits(logits)
    check_rows(batch, ROW_FLOATS, temperature=temperature, top_p=top_p, min_p=min_p)
    check_rows(batch, INDICES, top_k=top_k, **({} if seeds is None else {"seeds": seeds}))
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
        chunk_refs, chunk_bests = torch.empty(2, batch, num_chunks, dtype=torch.float32, device=logits.device)
        chunk_tokens = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
        _race_chunks_kernel[(batch, num_chunks)](
            logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, chunk_refs, chunk_bests, chunk_tokens,
            vocab, num_chunks, BLOCK=config["BLOCK"], CHUNK=chunk, num_warps=config["num_warps"],
        )
        _sample_kernel[(batch,)](
            logits, logits.stride(0), temperature, top_k, top_p, min_p, seeds, out, thr, vals, idx,
            chunk_refs, chunk_bests, chunk_tokens, vocab, num_chunks,
            CHUNKS_POW2=triton.next_power_of_2(num_chunks), **config,
        )

    launch(config or _TUNING.config(sample_bucket(logits.dtype, batch, vocab), launch))
    return out, thr


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row from softmax(logits / t) under top-k, then top-p, then min-p.

    logits [B, V] float32/float16/bfloat16 (computed in float32); temperature [B] float (below
    MIN_TEMPERATURE = 1e-5: greedy argmax, lowest index on ties); top_k [B] int (0 or >= V: off);
    top_p [B] float (1: off); min_p [B] float (0: off); seeds [B] int64, or None to draw them with
    torch.randint on the device. A row's token depends only on its logits, parameters and seed, not on the rest of the
    batch: same seed, same token. Returns int64 ids [B]; nothing is modified in place.
    Semantics are kernels.reference.sampling_probs'; NaN logits count as -inf, an all -inf row
    returns 0, a row holding +inf returns its first +inf (greedy or not). No host sync; two launches
    with grids fixed by (B, V, config) and float32 scratch allocated per call, so it can be captured
    in a CUDA graph.
    """
    return sample_with_threshold(logits, temperature, top_k, top_p, min_p, seeds)[0]
