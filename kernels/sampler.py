"""Sampling without sorting: temperature, top-k, top-p and min-p as one logit threshold, then a Gumbel race.

Every filter of the contract keeps a superlevel set of the row's logits {x >= T} (temperature > 0
preserves the order), so sampling reduces to finding one threshold T (kernels/sampler_search.py)
and running the race argmax(x / t + Gumbel noise) over {x >= T}, with Philox noise that depends
only on (seed, token): a row's draw depends on its logits, parameters and seed, never on its batch.

Three launches, so that a row's reads spread over many SMs whatever the batch:
  1. B x chunks programs, a chunk of 4 tiles each. Greedy rows: the chunk's first max. Rows
     without filters: the chunk's race (skipping tiles that cannot beat its running winner).
     Filtered rows are cut into parts of FILTER_TILES tiles instead (a config key, whole chunks:
     short parts when rows are few, long ones for a full batch): each chunk's max, sum-exp and
     argmax, and the part's top-k bound.
  2. B x parts programs, filtered rows only: the row's bound `low` <= T from its parts' stats,
     then the part's candidates {x >= low} to the part's scratch slots.
  3. B programs: the best chunk of an unfiltered or greedy row; a filtered row's candidates
     gathered to its scratch (or, if they pass CAP in all, collected from the row), the
     search for T there, then the race over them.

Conventions: NaN logits count as -inf, and -inf logits are never drawn (a filtered row's T is
finite); a row holding +inf puts all its mass on its +inf logits and returns the first of them,
as greedy does (T = +inf); a row whose logits are all -inf returns token 0; a temperature below
MIN_TEMPERATURE is greedy (1 / t would overflow the race's scores); top_p <= 0 keeps the most
likely token(s) only; min_p > 1 acts as 1. The launches have grids fixed by (B, V, BLOCK) and
never sync the host.
"""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.checks import INDICES, ROW_FLOATS, check_logits, check_rows
from tritonllm.kernels.sampler_race import _argmax_run, _race_candidates, _race_row
from tritonllm.kernels.sampler_search import (INT_MAX, NEG_INF, POS_INF, _bound, _collect, _kth_largest, _row_stats,
                                              _row_totals, _threshold)
from tritonllm.kernels.tuning import Tunable, dtype_name, pow2

