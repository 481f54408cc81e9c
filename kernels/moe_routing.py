"""Qwen3-MoE routing: the router's top-k (`moe_route`) and the grouping of token-expert pairs by
expert for the grouped GEMMs of fused_moe.py (`moe_align`).

moe_align runs without host syncs and with shapes fixed by its inputs' shapes (decode steps are
captured in CUDA graphs). Pairs keep their flat-index order inside an expert's group, so the layout
is the same on every run: a histogram of each chunk of CHUNK pairs; a prefix sum over experts (the
padded group starts) and over chunks (where each chunk's pairs of an expert begin); then a pair's
slot is that base plus the pairs of its expert before it in its chunk (a CHUNK x CHUNK compare).
Up to SMALL_PAIRS pairs (decode) one program does it all; past that three launches: histograms
(which also add up each expert's total), bases (a program per expert), scatter.
"""
import torch
import triton
import triton.language as tl

from tritonllm.kernels.checks import FLOATS, INDICES, check_dtype
from tritonllm.kernels.tuning import Tunable, dtype_name, pow2

# Past 16 tokens of top-8 routing, three launches that scatter chunks in parallel beat one program
# that scatters them in turn; narrower chunks cost less in the scatter's CHUNK x CHUNK compare
# (bench/NOTES-moe.md).
SMALL_PAIRS = 128  # up to this many pairs, moe_align is one program
CHUNK = 64  # pairs a histogram / scatter step


