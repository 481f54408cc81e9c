"""Benchmark cases of bench/kernels.py: shapes, inputs, bytes or FLOPs, and the anchors of each kernel."""
from dataclasses import dataclass, field
from typing import Callable

import torch

from tritonllm import kernels
from tritonllm.kernels import reference
from tritonllm.kernels.fp8 import empty_kv_scales, head_major_copy
from tritonllm.kernels.kv_cache import empty_kv_cache, key_major_copy
from tritonllm.layers import rotary


@dataclass
class Case:
    kernel: str  # the Tunable's name
    label: str
    make: Callable[[], tuple]  # fresh random inputs
    triton: Callable  # the Triton wrapper, called on make()'s inputs
    anchors: dict[str, Callable] = field(default_factory=dict)  # timed on the same inputs
    bytes: int = 0  # fewest bytes the call must move (memory-bound kernels)
    flops: int = 0  # or its FLOPs (compute-bound kernels)
    graph: bool = False  # microsecond kernels: timed as CUDA-graph replays over rotated inputs
    eager_anchors: tuple = ()  # anchors that cannot be captured (host syncs), timed with do_bench


def reference_anchors(fn) -> dict[str, Callable]:
    """The PyTorch reference eager and under torch.compile."""
    return {"torch": fn, "torch.compile": torch.compile(fn, dynamic=False)}


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def cos_sin_cache(max_pos, head_dim):
    return rotary.cos_sin_cache(head_dim, max_pos, 1e6).cuda()


def norm_cases(quick):
    shapes = [(16384, 4096)] if quick else [(16384, 4096), (16384, 1024), (1024, 4096), (16384 * 16, 128)]
    cases = []
    for tokens, hidden in shapes:
        size = tokens * hidden * 2
        cases.append(Case(
            "fused_add_rms_norm", f"{tokens}x{hidden} bf16",
            lambda t=tokens, h=hidden: (randn(t, h), randn(t, h), randn(h), 1e-6),
            kernels.fused_add_rms_norm, reference_anchors(reference.fused_add_rms_norm), bytes=4 * size,
        ))
        cases.append(Case(
            "rms_norm", f"{tokens}x{hidden} bf16",
            lambda t=tokens, h=hidden: (randn(t, h), randn(h), 1e-6),
            kernels.rms_norm, reference_anchors(reference.rms_norm), bytes=2 * size,
        ))
    return cases


def silu_and_mul_cases(quick):
    shapes = [(16384, 3072)] if quick else [(16384, 3072), (8192, 12288), (256, 3072)]
    return [
        Case("silu_and_mul", f"{tokens}x2*{inter} bf16", lambda t=tokens, i=inter: (randn(t, 2 * i),),
             kernels.silu_and_mul, reference_anchors(reference.silu_and_mul), bytes=3 * tokens * inter * 2)
        for tokens, inter in shapes
    ]


def rotary_cases(quick):
    shapes = [(16384, 16, 8)] if quick else [(16384, 16, 8), (8192, 32, 8), (256, 16, 8)]
    cases = []
    for tokens, q_heads, k_heads in shapes:
        def make(t=tokens, hq=q_heads, hk=k_heads):
            positions = torch.randint(0, 40960, (t,), device="cuda")
            return positions, randn(t, hq, 128), randn(t, hk, 128), cos_sin_cache(40960, 128)

        moved = 2 * tokens * (q_heads + k_heads) * 128 * 2 + tokens * 128 * 4
        cases.append(Case("rotary_embedding", f"{tokens} tok {q_heads}/{k_heads} heads D128 bf16", make,
                          kernels.rotary_embedding, reference_anchors(reference.rotary_embedding), bytes=moved))
    return cases


def fp8_caches(make, first):
    """make() with its two caches (at positions first, first + 1) swapped for e4m3 caches of the same
    shape in the engine's layouts (V key-major, head-major scales), and k_scale, v_scale for them
    appended (the bench passes arguments by position)."""
    def make_fp8():
        args = list(make())
        shape = args[first].shape
        args[first:first + 2] = [empty_kv_cache(*shape, torch.float8_e4m3fn, "cuda", key_major=major)
                                 for major in (False, True)]
        return (*args, *(empty_kv_scales(*shape[:3], "cuda", head_major=True) for _ in range(2)))
    return make_fp8