RACE_CHUNK_TILES = 4  # tiles of a row one chunk program reads (8192 tokens at BLOCK 2048)
MIN_TEMPERATURE = 1e-5  # below it, greedy (vLLM's _SAMPLING_EPS)
_MIN_T = tl.constexpr(MIN_TEMPERATURE)  # kernels read globals only as constexprs


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
def _sample_chunks_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, ref_ptr, best_ptr, token_ptr,
    kth_ptr, V, num_chunks, chunks_per_part, num_parts, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    """Launch 1, one CHUNK of a row per program, so that a row's reads spread over many SMs.
    Greedy rows: the chunk's argmax; rows without filters: the chunk's race (_sample_kernel takes
    the best chunk). Filtered rows: one program per part of chunks_per_part chunks, which takes each
    chunk's max (ref), sum-exp against it (best) and argmax, and, with top-k on, the part's top-k
    bound (kth: the k-th largest of its BLOCK lane maxima). Stats per chunk, not per part: the row's
    sum-exp then adds the same terms whatever the part size, so a top-p boundary within rounding
    does not move with the config (nor with the batch, whose bucket picks it)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    _, k, _, _, inv_t, sampled, k_on, p_on, min_p_on = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr,
                                                                    min_p_ptr, V)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    slots = row.to(tl.int64) * num_chunks
    if sampled & (k_on | p_on | min_p_on):
        if chunk < num_parts:  # this program is part `chunk`
            lanes = tl.full([BLOCK], NEG_INF, tl.float32)
            for c in range(chunk * chunks_per_part, tl.minimum((chunk + 1) * chunks_per_part, num_chunks)):
                first = c * CHUNK
                chunk_lanes, ref, best, token = _row_stats(row_ptr, first, tl.minimum(first + CHUNK, V), inv_t, BLOCK)
                lanes = tl.maximum(lanes, chunk_lanes)  # lane i still holds a distinct element
                tl.store(ref_ptr + slots + c, ref)
                tl.store(best_ptr + slots + c, best)
                tl.store(token_ptr + slots + c, token)
            kth = NEG_INF
            if k_on & (k <= BLOCK):
                kth = _kth_largest(lanes, k)
            tl.store(kth_ptr + slots + chunk, kth)
    else:
        first = chunk * CHUNK
        end = tl.minimum(first + CHUNK, V)
        if sampled:
            token, ref, best = _race_row(row_ptr, first, end, NEG_INF, inv_t, tl.load(seeds_ptr + row), BLOCK)
        else:
            token, ref, best = _argmax_run(row_ptr, first, end, BLOCK)
        tl.store(ref_ptr + slots + chunk, ref)  # a race winner's score is ref * inv_t + best, kept apart
        tl.store(best_ptr + slots + chunk, best)  # for the merge to compare relative to the row's top ref
        tl.store(token_ptr + slots + chunk, token)


@triton.jit(do_not_specialize_on_alignment=_ROW_PARAMS)
def _sample_collect_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, ref_ptr, best_ptr, token_ptr, kth_ptr,
    vals_ptr, idx_ptr, count_ptr, V, num_chunks, part, num_parts,
    PART_CAP: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_POW2: tl.constexpr,
):
    """Launch 2, filtered rows only, one part per program: the part's elements >= the row's bound
    `low` go to the part's PART_CAP scratch slots (the first PART_CAP, in row order), with their
    count."""
    row = tl.program_id(0)
    index = tl.program_id(1)  # of the part
    t, k, p, min_p, inv_t, sampled, k_on, p_on, min_p_on = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr,
                                                                        min_p_ptr, V)
    if sampled & (k_on | p_on | min_p_on):
        m, z, _, k_low = _row_totals(row, ref_ptr, best_ptr, token_ptr, kth_ptr, inv_t, num_chunks, num_parts,
                                     CHUNKS_POW2)
        if (m > NEG_INF) & (m < POS_INF):
            low = _bound(m, z, t, k, p, min_p, inv_t, k_on, p_on, min_p_on, k_low, V)[0]
            slot = row.to(tl.int64) * num_parts + index
            first = index * part
            n = _collect(logits_ptr + row.to(tl.int64) * stride, first, tl.minimum(first + part, V), low, POS_INF,
                         vals_ptr + slot * PART_CAP, idx_ptr + slot * PART_CAP, PART_CAP, BLOCK)
            tl.store(count_ptr + slot, n)


@triton.jit
def _gather_candidates(row, count_ptr, part_vals, part_idx, row_vals, row_idx, num_parts, CAP: tl.constexpr,
                       PART_CAP: tl.constexpr, CHUNKS_POW2: tl.constexpr, TILE: tl.constexpr):
    """Copy a row's part candidates to its scratch, in row order, if they fit its CAP slots (a part
    holds min(CAP, part) slots, so none overflowed then).
    Returns (how many, whether they fit)."""
    offs = tl.arange(0, CHUNKS_POW2)
    counts = tl.load(count_ptr + row.to(tl.int64) * num_parts + offs, mask=offs < num_parts, other=0)
    starts = tl.cumsum(counts, 0) - counts
    n = tl.sum(counts, 0)
    fits = n <= CAP
    for first in range(0, tl.where(fits, n, 0), TILE):
        s = first + tl.arange(0, TILE)
        # Slot s belongs to the last part that holds candidates and starts at or before it.
        holder = (starts[None, :] <= s[:, None]) & (counts[None, :] > 0)
        part = tl.max(tl.where(holder, offs[None, :], 0), 1)
        src = (row.to(tl.int64) * num_parts + part) * PART_CAP + s - tl.max(tl.where(holder, starts[None, :], 0), 1)
        tl.store(row_vals + s, tl.load(part_vals + src, mask=s < n, other=NEG_INF), mask=s < n)
        tl.store(row_idx + s, tl.load(part_idx + src, mask=s < n, other=0), mask=s < n)
    tl.debug_barrier()  # the scratch written by some threads is read by others
    return n, fits


@triton.jit(do_not_specialize_on_alignment=_ROW_PARAMS)
def _sample_kernel(
    logits_ptr, stride, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr,
    out_ptr, thr_ptr, vals_ptr, idx_ptr, ref_ptr, best_ptr, token_ptr, kth_ptr, part_vals, part_idx, count_ptr,
    V, num_chunks, num_parts, CAP: tl.constexpr, PART_CAP: tl.constexpr, BLOCK: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
):
    """Launch 3, one program per row: the best chunk of unfiltered and greedy rows; a filtered row's
    threshold search over its candidates (the row itself where they overflowed), then its race."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride
    t, k, p, min_p, inv_t, sampled, k_on, p_on, min_p_on = _row_params(row, temperature_ptr, top_k_ptr, top_p_ptr,
                                                                        min_p_ptr, V)
    seed = tl.load(seeds_ptr + row)
    if ~sampled | ~(k_on | p_on | min_p_on):
        # The best of launch 1's chunks, the lowest token on ties: the first +inf if any,
        # token 0 if all are -inf. Scores relative to the top ref: absolute ones (ref / t, large at
        # small t) would round the noise away and break ties toward the lower chunk. A greedy row's
        # chunks hold their max (ref) and best 0, and its inv_t is 1: the first max wins.
        offs = tl.arange(0, CHUNKS_POW2)
        slots = row.to(tl.int64) * num_chunks + offs
        refs = tl.load(ref_ptr + slots, mask=offs < num_chunks, other=0.0)
        bests = tl.load(best_ptr + slots, mask=offs < num_chunks, other=NEG_INF)
        tokens = tl.load(token_ptr + slots, mask=offs < num_chunks, other=INT_MAX)
        valid = bests > NEG_INF
        top_ref = tl.max(tl.where(valid, refs, NEG_INF), 0)
        relative = tl.where(refs == top_ref, 0.0, (refs - top_ref) * inv_t)  # no inf - inf at a +inf top
        scores = tl.where(valid, relative + bests, NEG_INF)
        top = tl.max(scores, 0)
        token = tl.min(tl.where(scores == top, tokens, INT_MAX), 0)
        thr = tl.where(sampled, tl.where(top_ref == POS_INF, POS_INF, NEG_INF), top_ref)
    else:
        m, z, token, k_low = _row_totals(row, ref_ptr, best_ptr, token_ptr, kth_ptr, inv_t, num_chunks, num_parts,
                                         CHUNKS_POW2)
        thr = m
        if (m > NEG_INF) & (m < POS_INF):  # else the argmax: token 0 of an all -inf row, or the first +inf
            low, tau_min_p = _bound(m, z, t, k, p, min_p, inv_t, k_on, p_on, min_p_on, k_low, V)
            row_vals = vals_ptr + row.to(tl.int64) * CAP
            row_idx = idx_ptr + row.to(tl.int64) * CAP
            n, complete = _gather_candidates(row, count_ptr, part_vals, part_idx, row_vals, row_idx, num_parts,
                                             CAP, PART_CAP, CHUNKS_POW2, BLOCK // 4)
            if ~complete:  # more than CAP candidates: collect from the row
                n = _collect(row_ptr, 0, V, low, POS_INF, row_vals, row_idx, CAP, BLOCK)
                complete = n <= CAP
            thr, n, complete = _threshold(row_ptr, V, m, z, t, k, p, inv_t, k_on, p_on, low, tau_min_p,
                                          row_vals, row_idx, n, complete, CAP, BLOCK)
            if complete:
                token = _race_candidates(row_vals, row_idx, n, thr, m, inv_t, seed, BLOCK)
            else:
                token, _, _ = _race_row(row_ptr, 0, V, thr, inv_t, seed, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))
    tl.store(thr_ptr + row, thr)


