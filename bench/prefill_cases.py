"""Prefill-attention benchmark cases of bench/kernels.py (issue 21): causal, 16 q / 8 kv heads, D 128,
bf16, 16k new tokens a call, K/V read from shuffled cache blocks.

- "prefill_attention_hopper": the path prefill_attention takes on an H200 (the warp-specialized
  Gluon kernel), at S = 512 .. 16k (B = 16k / S), blocks of 16 (the engine's default) and 256 (32,
  64 and 128 at S 1k and 4k); a varlen batch of the nano-vllm workload's prompt lengths (uniform in
  100..1024); prefix hits (512 new tokens over 4096 cached, B 32). Anchors: the portable Triton
  kernel (shipped configs), SDPA cuDNN and flash and varlen_attn on contiguous K/V (expanded to 16
  heads: cuDNN has no GQA). Timed as CUDA-graph replays, varlen_attn eagerly.
- "prefill_attention": the portable kernel itself (path="portable"), bf16 and over an e4m3 cache.
- "prologue + attention" (kernel prefill_attention_hopper): one attention layer's whole prefill step
  over an e4m3 cache as the engine runs it (store, copies, Hopper kernel), against the same step over
  the bf16 cache.

TFLOP/s counts the causal part only: 2 * 2 * Hq * D * (keys each query sees, summed).
"""
import random

import torch
from torch.nn.attention import SDPBackend

from kernel_cases import Case, cos_sin_cache, dense, paged_cache, randn, sdpa
from tritonllm import kernels
from tritonllm.kernels import reference
from tritonllm.kernels.fp8 import head_major_copy
from tritonllm.kernels.kv_cache import key_major_copy

SEQS = (512, 1024, 2048, 4096, 16384)
TOKENS = 16384


def varlen_causal(q, k, v, cu_q, cu_k, max_q, max_k):
    import inspect

    from torch.nn.attention.varlen import varlen_attn
    # torch 2.11 takes is_causal; later versions a (left, right) window. Causal is bottom-right aligned.
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **causal)