def with_scales(fn):
    """fn taking its last two positional arguments as k_scale, v_scale (fp8_caches's inputs)."""
    return lambda *args: fn(*args[:-2], k_scale=args[-2], v_scale=args[-1])


def with_plain_v(fn):
    """fn with a contiguous e4m3 V cache in place of the key-major one at position 7 (fp8_caches's
    inputs of qk_norm_rotary_store): what writing V key-major costs the store. Each input set's V
    cache gets its own plain one, so the anchor's writes rotate through memory as ours do."""
    held = {}

    def run(*args):
        v_cache = args[7]
        key = (v_cache.data_ptr(), tuple(v_cache.shape), v_cache.device)
        if key not in held:
            held[key] = torch.empty(v_cache.shape, dtype=v_cache.dtype, device=v_cache.device)
        return fn(*args[:7], held[key], *args[8:])
    return run


def contiguous_copy(k, v, k_cache, v_cache, slots):
    k_cache.view(-1, *k.shape[1:])[:len(k)].copy_(k)
    v_cache.view(-1, *v.shape[1:])[:len(v)].copy_(v)


def kv_cache_cases(quick):
    """Random slots (as after preemptions and frees) and, once, consecutive slots (a fresh cache):
    the two separate the cost of scattered 2 KiB rows from the kernel's own. The "copy" anchor moves
    the same K/V bytes with two contiguous torch copies: the copy bandwidth at this size."""
    shapes = [(16384, 16, False)] if quick else [(16384, 16, False), (16384, 16, True), (16384, 256, False),
                                                 (256, 16, False)]
    cases = []
    for tokens, block_size, consecutive in shapes:
        def make(t=tokens, bs=block_size, c=consecutive):
            num_blocks = 2 * t // bs + 1
            slots = torch.arange(t, device="cuda") if c else torch.randperm(num_blocks * bs, device="cuda")[:t]
            cache = lambda: randn(num_blocks, bs, 8, 128)  # noqa: E731
            return randn(t, 8, 128), randn(t, 8, 128), cache(), cache(), slots

        pattern = "consecutive" if consecutive else "random"
        cases.append(Case("store_kv_cache", f"{tokens} tok 8x128 block {block_size} {pattern} slots bf16", make,
                          kernels.store_kv_cache, {"torch": reference.store_kv_cache, "copy": contiguous_copy},
                          bytes=4 * tokens * 8 * 128 * 2 + tokens * 8))
        # The same rows into e4m3 caches: bf16 read, e4m3 and a float32 scale a row written.
        cases.append(Case("store_kv_cache", f"{tokens} tok 8x128 block {block_size} {pattern} slots bf16 to fp8",
                          fp8_caches(make, 2), with_scales(kernels.store_kv_cache),
                          {"torch": with_scales(reference.store_kv_cache)},
                          bytes=tokens * 8 * 128 * (2 * 2 + 2) + tokens * 8 * 2 * 4 + tokens * 8))
    return cases