def _space(dtype, batch, vocab):
    return [
        {"BLOCK": block, "CAP": min(4096, vocab), "num_warps": warps, "FILTER_TILES": tiles}
        for block in (1024, 2048, 4096, 8192)
        for warps in (4, 8, 16)
        for tiles in (4, 8, 16, 32, 64)
        if block <= max(vocab, 1024)
    ]


def _default(dtype, batch, vocab):
    # What tuning picked at B 1, 32 and 256 (bench/NOTES-sampler.md): 2048-wide tiles; 8 warps
    # while rows are few (more loads in flight per row), 4 once two programs share an SM. A
    # filtered row's parts grow with the batch (the best of a sweep at B 1-256): short parts spread
    # a few rows over the GPU, longer ones spare a full batch most of the per-part top-k bounds.
    return {"BLOCK": min(2048, max(vocab, 128)), "CAP": min(4096, vocab), "num_warps": 4 if batch > 128 else 8,
            "FILTER_TILES": max(RACE_CHUNK_TILES, min(32, pow2(batch) // 4))}


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
        device, block, cap = logits.device, config["BLOCK"], config["CAP"]
        chunk = RACE_CHUNK_TILES * block
        chunks_per_part = max(config["FILTER_TILES"] // RACE_CHUNK_TILES, 1)
        part = chunks_per_part * chunk
        num_chunks, num_parts = triton.cdiv(vocab, chunk), triton.cdiv(vocab, part)
        part_cap = min(cap, part)  # a row whose parts hold more than CAP in all collects from the row
        vals = torch.empty(batch, cap, dtype=torch.float32, device=device)
        idx = torch.empty(batch, cap, dtype=torch.int32, device=device)
        part_vals = torch.empty(batch, num_parts, part_cap, dtype=torch.float32, device=device)
        part_idx = torch.empty(batch, num_parts, part_cap, dtype=torch.int32, device=device)
        refs, bests, kths = torch.empty(3, batch, num_chunks, dtype=torch.float32, device=device)
        tokens = torch.empty(batch, num_chunks, dtype=torch.int32, device=device)
        counts = torch.empty(batch, num_parts, dtype=torch.int32, device=device)
        params = (logits, logits.stride(0), temperature, top_k, top_p, min_p)
        stats = (refs, bests, tokens, kths)
        meta = {"BLOCK": block, "CHUNKS_POW2": triton.next_power_of_2(num_chunks), "num_warps": config["num_warps"]}
        _sample_chunks_kernel[(batch, num_chunks)](
            *params, seeds, *stats, vocab, num_chunks, chunks_per_part, num_parts, BLOCK=block, CHUNK=chunk,
            num_warps=config["num_warps"],
        )
        _sample_collect_kernel[(batch, num_parts)](
            *params, *stats, part_vals, part_idx, counts, vocab, num_chunks, part, num_parts, PART_CAP=part_cap, **meta,
        )
        _sample_kernel[(batch,)](
            *params, seeds, out, thr, vals, idx, *stats, part_vals, part_idx, counts, vocab, num_chunks, num_parts,
            CAP=cap, PART_CAP=part_cap, **meta,
        )

    launch(config or _TUNING.config(sample_bucket(logits.dtype, batch, vocab), launch))
    return out, thr


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row from softmax(logits / t) under top-k, then top-p, then min-p.

    logits [B, V] float32/float16/bfloat16 (computed in float32); temperature [B] float (read as
    float32; below MIN_TEMPERATURE = 1e-5: greedy argmax, lowest index on ties); top_k [B] int (0 or >= V: off);
    top_p [B] float (1: off); min_p [B] float (0: off); seeds [B] int64, or None to draw them with
    torch.randint on the device. A row's token depends only on its logits, parameters and seed, not on the rest of the
    batch: same seed, same token. Returns int64 ids [B]; nothing is modified in place.
    Semantics are kernels.reference.sampling_probs'; NaN logits count as -inf, an all -inf row
    returns 0, a row holding +inf returns its first +inf (greedy or not). No host sync; three launches
    with grids fixed by (B, V, config) and float32 scratch allocated per call, so it can be captured
    in a CUDA graph.
    """
    return sample_with_threshold(logits, temperature, top_k, top_p, min_p, seeds)[0]