# Counts of tokens, pairs, chunks and blocks change every prefill step; left unspecialized (Triton
# would compile again for 1 and for multiples of 16), one compile serves them all.
@triton.jit(do_not_specialize=["num_tokens"])
def _moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_logits,
                      TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    experts = tl.arange(0, BLOCK_E)
    row_mask = rows < num_tokens
    expert_mask = experts < num_experts
    offsets = rows.to(tl.int64)[:, None] * stride_logits + experts[None, :]
    # Rows past the tokens read zeros (never stored): no -inf - -inf NaN anywhere.
    x = tl.load(logits_ptr + offsets, mask=row_mask[:, None] & expert_mask[None, :], other=0.0).to(tl.float32)
    x = tl.where(expert_mask[None, :], x, float("-inf"))
    e = tl.exp(x - tl.max(x, 1)[:, None])
    total = tl.sum(e, 1)
    # A NaN or +inf logit, or no finite one, makes the whole softmax NaN (as torch's): such a row
    # takes experts 0, 1, ... (a stable sort of equal values) with NaN weights.
    nan_row = total != total
    # Probabilities are >= 0, so -1 marks lanes that are no expert or already taken.
    p = tl.where(expert_mask[None, :], tl.where(nan_row[:, None], 1.0, e / total[:, None]), -1.0)
    cols = tl.arange(0, BLOCK_K)
    weights = tl.zeros([ROWS, BLOCK_K], tl.float32)
    ids = tl.zeros([ROWS, BLOCK_K], tl.int32)
    for j in range(TOP_K):
        best = tl.max(p, 1)
        # Ties: the lowest expert index first.
        pick = tl.min(tl.where(p == best[:, None], experts[None, :], BLOCK_E), 1)
        p = tl.where(experts[None, :] == pick[:, None], -1.0, p)
        weights = tl.where(cols[None, :] == j, best[:, None], weights)
        ids = tl.where(cols[None, :] == j, pick[:, None], ids)
    weights = tl.where(nan_row[:, None], float("nan"), weights)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + cols[None, :]
    out_mask = row_mask[:, None] & (cols[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=out_mask)
    tl.store(ids_ptr + out, ids, mask=out_mask)


def _route_space(dtype, experts_bucket, tokens_bucket):
    return [{"ROWS": rows, "num_warps": warps, "num_stages": 1}
            for rows in (1, 2, 4, 8, 16) for warps in (1, 2, 4, 8)
            if rows <= tokens_bucket and (warps == 1 or rows * experts_bucket >= 32 * warps)]


def _route_default(dtype, experts_bucket, tokens_bucket):
    # About 512 logits a program (4 rows of 128 experts), a warp per 128 logits: the H200 sweep at E 128
    # (bench/NOTES-moe.md) found that fastest from 4 to 1024 tokens, one warp best for one token.
    rows = max(1, min(4, 512 // experts_bucket, tokens_bucket))
    return {"ROWS": rows, "num_warps": max(1, min(4, rows * experts_bucket // 128)), "num_stages": 1}


_ROUTE_TUNING = Tunable("moe_route", _route_space, _route_default)


def moe_route_bucket(dtype: torch.dtype, num_experts: int, num_tokens: int) -> tuple:
    """The tuning bucket of moe_route on router_logits [num_tokens, num_experts] of `dtype`."""
    return dtype_name(dtype), pow2(num_experts), pow2(num_tokens)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """The router's choice: softmax over all experts in float32, the top_k largest probabilities.

    router_logits: [T, E] float32/float16/bfloat16, rows contiguous. Ties go to the lower expert
    index. renormalize: the top_k weights divided by their sum. Returns (topk_weights [T, top_k]
    float32, topk_ids [T, top_k] int32), each row in descending weight order. Nothing in place.
    """
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must be [T, E] with contiguous rows, got {tuple(router_logits.shape)}")
    check_dtype("router_logits", router_logits, FLOATS)
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, E = {num_experts}], got {top_k}")
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids

    def launch(config):
        _moe_route_kernel[(triton.cdiv(num_tokens, config["ROWS"]),)](
            router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0),
            TOP_K=top_k, RENORMALIZE=bool(renormalize), BLOCK_E=pow2(num_experts), BLOCK_K=pow2(top_k), **config)

    launch(_ROUTE_TUNING.config(moe_route_bucket(router_logits.dtype, num_experts, num_tokens), launch))
    return weights, ids


@triton.jit
def _chunk_counts(ids_ptr, chunk, num_pairs, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """How many pairs of chunk `chunk` (BLOCK pairs) go to each expert: [BLOCK_E] int32."""
    offs = chunk * BLOCK + tl.arange(0, BLOCK)  # pair indices are int32 (fewer than 2**31 pairs)
    mask = offs < num_pairs
    counts = tl.histogram(tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32), BLOCK_E)
    # Lanes past the pairs read expert 0: take them off its count.
    return counts - tl.where(tl.arange(0, BLOCK_E) == 0, BLOCK - tl.sum(mask.to(tl.int32), 0), 0)


@triton.jit
def _real_pairs(real_tokens_ptr, num_pairs, top_k, HAS_REAL_TOKENS: tl.constexpr):
    """The pairs to group: those of the first real_tokens[0] tokens (a graph's padding tokens are the
    rest), else all."""
    limit = num_pairs
    if HAS_REAL_TOKENS:
        limit = tl.minimum(tl.load(real_tokens_ptr) * top_k, num_pairs)
    return limit


@triton.jit
def _group_ends(totals, BLOCK_M: tl.constexpr):
    """Each expert's group (totals [BLOCK_E] pairs) padded to BLOCK_M, the groups laid end to end:
    (padded sizes, group ends)."""
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    return padded, tl.cumsum(padded, 0)


@triton.jit
def _store_group_ends(ends_ptr, num_padded_ptr, padded, ends):
    tl.store(ends_ptr + tl.arange(0, ends.shape[0]), ends)
    tl.store(num_padded_ptr, tl.sum(padded, 0))


@triton.jit
def _group_bases(scratch_ptr, sorted_ptr, num_padded_ptr, num_chunks, num_pairs,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr):
    """From the chunk histograms counts [num_chunks, BLOCK_E] (after the group ends in scratch):
    each expert's group padded to BLOCK_M, the groups laid end to end. Writes bases [num_chunks,
    BLOCK_E] (after counts; not in place, so no thread overwrites what another still reads): the
    slot of chunk c's first pair of expert e, its group start plus e's pairs in earlier chunks. Also
    the group ends, num_padded and the padding sentinels inside the groups."""
    counts_ptr = scratch_ptr + BLOCK_E
    bases_ptr = counts_ptr + num_chunks * BLOCK_E
    experts = tl.arange(0, BLOCK_E)
    chunks = tl.arange(0, ROWS)
    totals = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_chunks, ROWS):  # ROWS chunks a step
        offsets = (c0 + chunks)[:, None] * BLOCK_E + experts[None, :]
        totals += tl.sum(tl.load(counts_ptr + offsets, mask=(c0 + chunks < num_chunks)[:, None], other=0), 0)
    padded, ends = _group_ends(totals, BLOCK_M)
    _store_group_ends(scratch_ptr, num_padded_ptr, padded, ends)
    running = ends - padded
    # Slot j of each group's padding, for all experts at once (a [BLOCK_E, BLOCK_M] tile compiles slowly).
    for j in range(BLOCK_M - 1):
        tl.store(sorted_ptr + running + totals + j, num_pairs, mask=j < padded - totals)
    for c0 in range(0, num_chunks, ROWS):
        offsets = (c0 + chunks)[:, None] * BLOCK_E + experts[None, :]
        mask = (c0 + chunks < num_chunks)[:, None]
        counts = tl.load(counts_ptr + offsets, mask=mask, other=0)
        tl.store(bases_ptr + offsets, running[None, :] + tl.cumsum(counts, 0) - counts, mask=mask)
        running += tl.sum(counts, 0)


@triton.jit
def _scatter_chunk(ids_ptr, base_ptr, sorted_ptr, chunk, num_pairs, BLOCK: tl.constexpr):
    """Writes the flat index of each pair of the chunk to its slot: base[expert] (the chunk's row of
    _group_bases) plus the pairs of the same expert before it in the chunk."""
    local = tl.arange(0, BLOCK)
    offs = chunk * BLOCK + local
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    before = (ids[:, None] == ids[None, :]) & (local[None, :] < local[:, None])
    slot = tl.load(base_ptr + ids, mask=mask, other=0) + tl.sum(before.to(tl.int32), 1)
    tl.store(sorted_ptr + slot, offs, mask=mask)


@triton.jit
def _block_experts(ends_ptr, num_padded_ptr, block_expert_ptr, sorted_ptr, first_block, last_block, num_pairs,
                   BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """block_expert of blocks [first_block, last_block): the expert whose group holds the block, -1
    past num_padded; the sorted slots of those blocks get the sentinel."""
    ends = tl.load(ends_ptr + tl.arange(0, BLOCK_E))
    total = tl.load(num_padded_ptr)
    pad = tl.arange(0, BLOCK_M)
    for b0 in range(first_block, last_block, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        start = blocks.to(tl.int64) * BLOCK_M
        # Groups ending at or before the block's start come before its expert (empty ones too).
        expert = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), 1)
        used = start < total
        tl.store(block_expert_ptr + blocks, tl.where(used, expert, -1), mask=blocks < last_block)
        tl.store(sorted_ptr + start[:, None] + pad[None, :], num_pairs, mask=((blocks < last_block) & ~used)[:, None])


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "num_blocks"])
def _align_small_kernel(ids_ptr, real_tokens_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, scratch_ptr, num_pairs,
                        top_k, num_chunks, num_blocks, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_E: tl.constexpr, ROWS: tl.constexpr, BLOCK_B: tl.constexpr,
                        HAS_REAL_TOKENS: tl.constexpr):
    # scratch: the group ends, the chunk histograms, the bases. Barriers: the threads that read
    # each phase's stores are not those that wrote them.
    real = _real_pairs(real_tokens_ptr, num_pairs, top_k, HAS_REAL_TOKENS)
    for c in range(num_chunks):
        tl.store(scratch_ptr + (c + 1) * BLOCK_E + tl.arange(0, BLOCK_E),
                 _chunk_counts(ids_ptr, c, real, BLOCK, BLOCK_E))
    tl.debug_barrier()
    _group_bases(scratch_ptr, sorted_ptr, num_padded_ptr, num_chunks, num_pairs, BLOCK_M, BLOCK_E, ROWS)
    tl.debug_barrier()
    for c in range(num_chunks):
        _scatter_chunk(ids_ptr, scratch_ptr + (num_chunks + c + 1) * BLOCK_E, sorted_ptr, c, real, BLOCK)
    _block_experts(scratch_ptr, num_padded_ptr, block_expert_ptr, sorted_ptr, 0, num_blocks, num_pairs,
                   BLOCK_M, BLOCK_E, BLOCK_B)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_count_kernel(ids_ptr, real_tokens_ptr, scratch_ptr, totals_ptr, num_pairs, top_k, BLOCK: tl.constexpr,
                        BLOCK_E: tl.constexpr, HAS_REAL_TOKENS: tl.constexpr):
    chunk = tl.program_id(0)
    counts = _chunk_counts(ids_ptr, chunk, _real_pairs(real_tokens_ptr, num_pairs, top_k, HAS_REAL_TOKENS), BLOCK,
                           BLOCK_E)
    tl.store(scratch_ptr + (chunk + 1) * BLOCK_E + tl.arange(0, BLOCK_E), counts)
    # Integer adds: the totals are the same whatever order the chunks arrive in.
    tl.atomic_add(totals_ptr + tl.arange(0, BLOCK_E), counts, sem="relaxed")


@triton.jit(do_not_specialize=["num_chunks", "num_pairs"])
def _align_bases_kernel(scratch_ptr, totals_ptr, sorted_ptr, num_padded_ptr, num_chunks, num_pairs,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    # One program an expert: its group's start from all the totals, its padding sentinels, then the
    # prefix of its column of chunk histograms (bases, after the histograms in scratch).
    expert = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    totals = tl.load(totals_ptr + experts)
    padded, ends = _group_ends(totals, BLOCK_M)
    if expert == 0:
        _store_group_ends(scratch_ptr, num_padded_ptr, padded, ends)
    mine = experts == expert
    total = tl.sum(tl.where(mine, totals, 0), 0)
    running = tl.sum(tl.where(mine, ends - padded, 0), 0)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + running + total + pad, num_pairs, mask=pad < tl.sum(tl.where(mine, padded, 0), 0) - total)
    counts_ptr = scratch_ptr + BLOCK_E + expert
    bases_ptr = counts_ptr + num_chunks * BLOCK_E
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        mask = chunks < num_chunks
        counts = tl.load(counts_ptr + chunks * BLOCK_E, mask=mask, other=0)
        tl.store(bases_ptr + chunks * BLOCK_E, running + tl.cumsum(counts, 0) - counts, mask=mask)
        running += tl.sum(counts, 0)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_scatter_kernel(ids_ptr, real_tokens_ptr, scratch_ptr, num_padded_ptr, sorted_ptr, block_expert_ptr,
                          num_pairs, top_k, num_blocks, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, HAS_REAL_TOKENS: tl.constexpr):
    chunk = tl.program_id(0)
    _scatter_chunk(ids_ptr, scratch_ptr + (tl.num_programs(0) + chunk + 1) * BLOCK_E, sorted_ptr, chunk,
                   _real_pairs(real_tokens_ptr, num_pairs, top_k, HAS_REAL_TOKENS), BLOCK)
    # Each program also labels its share of the blocks.
    share = tl.cdiv(num_blocks, tl.num_programs(0))
    first = chunk * share
    _block_experts(scratch_ptr, num_padded_ptr, block_expert_ptr, sorted_ptr, first,
                   tl.minimum(first + share, num_blocks), num_pairs, BLOCK_M, BLOCK_E, BLOCK_B)


def moe_align_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """P, the static length of sorted_ids: the pairs plus at most block_m - 1 padding slots for each
    of the min(E, pairs) experts that can be used, rounded up to block_m."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, real_tokens: torch.Tensor | None = None):
    """Groups the T*k token-expert pairs by expert, each group padded to a multiple of block_m.

    topk_ids: [T, k] int32/int64 in [0, num_experts), contiguous. block_m: a power of two.
    real_tokens: optional int32 [1] on topk_ids' device; only the pairs of tokens t < real_tokens[0]
    are grouped (a CUDA graph's padding tokens are the rest). Returns (sorted_ids [P] int32: flat
    pair indices t*k + j grouped by expert in ascending order, padding slots = T*k; block_expert
    [P // block_m] int32: each block's expert, -1 past the used blocks; num_padded [1] int32: the
    used slots). P = moe_align_size(T*k, E, block_m) depends on the shapes only; no host sync.
    Nothing in place.
    """
    if topk_ids.dim() != 2 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be a contiguous [T, k], got {tuple(topk_ids.shape)}")
    check_dtype("topk_ids", topk_ids, INDICES)
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if real_tokens is not None and (real_tokens.shape != (1,) or real_tokens.dtype != torch.int32
                                    or real_tokens.device != topk_ids.device):
        raise ValueError(f"real_tokens must be an int32 [1] on {topk_ids.device}, got {real_tokens.dtype} "
                         f"{tuple(real_tokens.shape)} on {real_tokens.device}")
    num_pairs = topk_ids.numel()
    size = moe_align_size(num_pairs, num_experts, block_m)
    num_blocks = size // block_m
    device = topk_ids.device
    sorted_ids = torch.empty(size, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return sorted_ids, block_expert, torch.zeros(1, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_e = pow2(num_experts)
    chunk = min(CHUNK, pow2(num_pairs))
    num_chunks = triton.cdiv(num_pairs, chunk)
    # _group_bases scans ROWS chunk histograms a step (2k elements), _block_experts compares
    # BLOCK_B blocks with every group end (8k).
    rows = max(1, min(pow2(num_chunks), 2048 // block_e))
    meta = {"BLOCK_M": block_m, "BLOCK_E": block_e, "num_warps": 4}
    real = {"HAS_REAL_TOKENS": real_tokens is not None}  # without it the kernels never read the pointer
    count_ptr, top_k = topk_ids if real_tokens is None else real_tokens, topk_ids.shape[1]
    block_b = max(1, min(64, 8192 // block_e))
    # The group ends, then the histogram and the bases of each chunk.
    scratch = torch.empty((2 * num_chunks + 1) * block_e, dtype=torch.int32, device=device)
    if num_pairs <= SMALL_PAIRS:
        _align_small_kernel[(1,)](topk_ids, count_ptr, sorted_ids, block_expert, num_padded, scratch, num_pairs, top_k,
                                  num_chunks, num_blocks, BLOCK=chunk, ROWS=rows, BLOCK_B=block_b, **meta, **real)
        return sorted_ids, block_expert, num_padded
    totals = torch.zeros(block_e, dtype=torch.int32, device=device)
    _align_count_kernel[(num_chunks,)](topk_ids, count_ptr, scratch, totals, num_pairs, top_k, BLOCK=chunk,
                                       BLOCK_E=block_e, num_warps=4, **real)
    _align_bases_kernel[(num_experts,)](scratch, totals, sorted_ids, num_padded, num_chunks, num_pairs,
                                        BLOCK_C=min(pow2(num_chunks), 1024), **meta)
    _align_scatter_kernel[(num_chunks,)](topk_ids, count_ptr, scratch, num_padded, sorted_ids, block_expert, num_pairs,
                                         top_k, num_blocks, BLOCK=chunk, BLOCK_B=block_b, **meta, **real)
    return sorted_ids, block_expert, num_padded
