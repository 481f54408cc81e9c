"""PyTorch references of every public kernel, with the same signatures.

They are the oracle of the tests (call them on float64 inputs for an exact answer), the baseline
of the benchmarks and an engine backend for side-by-side runs. Each rounds to the input dtype at
the points HF transformers' Qwen3 does and computes in at least float32 in between.
"""
import torch

from tritonllm.kernels.fp8 import check_kv_scales
from tritonllm.kernels.sampler import MIN_TEMPERATURE


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def quantize_e4m3(x):
    """Per-row e4m3 over the last dim of x: (q float8_e4m3fn of x's shape, scale float32 x.shape[:-1]),
    scale = max|x| / 448 (1.0 where that is 0: an all-zero row, or one too small for a float32 scale),
    q = x / scale in float32, saturated to +-448."""
    xf = x.float()
    e4m3_max = torch.finfo(torch.float8_e4m3fn).max
    amax = xf.abs().amax(-1)
    # Divided by a tensor: on CUDA torch divides by a Python scalar through its reciprocal, which is
    # not the correctly rounded amax / 448 the kernels compute.
    scale = amax / torch.full_like(amax, e4m3_max)
    scale = torch.where(scale == 0, 1.0, scale)
    return (xf / scale[..., None]).clamp(-e4m3_max, e4m3_max).to(torch.float8_e4m3fn), scale