def workload_lengths(total=TOKENS, seed=0):
    """Prompt lengths drawn like the nano-vllm benchmark's (uniform in 100..1024), summing to `total`."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(100, 1024), total - sum(lengths)))
    return lengths


def batch_inputs(q_lens, context, block_size):
    """Paged caches, q and the metadata of sequences of `context` cached + q_lens new tokens, and the
    packed contiguous K/V ([tokens, 16 heads, D]) with their cu_seqlens for the varlen anchor."""
    batch, longest = len(q_lens), context + max(q_lens)
    k_cache, v_cache, tables = paged_cache(longest, batch, block_size)
    q = randn(sum(q_lens), 16, 128)
    lens = torch.tensor(q_lens, device="cuda", dtype=torch.int32)
    cu_q = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    seq_lens = lens + context
    cu_k = torch.nn.functional.pad(seq_lens.cumsum(0), (1, 0)).to(torch.int32)
    k_dense, v_dense = (dense(c, tables, longest).repeat_interleave(2, dim=1) for c in (k_cache, v_cache))
    k_packed = torch.cat([k_dense[b, :, :n].transpose(0, 1) for b, n in enumerate(seq_lens.tolist())])
    v_packed = torch.cat([v_dense[b, :, :n].transpose(0, 1) for b, n in enumerate(seq_lens.tolist())])
    return q, k_cache, v_cache, cu_q, seq_lens, tables, max(q_lens), k_dense, v_dense, k_packed, v_packed, cu_k, longest


def causal_flops(q_lens, context):
    return 4 * 16 * 128 * sum(n * context + n * (n + 1) // 2 for n in q_lens)


def ours(path=None):
    extra = {} if path is None else {"path": path}
    return lambda *a: kernels.prefill_attention(*a[:6], max_q_len=a[6], **extra)


def anchors(equal_lengths):
    """Anchors on batch_inputs' arguments; the dense SDPA ones only where all sequences are equal and
    nothing is cached (SDPA's causal mask is top-left aligned)."""
    out = {"triton portable": ours("portable"),
           "varlen_attn": lambda *a: varlen_causal(a[0], a[9], a[10], a[3], a[11], a[6], a[12])}
    if equal_lengths:
        def dense_q(q, b):
            return q.view(b, -1, 16, 128).transpose(1, 2)

        flash = sdpa(SDPBackend.FLASH_ATTENTION, is_causal=True)
        cudnn = sdpa(SDPBackend.CUDNN_ATTENTION, is_causal=True)
        out["sdpa flash"] = lambda *a, f=flash: f(dense_q(a[0], a[7].shape[0]), a[7], a[8])
        out["sdpa cudnn"] = lambda *a, f=cudnn: f(dense_q(a[0], a[7].shape[0]), a[7], a[8])
    return out


def cache_bytes(q_lens, context):
    """Bytes of one input set (K/V caches, q and o) at 8 KV heads, D 128, bf16: sizes the rotation of
    CUDA-graph timing (a set past L2 needs no other)."""
    return sum(n + context for n in q_lens) * 8 * 128 * 2 * 2 + sum(q_lens) * 16 * 128 * 2 * 2


def hopper_case(label, make, q_lens, context):
    # CUDA-graph timing: the Hopper wrapper's host time (descriptors, the Gluon launch) exceeds a
    # short prefill's GPU time, which do_bench would then measure instead. varlen_attn stays eager.
    return Case("prefill_attention_hopper", label, make, ours(), anchors(context == 0 and len(set(q_lens)) == 1),
                bytes=cache_bytes(q_lens, context), flops=causal_flops(q_lens, context), graph=True,
                eager_anchors=("varlen_attn",))


def hopper_cases(quick):
    if quick:
        shapes = [(4096, 16)]
    else:  # blocks 16 and 256 at every length, the other block sizes at two
        shapes = [(s, bs) for bs in (16, 256) for s in SEQS] + [(s, bs) for bs in (32, 64, 128) for s in (1024, 4096)]
    cases = []
    for seq, block_size in shapes:
        q_lens = [seq] * (TOKENS // seq)
        cases.append(hopper_case(f"B{len(q_lens)} x S{seq} causal 16/8 heads D128 block {block_size} bf16",
                                 lambda n=q_lens, bs=block_size: batch_inputs(n, 0, bs), q_lens, 0))
    if not quick:
        lengths, prefix = workload_lengths(), [512] * 32
        cases.append(hopper_case(f"varlen {len(lengths)} prompts 100..1024 (16k tokens) block 16 bf16",
                                 lambda: batch_inputs(lengths, 0, 16), lengths, 0))
        cases.append(hopper_case("B32 x 512 new over 4096 cached causal block 16 bf16",
                                 lambda: batch_inputs(prefix, 4096, 16), prefix, 4096))
    return cases


def fp8_inputs(q_lens, block_size, max_q_len):
    """batch_inputs' q, e4m3 caches (key-major V, head-major scales: the engine's layouts) and metadata,
    then the scales and the bf16 caches they were quantized from."""
    q, k_cache, v_cache, cu, seq_lens, tables = batch_inputs(q_lens, 0, block_size)[:6]
    (k8, k_scale), (v8, v_scale) = reference.quantize_e4m3(k_cache), reference.quantize_e4m3(v_cache)
    k_scale, v_scale = head_major_copy(k_scale), head_major_copy(v_scale)
    return q, k8, key_major_copy(v8), cu, seq_lens, tables, max_q_len, k_scale, v_scale, k_cache, v_cache


def fp8_in_place_case(label, q_lens, block_size, max_q_len, graph=False):
    """The portable kernel reading an e4m3 cache in place; anchor: the bf16 cache it was quantized from,
    through the same kernel. graph: timed as graph replays, as the engine's prefill graphs run it."""
    return Case(
        "prefill_attention", f"{label}, fp8 cache", lambda: fp8_inputs(q_lens, block_size, max_q_len),
        lambda *a: kernels.prefill_attention(*a[:6], max_q_len=a[6], k_scale=a[7], v_scale=a[8]),
        {"triton bf16 cache": lambda *a: kernels.prefill_attention(a[0], a[9], a[10], *a[3:6], max_q_len=a[6],
                                                                   path="portable")},
        bytes=cache_bytes(q_lens, 0), flops=causal_flops(q_lens, 0), graph=graph)


def portable_cases(quick):
    """The portable kernel, bf16 (its tuned buckets) and over an e4m3 cache. The engine reads an e4m3
    cache in place only in its prefill graphs (up to 2048 new tokens in up to 8 sequences, max_q_len
    the graph's token count; larger steps run the Hopper kernel on block copies), so two such shapes
    come first: they tune the block-16 e4m3 bucket."""
    cases = [fp8_in_place_case(f"{label} in a 2048-token graph, causal 16/8 heads D128 block 16 bf16", q_lens, 16,
                               2048, graph=True) for label, q_lens in (("B1 x 2000", [2000]), ("B8 x 250", [250] * 8))]
    shapes = [(4096, 256)] if quick else [(1024, 256), (4096, 256), (16384, 256), (1024, 16), (4096, 16)]
    for seq, block_size in shapes:
        q_lens = [seq] * (TOKENS // seq)
        label = f"B{len(q_lens)} x S{seq} causal 16/8 heads D128 block {block_size} bf16"
        cases.append(Case("prefill_attention", label,
                          lambda n=q_lens, bs=block_size: batch_inputs(n, 0, bs), ours("portable"),
                          flops=causal_flops(q_lens, 0)))
        cases.append(fp8_in_place_case(label, q_lens, block_size, seq))

        def make_copies(n=q_lens, bs=block_size):
            args = fp8_inputs(n, bs, n[0])
            tables = args[5]
            copies = torch.arange(tables.numel(), device="cuda", dtype=torch.int32).view_as(tables)
            return (*args, tables.flatten(), copies)

        def on_copies(*a):
            # Every block copied out in q's dtype, then the kernel of a plain cache (on Hopper the
            # warp-specialized one) on the copies: the engine's path when every block holds cached
            # tokens (the store writes new rows' copies itself: layer_cases below).
            k, v = kernels.gather_kv_blocks(a[1], a[2], a[11], a[0].dtype, k_scale=a[7], v_scale=a[8])
            return kernels.prefill_attention(a[0], k, v, *a[3:5], a[12], max_q_len=a[6])

        # The engine's path on an H200 (the Hopper kernel, so the Hopper bucket is reported), timed as
        # graph replays like the Hopper cases.
        cases.append(Case(
            "prefill_attention_hopper", f"{label}, fp8 cache on block copies", make_copies, on_copies,
            {"bf16 cache": lambda *a: kernels.prefill_attention(a[0], a[9], a[10], *a[3:6], max_q_len=a[6])},
            bytes=cache_bytes(q_lens, 0), flops=causal_flops(q_lens, 0), graph=True))
    return cases


def layer_inputs(new, context, block_size):
    """One prefill step of B = 16k / new sequences, each `new` tokens over `context` cached ones, as
    layers/attention.py runs it: the packed QKV, the prologue's weights and slots, bf16 caches
    (context random), e4m3 caches holding the same context (key-major V, head-major scales), and the
    step's copies of its blocks, the ones holding cached tokens first (engine/step_inputs.block_copies)."""
    batch, per_seq, cached = TOKENS // new, -(-(context + new) // block_size), -(-context // block_size)
    k_cache, v_cache, tables = paged_cache(context + new, batch, block_size)
    (k8, k_scale), (v8, v_scale) = reference.quantize_e4m3(k_cache), reference.quantize_e4m3(v_cache)
    fp8 = k8, key_major_copy(v8), head_major_copy(k_scale), head_major_copy(v_scale)
    positions = torch.arange(context, context + new, device="cuda")
    copy_tables = torch.cat([torch.arange(batch * cached, device="cuda").view(batch, cached),
                             batch * cached + torch.arange(batch * (per_seq - cached), device="cuda").view(batch, -1)],
                            dim=1).to(torch.int32)
    slots, copy_slots = ((t.long() * block_size)[:, positions // block_size] + positions % block_size
                         for t in (tables, copy_tables))
    lens = torch.full((batch,), new, device="cuda", dtype=torch.int32)
    cu_q = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
    prologue = (positions.repeat(batch), randn(TOKENS, 32 * 128), randn(128), randn(128), 1e-6,
                cos_sin_cache(context + new, 128))
    return (prologue, slots.flatten(), (k_cache, v_cache), fp8, tables, cu_q, lens + context, new,
            tables[:, :cached].flatten(), copy_tables, copy_slots.flatten())


def layer_bf16(prologue, slots, caches, fp8, tables, cu_q, seq_lens, max_q, *copies):
    q = kernels.qk_norm_rotary_store(*prologue, *caches, slots, 16, 8)
    return kernels.prefill_attention(q, *caches, cu_q, seq_lens, tables, max_q_len=max_q)


def layer_fp8(prologue, slots, caches, fp8, tables, cu_q, seq_lens, max_q, gather_blocks, copy_tables, copy_slots):
    k8, v8, k_scale, v_scale = fp8
    copy_shape = (copy_tables.numel(), *k8.shape[1:])
    k, v = prologue[1].new_empty(copy_shape), prologue[1].new_empty(copy_shape)
    q = kernels.qk_norm_rotary_store(*prologue, k8, v8, slots, 16, 8, k_scale=k_scale, v_scale=v_scale, k_copy=k,
                                     v_copy=v, copy_slots=copy_slots)
    kernels.gather_kv_blocks(k8, v8, gather_blocks, q.dtype, k_scale=k_scale, v_scale=v_scale, out=(k, v))
    return kernels.prefill_attention(q, k, v, cu_q, seq_lens, copy_tables, max_q_len=max_q)


def layer_cases(quick):
    """A whole prefill step of one attention layer (layers/attention.py): the fused prologue storing
    the new K/V, then attention. Over an e4m3 cache the store also writes the new rows' copies, the
    blocks holding cached tokens are gathered into the rest, and prefill runs on the copies; the
    anchor is the same step over the bf16 cache, read in place. Timed as graph replays."""
    shapes = [(1024, 0, 16)] if quick else [(1024, 0, 16), (1024, 0, 256), (4096, 0, 16), (16384, 0, 256),
                                             (512, 512, 16)]
    return [Case("prefill_attention_hopper",
                 f"B{TOKENS // new} x {new} new over {context} cached, 16/8 heads D128 block {block_size} bf16, "
                 "fp8 cache, prologue + attention",
                 lambda n=new, c=context, bs=block_size: layer_inputs(n, c, bs), layer_fp8,
                 {"bf16 cache, prologue + attention": layer_bf16}, bytes=cache_bytes([new] * (TOKENS // new), context),
                 flops=causal_flops([new] * (TOKENS // new), context), graph=True)
            for new, context, block_size in shapes]


def prefill_cases(quick):
    return hopper_cases(quick) + portable_cases(quick) + layer_cases(quick)