def store_slots(tokens, num_blocks, block_size):
    """Cache slots for a store of `tokens` rows: from 1024 tokens on a prefill's, whole shuffled blocks
    filled in order (a key-major V then gets runs of adjacent bytes); below, decode's, one slot a
    sequence anywhere in the cache."""
    if tokens >= 1024:
        blocks = torch.randperm(num_blocks, device="cuda")[:tokens // block_size]
        return (blocks[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()
    return torch.randperm(num_blocks * block_size, device="cuda")[:tokens]


def qk_norm_rotary_cases(quick):
    """Fused q/k RMSNorm + rotary + KV store on a packed bf16 qkv (16/8 heads, D 128, block 16).

    Bytes: q, k, v read, q written, k and v written into the cache, cos/sin rows, positions and
    slots. Anchors: the three separate Triton kernels as the model calls them (rms_norm on q and
    on k, rotary_embedding, store_kv_cache) and the PyTorch reference (eager: it syncs on the
    slot mask). Decode-sized cases are timed as CUDA-graph replays. Prefill-sized cases fill
    shuffled blocks in order, as a prefill does (a key-major V then gets runs of adjacent bytes).
    """
    shapes = [(16384, 16, 8)] if quick else [(16384, 16, 8), (8192, 32, 8), (256, 16, 8), (64, 16, 8)]
    cases = []
    for tokens, q_heads, kv_heads in shapes:
        def make(t=tokens, hq=q_heads, hk=kv_heads, bs=16):
            num_blocks = 2 * t // bs + 1
            positions = torch.randint(0, 40960, (t,), device="cuda")
            slots = store_slots(t, num_blocks, bs)
            cache = lambda: randn(num_blocks, bs, hk, 128)  # noqa: E731
            return (positions, randn(t, (hq + 2 * hk) * 128), randn(128), randn(128), 1e-6, cos_sin_cache(40960, 128),
                    cache(), cache(), slots, hq, hk)

        def separate(positions, qkv, q_weight, k_weight, eps, cos_sin, k_cache, v_cache, slots, hq, hk):
            q, k, v = qkv.split([hq * 128, hk * 128, hk * 128], dim=-1)
            q = kernels.rms_norm(q.view(-1, hq, 128), q_weight, eps)
            k = kernels.rms_norm(k.view(-1, hk, 128), k_weight, eps)
            q, k = kernels.rotary_embedding(positions, q, k, cos_sin)
            kernels.store_kv_cache(k, v.view(-1, hk, 128), k_cache, v_cache, slots)
            return q

        moved = tokens * (q_heads + 2 * kv_heads) * 128 * 2 * 2 + tokens * 128 * 4 + tokens * 8 * 2
        cases.append(Case("qk_norm_rotary_store", f"{tokens} tok {q_heads}/{kv_heads} heads D128 block 16 bf16", make,
                          kernels.qk_norm_rotary_store,
                          {"3 triton kernels": separate, "torch": reference.qk_norm_rotary_store}, bytes=moved,
                          graph=tokens <= 1024, eager_anchors=("torch",)))
        fp8_moved = (tokens * (2 * q_heads + 2 * kv_heads) * 128 * 2 + tokens * kv_heads * 2 * (128 + 4)
                     + tokens * 128 * 4 + tokens * 8 * 2)
        cases.append(Case("qk_norm_rotary_store", f"{tokens} tok {q_heads}/{kv_heads} heads D128 block 16 bf16 to fp8",
                          fp8_caches(make, 6), with_scales(kernels.qk_norm_rotary_store),
                          {"torch": with_scales(reference.qk_norm_rotary_store),
                           "triton, V not key-major": with_plain_v(with_scales(kernels.qk_norm_rotary_store))},
                          bytes=fp8_moved,
                          graph=tokens <= 1024, eager_anchors=("torch",)))
    return cases


def paged_cache(tokens_per_seq, batch, block_size, num_kv_heads=8, head_dim=128):
    """Random bf16 K/V caches holding `batch` sequences in shuffled blocks, and their block tables."""
    per_seq = -(-tokens_per_seq // block_size)
    tables = torch.randperm(batch * per_seq, device="cuda", dtype=torch.int32).view(batch, per_seq)
    shape = (batch * per_seq, block_size, num_kv_heads, head_dim)
    return randn(*shape), randn(*shape), tables


def dense(cache, tables, length):
    """[B, H, length, D] contiguous copy of the paged sequences (for the dense anchors)."""
    return cache[tables.long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()


def sdpa(backend, **kwargs):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    return run


def decode_attention_cases(quick):
    """Decode over a paged bf16 cache (block 16, 16 q / 8 kv heads, D 128), CUDA-graph replay.

    Bytes: the K and V of every context token (4 KiB a token); % is of the copy ceiling
    (bench/timing.py). The SDPA flash anchor reads contiguous KV with GQA, timed the same way.
    """
    from torch.nn.attention import SDPBackend

    if quick:
        shapes = [(1, 4096, 16), (1, 32768, 16), (32, 4096, 16), (8, 32768, 16)]
    else:
        shapes = [(b, c, 16) for b in (1, 8, 32, 128, 256) for c in (1024, 4096, 16384, 32768) if b * c <= 2**22]
        shapes.append((32, 4096, 256))
    cases = []
    for batch, context, block_size in shapes:
        def make(b=batch, c=context, bs=block_size):
            k_cache, v_cache, tables = paged_cache(c, b, bs)
            q = randn(b, 16, 128)
            seq_lens = torch.full((b,), c, device="cuda", dtype=torch.int32)
            k, v = dense(k_cache, tables, c), dense(v_cache, tables, c)
            return q, k_cache, v_cache, seq_lens, tables, q[:, :, None], k, v

        flash = sdpa(SDPBackend.FLASH_ATTENTION, enable_gqa=True)
        cases.append(Case(
            "decode_attention", f"B{batch} x {context} 16/8 heads D128 block {block_size} bf16", make,
            lambda *a: kernels.decode_attention(*a[:5]),
            {"sdpa flash (contiguous)": lambda *a, f=flash: f(*a[5:8])},
            bytes=batch * context * 8 * 128 * 2 * 2, graph=True,
        ))
    # Over an e4m3 cache (kv_cache_dtype="fp8"): K/V at a byte an element plus two float32 scales a
    # (token, KV head), 2112 B a token; the anchor is this kernel on the bf16 cache quantized.
    for batch, context, block_size in shapes:
        def make(b=batch, c=context, bs=block_size):
            k_cache, v_cache, tables = paged_cache(c, b, bs)
            (k8, k_scale), (v8, v_scale) = reference.quantize_e4m3(k_cache), reference.quantize_e4m3(v_cache)
            v8 = key_major_copy(v8)  # as the engine keeps an e4m3 V, and its scales
            k_scale, v_scale = head_major_copy(k_scale), head_major_copy(v_scale)
            seq_lens = torch.full((b,), c, device="cuda", dtype=torch.int32)
            return randn(b, 16, 128), k8, v8, seq_lens, tables, k_scale, v_scale, k_cache, v_cache

        cases.append(Case(
            "decode_attention", f"B{batch} x {context} 16/8 heads D128 block {block_size} bf16, fp8 cache", make,
            lambda *a: kernels.decode_attention(*a[:5], k_scale=a[5], v_scale=a[6]),
            {"triton bf16 cache": lambda *a: kernels.decode_attention(a[0], a[7], a[8], *a[3:5])},
            bytes=batch * context * 8 * (128 * 2 + 2 * 4), graph=True,
        ))
    # What the row order inside a block costs e4m3 reads: each head's keys together (head-major: a
    # head's K is one 2 KiB run of a block) against the engine's token-major rows (128 bytes of a
    # head every 1 KiB), V in K's layout in both (not key-major), the same kernel and config.
    for batch, context in ((32, 4096), (32, 16384), (128, 4096), (256, 1024)):
        def make(b=batch, c=context):
            k_cache, v_cache, tables = paged_cache(c, b, 16)
            (k8, k_scale), (v8, v_scale) = reference.quantize_e4m3(k_cache), reference.quantize_e4m3(v_cache)
            scales = head_major_copy(k_scale), head_major_copy(v_scale)
            seq_lens = torch.full((b,), c, device="cuda", dtype=torch.int32)
            return randn(b, 16, 128), head_major_rows(k8), head_major_rows(v8), seq_lens, tables, *scales, k8, v8

        cases.append(Case(
            "decode_attention", f"B{batch} x {context} 16/8 heads D128 block 16 bf16, e4m3 K/V head-major in the block",
            make, lambda *a: kernels.decode_attention(*a[:5], k_scale=a[5], v_scale=a[6]),
            {"K/V token-major": lambda *a: kernels.decode_attention(a[0], a[7], a[8], *a[3:5], k_scale=a[5],
                                                                    v_scale=a[6])},
            bytes=batch * context * 8 * (128 * 2 + 2 * 4), graph=True,
        ))
    return cases


def head_major_rows(cache):
    """A copy of a [num_blocks, block_size, Hkv, D] cache laid out [num_blocks, Hkv, block_size, D]
    in memory (the same values through permuted strides)."""
    blocks, block_size, heads, dim = cache.shape
    return cache.new_empty((blocks, heads, block_size, dim)).permute(0, 2, 1, 3).copy_(cache)


def sampler_logits(batch, vocab, dist):
    """float32 logits: 'peaked' like a trained LM head (a few dozen tokens 5-15 above a N(0, 2)
    bulk), or 'flat' (N(0, 0.5): top-p keeps a large part of the vocabulary)."""
    if dist == "flat":
        return 0.5 * randn(batch, vocab, dtype=torch.float32)
    logits = 2 * randn(batch, vocab, dtype=torch.float32)
    top = torch.randint(0, vocab, (batch, 32), device="cuda")
    return logits.scatter_add_(1, top, 5 + 10 * torch.rand(batch, 32, device="cuda"))


def sampler_cases(quick):
    """sample (CUDA-graph replay; seeds None: drawn on the device) and compute_logprobs, V = 151936.

    Bytes: one read of the logits (the kernel reads filtered rows twice). Anchors: the sort-based
    torch reference (graph-timed as ours, and eager) and, for greedy rows, torch.argmax.
    """
    vocab = 151936
    modes = {  # temperature, top_k, top_p, min_p; the first mode tunes each batch bucket: the hardest common one
        "top-k 50 + top-p 0.9 + min-p 0.05": (0.8, 50, 0.9, 0.05),
        "greedy": (0.0, 0, 1.0, 0.0),
        "temperature": (0.8, 0, 1.0, 0.0),
        "top-p 0.95 alone": (0.8, 0, 0.95, 0.0),
    }
    if quick:
        shapes = [(256, "top-k 50 + top-p 0.9 + min-p 0.05", dist) for dist in ("peaked", "flat")]
    else:
        shapes = [(b, mode, dist) for b in (1, 32, 256) for mode in modes for dist in ("peaked", "flat")]
    cases = []
    for batch, mode, dist in shapes:
        def make(b=batch, d=dist, m=mode):
            row = [torch.full((b,), v, device="cuda") for v in modes[m]]
            return sampler_logits(b, vocab, d), row[0], row[1].long(), row[2], row[3]

        # The sort sampler captured as ours is (its device time), and launched eagerly (with its ~35 launches).
        anchors = {"torch sort": reference.sample, "torch sort, eager": reference.sample}
        if mode == "greedy":
            anchors["torch.argmax"] = lambda logits, *rest: torch.argmax(logits, dim=-1)
        cases.append(Case("sample", f"B{batch} x {vocab} fp32 {mode}, {dist}", make, kernels.sample,
                          anchors, bytes=batch * vocab * 4, graph=True, eager_anchors=("torch sort, eager",)))
    fp32, bf16 = torch.float32, torch.bfloat16
    for batch, dtype in [(256, fp32)] if quick else [(1, fp32), (256, fp32), (256, bf16)]:
        cases.append(Case(
            "compute_logprobs", f"B{batch} x {vocab} {str(dtype)[6:]}",
            lambda b=batch, d=dtype: (randn(b, vocab, dtype=d), torch.randint(0, vocab, (b,), device="cuda")),
            kernels.compute_logprobs, reference_anchors(reference.compute_logprobs),
            bytes=batch * vocab * dtype.itemsize,
        ))
    return cases


def all_cases(quick: bool) -> list[Case]:
    cases = norm_cases(quick) + silu_and_mul_cases(quick) + rotary_cases(quick) + kv_cache_cases(quick)
    cases += qk_norm_rotary_cases(quick)
    return cases + decode_attention_cases(quick) + sampler_cases(quick)