def store_kv_cache(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None):
    """Write k[t], v[t] ([T, Hkv, D]) to slot slot_mapping[t] of the caches; slot < 0 skips. In place.
    An e4m3 cache stores quantize_e4m3 of each row and its scale at [slot, head] of k_scale / v_scale."""
    fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = x[keep]
        # Indexed by (block, offset) rather than through a flat view: a key-major V and head-major
        # scales have none.
        if fp8:
            rows, row_scales = quantize_e4m3(rows)
            scale[slots // scale.shape[1], slots % scale.shape[1]] = row_scales
        cache[slots // cache.shape[1], slots % cache.shape[1]] = rows.to(cache.dtype)


def _cache_values(cache, scale, index, dtype):
    """cache[index] (any leading index) in `dtype`: an e4m3 cache's codes times their row scales, in
    float32 (float64 for a float64 dtype), then rounded."""
    values = cache[index].to(_compute_dtype(dtype))
    if scale is not None:
        values = values * scale[index][..., None].to(values.dtype)
    return values.to(dtype)


def gather_kv_blocks(k_cache, v_cache, blocks, dtype, *, k_scale=None, v_scale=None, out=None):
    """Blocks `blocks` [N] of the caches as contiguous (k, v) [N, block_size, Hkv, D] of `dtype` (_cache_values),
    new tensors, or written into the first N blocks of `out` (k, v) and returned."""
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    index = blocks.long()
    copies = [_cache_values(k_cache, k_scale, index, dtype), _cache_values(v_cache, v_scale, index, dtype)]
    if out is None:
        return tuple(c.contiguous() for c in copies)
    for target, c in zip(out, copies):
        target[:len(index)] = c
    return out


def rms_norm(x, weight, eps):
    """HF Qwen3RMSNorm over the last dim of x; returns x.dtype."""
    xf = x.to(_compute_dtype(x.dtype))
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    """h = x + residual (rounded to x.dtype), y = rms_norm(h); returns new tensors (y, h)."""
    h = (x.to(_compute_dtype(x.dtype)) + residual).to(x.dtype)
    return rms_norm(h, weight, eps), h


def rotary_embedding(positions, q, k, cos_sin_cache):
    """Neox rotary on q [T, Hq, D] and k [T, Hkv, D] in float32, one rounding; returns new (q, k)."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions.long()]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]

    def rotate(x):
        xf = x.to(_compute_dtype(x.dtype))
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def qk_norm_rotary_store(positions, qkv, q_weight, k_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping,
                         num_heads, num_kv_heads, out=None, *, k_scale=None, v_scale=None, k_copy=None, v_copy=None,
                         copy_slots=None):
    """rms_norm on the q and k heads of qkv [T, (Hq + 2*Hkv) * D], rotary_embedding, store_kv_cache
    of k and v (in place, slot < 0 skips); returns q [T, Hq, D] (written into `out` when given).
    An e4m3 cache quantizes k as rotated in float32, before any rounding to qkv's dtype. With copies,
    each stored row is also written, as the cache holds it (_cache_values), to slot copy_slots[t] of
    k_copy / v_copy (copy_slots[t] < 0 or slot_mapping[t] < 0 skips)."""
    n_tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = rms_norm(q.reshape(n_tokens, num_heads, head_dim), q_weight, eps)
    k = rms_norm(k.reshape(n_tokens, num_kv_heads, head_dim), k_weight, eps)
    if k_cache.dtype == torch.float8_e4m3fn:
        k = k.to(_compute_dtype(k.dtype))  # rotary_embedding then rounds to the compute dtype only
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    store_kv_cache(k, v.reshape(n_tokens, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping,
                   k_scale=k_scale, v_scale=v_scale)
    if k_copy is not None:
        keep = (slot_mapping >= 0) & (copy_slots >= 0)
        slots, targets = slot_mapping[keep].long(), copy_slots[keep].long()
        block_size = k_cache.shape[1]
        index = (slots // block_size, slots % block_size)
        for cache, scale, copy in ((k_cache, k_scale, k_copy), (v_cache, v_scale, v_copy)):
            copy[targets // block_size, targets % block_size] = _cache_values(cache, scale, index, copy.dtype)
    if out is None:
        return q.contiguous()
    out.copy_(q)
    return out


def linear(x, weight, bias=None, *, counts=None, out=None, config=None):
    """torch.nn.functional.linear (the engine's reference backend); counts and config are the Triton
    kernel's and unused here."""
    y = torch.nn.functional.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


def silu_and_mul(x):
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:] with HF's rounding (silu rounded, then the product)."""
    inter = x.shape[-1] // 2
    xf = x.to(_compute_dtype(x.dtype))
    gate = torch.nn.functional.silu(xf[..., :inter]).to(x.dtype)
    return (gate.to(xf.dtype) * xf[..., inter:]).to(x.dtype)


def moe_route(router_logits, top_k, renormalize):
    """Softmax over the experts (float32, float64 for float64 logits), the top_k largest (ties to the
    lower expert: a stable sort), divided by their sum if renormalize; (weights, ids int32) [T, top_k]."""
    probs = torch.softmax(router_logits.to(_compute_dtype(router_logits.dtype)), dim=-1)
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe(x, w13, w2, topk_weights, topk_ids, *, real_tokens=None):
    """Qwen3-MoE experts, a loop over them: y[t] = sum_j topk_weights[t, j] * w2[e] @ act(w13[e] @ x[t])
    for e = topk_ids[t, j], act = silu_and_mul (gate/up rounded to x.dtype first); the down product
    and weight in float32 (float64 for float64 x), each weighted term rounded to x.dtype, the sum in
    float32, rounded once. Every row, also those past real_tokens (padding, whose rows are free)."""
    dtype = _compute_dtype(x.dtype)
    y = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for expert in topk_ids.unique().tolist():
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = (x[tokens].to(dtype) @ w13[expert].to(dtype).T).to(x.dtype)
        down = silu_and_mul(gate_up).to(dtype) @ w2[expert].to(dtype).T
        y.index_add_(0, tokens, (down * topk_weights[tokens, slots, None].to(dtype)).to(x.dtype).to(dtype))
    return y.to(x.dtype)


def gather_kv(cache, block_table, length):
    """The first `length` rows [length, Hkv, D] of a sequence from a paged cache."""
    block_size = cache.shape[1]
    blocks = block_table[: (length + block_size - 1) // block_size].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]


def prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale=None, *, max_q_len=None,
                      k_scale=None, v_scale=None):
    """Causal attention of the new tokens q [T, Hq, D] over the paged cache; returns o [T, Hq, D].

    Query i of sequence b sits at position seq_lens[b] - q_len_b + i and sees keys at or before it.
    max_q_len: the kernel's grid hint, unused here. An e4m3 cache is read as cache_row * scale.
    """
    fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    group = q.shape[1] // k_cache.shape[2]
    dtype = _compute_dtype(q.dtype)
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        k = gather_kv(k_cache, block_tables[b], length).to(dtype)
        v = gather_kv(v_cache, block_tables[b], length).to(dtype)
        if fp8:
            k = k * gather_kv(k_scale, block_tables[b], length)[..., None].to(dtype)
            v = v * gather_kv(v_scale, block_tables[b], length)[..., None].to(dtype)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].to(dtype), k) * scale
        q_pos = torch.arange(length - (end - start), length, device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale=None, *, max_seq_len=None,
                     k_scale=None, v_scale=None):
    """One new token per sequence, q [B, Hq, D], attending to keys [0, seq_lens[b]). max_seq_len only
    steers the Triton kernel's split count: the reference takes and ignores it.

    Batched over the sequences (no host sync, so the engine can run it every step): every
    sequence's blocks are gathered up to the table width, keys past its length are masked. A row
    with seq_lens 0 gives zeros. An e4m3 cache is read as cache_row * scale.
    """
    fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    dtype = _compute_dtype(q.dtype)
    blocks = block_tables.long()
    k = k_cache[blocks].flatten(1, 2).to(dtype)  # [B, L, Hkv, D]
    v = v_cache[blocks].flatten(1, 2).to(dtype)
    if fp8:
        k = k * k_scale[blocks].flatten(1, 2)[..., None].to(dtype)
        v = v * v_scale[blocks].flatten(1, 2)[..., None].to(dtype)
    visible = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    # Slots past a sequence's length may hold anything, NaN included: mask them out of both products.
    k = torch.where(visible[:, :, None, None], k, 0.0)
    v = torch.where(visible[:, :, None, None], v, 0.0)
    qg = q.to(dtype).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    probs = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(dim=-1)
    probs = probs.masked_fill(~visible[:, None, None, :], 0.0)  # all-masked rows: NaN -> 0
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def sampling_probs(logits, temperature, top_k, top_p, min_p):
    """The exact distribution `sample` draws from, [B, V] float64, zero outside the allowed set.

    NaN logits count as -inf. Rows with a temperature below MIN_TEMPERATURE (1e-5) put all mass on
    the argmax (lowest index on ties), and so do rows holding +inf (their mass sits on the +inf
    logits; the first wins, as greedy) and all -inf rows (token 0). The filters are
    thresholds: top-k keeps tokens at or above the k-th largest probability; top-p keeps, on the
    top-k set renormalized, tokens at or above the probability where the most-likely-first
    cumulative mass reaches top_p; min-p keeps tokens with p >= min(min_p, 1) * p_max.
    """
    batch, vocab = logits.shape
    out = torch.zeros(batch, vocab, dtype=torch.float64, device=logits.device)
    for b in range(batch):
        row = logits[b].double()
        row = row.masked_fill(row.isnan(), float("-inf"))
        t = float(temperature[b])
        greedy = bool(temperature[b].float() < MIN_TEMPERATURE)  # in float32, as the kernel and sample compare
        if greedy or bool((row == float("inf")).any()) or bool((row == float("-inf")).all()):
            out[b, int(torch.argmax(row))] = 1.0
            continue
        probs = torch.softmax(row / t, dim=-1)
        ordered = probs.sort(descending=True).values
        keep = torch.ones(vocab, dtype=torch.bool, device=logits.device)
        k = int(top_k[b])
        if 0 < k < vocab:
            keep &= probs >= ordered[k - 1]
        p = float(top_p[b])
        if p < 1:
            kept = ordered[: int(keep.sum())]
            cumulative = (kept / kept.sum()).cumsum(0)
            last = min(int((cumulative < p).sum()), len(kept) - 1)
            keep &= probs >= kept[last]
        keep &= probs >= min(float(min_p[b]), 1.0) * ordered[0]  # min_p past 1 keeps the top tokens
        masked = torch.where(keep, probs, torch.zeros_like(probs))
        out[b] = masked / masked.sum()
    return out


def _uniforms(seeds, batch, device):
    """One U[0, 1) a row: torch.rand, or from a generator seeded with the row's own seed."""
    if seeds is None:
        return torch.rand(batch, dtype=torch.float64, device=device)
    generator = torch.Generator()  # on the CPU: one host read of the seeds, one copy of the draws
    draws = [torch.rand(1, dtype=torch.float64, generator=generator.manual_seed(seed)).item() for seed in seeds.tolist()]
    return torch.tensor(draws, dtype=torch.float64, device=device)


def sample(logits, temperature, top_k, top_p, min_p, seeds=None):
    """Sort-based sampler with sampling_probs' semantics, vectorized over rows (the benchmark baseline).

    One stable sort of each row's probabilities, thresholds from a cumsum, then inverse-CDF sampling
    on the kept mass with one uniform a row. seeds: when given, each row's uniform comes from its
    own seed (one host read), so a row's token depends only on its logits, parameters and seed,
    never on the rest of the batch, as with the kernel (whose draws differ: it races Gumbel noise).
    """
    batch, vocab = logits.shape
    x = logits.to(_compute_dtype(logits.dtype))
    x = x.masked_fill(x.isnan(), float("-inf"))
    has_inf = (x == float("inf")).any(-1)
    no_mass = has_inf | (x == float("-inf")).all(-1)
    # A row holding +inf returns its first +inf logit, an all -inf row token 0: both argmax.
    greedy = (temperature.float() < MIN_TEMPERATURE) | no_mass  # in float32, as the kernel compares
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(x.dtype)
    finite = x.masked_fill(no_mass[:, None], 0.0)  # keeps softmax a number on those rows (unused there)
    probs, order = torch.softmax(finite / t[:, None], dim=-1).sort(dim=-1, descending=True, stable=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab)).long()
    keep = probs >= probs.gather(1, k[:, None] - 1)  # a prefix of the sorted row (ties included)
    kept = probs * keep
    cumulative = kept.cumsum(-1) / kept.sum(-1, keepdim=True)
    below = ((cumulative < top_p[:, None]) & keep).sum(-1)
    last = torch.minimum(below, keep.sum(-1) - 1)
    p_threshold = torch.where(top_p < 1, probs.gather(1, last[:, None])[:, 0], torch.zeros_like(probs[:, 0]))
    threshold = torch.maximum(p_threshold, min_p.to(probs.dtype).clamp(max=1) * probs[:, 0])
    keep &= probs >= threshold[:, None]
    mass = (probs * keep).cumsum(-1)
    target = _uniforms(seeds, batch, x.device).to(mass.dtype) * mass[:, -1]
    picked = torch.searchsorted(mass, target[:, None], right=True)
    picked = torch.minimum(picked, keep.sum(-1, keepdim=True) - 1)  # a target rounded up to the total
    ids = order.gather(1, picked)[:, 0]
    return torch.where(greedy, torch.argmax(x, dim=-1), ids)


def compute_logprobs(logits, token_ids):
    """log_softmax(logits)[b, token_ids[b]] in float32 (float64 for float64 logits), [B]."""
    logprobs = torch.log_softmax(logits.to(_compute_dtype(logits.dtype)), dim=-1)
    return logprobs.gather(1, token_ids.long()[:, None])[:, 0]


def compute_top_logprobs(logits, k):
    """(values [B, k], ids [B, k] int64): the k largest log_softmax entries of each row, descending,
    ties to the lower id (a stable sort); NaN counts as -inf, -inf logits give -inf."""
    x = logits.to(_compute_dtype(logits.dtype))
    x = x.masked_fill(x.isnan(), float("-inf"))
    top = x.sort(dim=-1, descending=True, stable=True)
    values = top.values[:, :k] - torch.logsumexp(x, dim=-1, keepdim=True)
    return values.masked_fill(top.values[:, :k] == float("-inf"), float("-inf")), top.indices[:, :k]


def apply_penalties(logits, counts, prompt_mask, rows, presence, frequency, repetition):
    """In place on logits [B, V], rows b with r = rows[b] >= 0: with c = counts[r], a token seen
    (c > 0 or prompt_mask[r]) has a positive logit divided by repetition[b], another multiplied;
    then x -= frequency[b] * c + presence[b] * (c > 0). Returns logits."""
    dtype = _compute_dtype(logits.dtype)
    slot = rows.long().clamp(min=0)
    c = counts[slot].to(dtype)
    rep = repetition.to(dtype)[:, None]
    x = logits.to(dtype)
    x = torch.where((c > 0) | (prompt_mask[slot] != 0), torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency.to(dtype)[:, None] * c - presence.to(dtype)[:, None] * (c > 0)
    return logits.copy_(torch.where((rows >= 0)[:, None], x.to(logits.dtype), logits))


def count_tokens(counts, rows, token_ids):
    """In place: counts[rows[i], token_ids[i]] += 1 (int32 counts) or = 1 (a uint8 mask), rows[i] >= 0."""
    keep = rows >= 0
    index = (rows[keep].long(), token_ids[keep].long())
    if counts.dtype == torch.uint8:
        counts[index] = 1
    else:
        counts.index_put_(index, torch.ones_like(index[0], dtype=counts.dtype), accumulate=True)
