"""Compile every Triton kernel of tritonllm.kernels for sm_90 on any machine, GPU or not.

Run as a script (tests/kernels/test_compile.py does): the public wrappers are called on CPU
tensors with kernel launches intercepted, so each launch's kernel, arguments and default config
are recorded instead of run; each is then compiled with triton.compile for GPUTarget("cuda", 90,
32). A kernel the interpreter accepts but the GPU compiler rejects fails here. Prints one line a
kernel and exits non-zero if any failed. `--ptx NAME` prints the PTX of the kernel NAME instead.
"""
import inspect
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # real JITFunctions, whatever the machine

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
         torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}
SM90 = GPUTarget("cuda", 90, 32)


def record_launches(calls):
    """Run each call with JITFunction.run intercepted; return [(kernel, bound args, options)]."""
    launches = []

    def fake_run(self, *args, grid, warmup, **kwargs):
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        options = {k: v for k, v in kwargs.items() if k not in self.arg_names}
        launches.append((self, bound, options))

    real_run = JITFunction.run
    JITFunction.run = fake_run
    try:
        for call in calls:
            call()
    finally:
        JITFunction.run = real_run
    return launches


def arg_type(value):
    if isinstance(value, TensorDescriptor):
        return f"tensordesc<{TYPES[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, GluonTensorDescriptor):  # the layout travels in the type
        return f"tensordesc<{TYPES[value.base.dtype]}{list(value.block_shape)},{value.layout!r}>"
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {value!r}")


def launch_key(kernel: JITFunction, bound: dict, options: dict) -> tuple:
    """What a recorded launch compiles from: its kernel, argument types (tensors) and values, and
    options; launches with equal keys compile alike."""
    args = sorted((k, arg_type(v) if isinstance(v, torch.Tensor) else v) for k, v in bound.items())
    return kernel.__name__, repr(args), repr(options)


def compile_sm90(kernel: JITFunction, bound: dict, options: dict, target: GPUTarget = SM90):
    """Compile one recorded launch for sm_90 (or `target`); returns the compiled kernel (asm in .asm)."""
    defaults = inspect.signature(kernel.fn).parameters
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = bound.get(param.name, defaults[param.name].default)
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
            continue
        signature[param.name] = arg_type(value)
        # The 16-divisibility the JIT would note for aligned pointers and sizes: it decides
        # vector widths and async copies, so the PTX here is the one the GPU would run.
        aligned = value.data_ptr() % 16 == 0 if isinstance(value, torch.Tensor) else (
            isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0 and not param.do_not_specialize)
        if aligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = (GluonASTSource if kernel.is_gluon() else triton.compiler.ASTSource)(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options)


def cases():
    """Calls that reach every kernel with its default config, in realistic shapes and every dtype."""
    from tritonllm.kernels import (fused_add_rms_norm, qk_norm_rotary_store, rms_norm, rotary_embedding, silu_and_mul,
                                  store_kv_cache)
    from tritonllm.kernels.kv_cache import empty_kv_cache

    def key_major_e4m3(num_blocks, block_size, heads, head_dim):
        """A zero e4m3 V cache in the engine's key-major layout."""
        return empty_kv_cache(num_blocks, block_size, heads, head_dim, torch.float8_e4m3fn, key_major=True).zero_()

    calls = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        def t(*shape, dtype=dtype):
            return torch.zeros(*shape, dtype=dtype)

        calls += [
            lambda t=t: rms_norm(t(16384, 4096), t(4096), 1e-6),
            lambda t=t: rms_norm(t(64, 16, 128), t(128), 1e-6),
            lambda t=t: fused_add_rms_norm(t(16384, 4096), t(16384, 4096), t(4096), 1e-6),
            lambda t=t: silu_and_mul(t(8192, 2 * 3072)),
            lambda t=t: rotary_embedding(t(8192, dtype=torch.int64), t(8192, 16, 128), t(8192, 8, 128),
                                         t(40960, 128, dtype=torch.float32)),
            lambda t=t: store_kv_cache(t(8192, 8, 128), t(8192, 8, 128), t(600, 16, 8, 128), t(600, 16, 8, 128),
                                       t(8192, dtype=torch.int32)),
            # An fp8 (e4m3) cache with its per-(slot, head) scales, V key-major as the engine keeps it.
            lambda t=t: store_kv_cache(t(8192, 8, 128), t(8192, 8, 128), t(600, 16, 8, 128, dtype=torch.float8_e4m3fn),
                                       key_major_e4m3(600, 16, 8, 128), t(8192, dtype=torch.int32),
                                       k_scale=t(600, 16, 8, dtype=torch.float32),
                                       v_scale=t(600, 16, 8, dtype=torch.float32)),
        ]
        for tokens, q_heads, kv_heads in [(8192, 16, 8), (8192, 4, 2)]:  # the second: a TP shard, 2 tokens a program
            calls.append(lambda t=t, n=tokens, hq=q_heads, hk=kv_heads: qk_norm_rotary_store(
                t(n, dtype=torch.int64), t(n, (hq + 2 * hk) * 128), t(128), t(128), 1e-6, t(40960, 128, dtype=torch.float32),
                t(600, 16, hk, 128), t(600, 16, hk, 128), t(n, dtype=torch.int32), hq, hk))
            calls.append(lambda t=t, n=tokens, hq=q_heads, hk=kv_heads: qk_norm_rotary_store(
                t(n, dtype=torch.int64), t(n, (hq + 2 * hk) * 128), t(128), t(128), 1e-6, t(40960, 128, dtype=torch.float32),
                t(600, 16, hk, 128, dtype=torch.float8_e4m3fn), key_major_e4m3(600, 16, hk, 128),
                t(n, dtype=torch.int32), hq, hk, k_scale=t(600, 16, hk, dtype=torch.float32),
                v_scale=t(600, 16, hk, dtype=torch.float32)))
        # Blocks of 256 keys, with the copies prefill takes: V from programs of 32 tokens and a KV head.
        calls.append(lambda t=t: qk_norm_rotary_store(
            t(8192, dtype=torch.int64), t(8192, 32 * 128), t(128), t(128), 1e-6, t(40960, 128, dtype=torch.float32),
            t(40, 256, 8, 128, dtype=torch.float8_e4m3fn), key_major_e4m3(40, 256, 8, 128), t(8192, dtype=torch.int32),
            16, 8, k_scale=t(40, 256, 8, dtype=torch.float32), v_scale=t(40, 256, 8, dtype=torch.float32),
            k_copy=t(32, 256, 8, 128), v_copy=t(32, 256, 8, 128), copy_slots=t(8192, dtype=torch.int32)))
    from tritonllm.kernels import linear

    # A decode step's projections (Qwen3-0.6B's qkv at 1 row, its down at 16; 30B-A3B's router), split and not.
    for dtype in (torch.float16, torch.bfloat16):
        for rows, n, k, tile in ((1, 4096, 1024, (64, 128, 2)), (16, 1024, 3072, (32, 256, 4)),
                                 (4, 128, 2048, (32, 128, 8)), (3, 70, 300, (32, 64, 1))):
            cfg = {"BLOCK_N": tile[0], "BLOCK_K": tile[1], "SPLIT_K": tile[2], "num_warps": 4, "num_stages": 3}
            calls.append(lambda d=dtype, m=rows, n=n, k=k, c=cfg: linear(torch.zeros(m, k, dtype=d),
                                                                         torch.zeros(n, k, dtype=d), config=c))
    from tritonllm.kernels import gather_kv_blocks

    # The copies prefill takes of an e4m3 cache (V key-major), and of a bf16 one.
    for bs in (16, 256):
        blocks = torch.zeros(1200 // bs * 16, dtype=torch.int32)
        calls += [
            lambda bs=bs, b=blocks: gather_kv_blocks(
                torch.zeros(600, bs, 8, 128, dtype=torch.float8_e4m3fn), key_major_e4m3(600, bs, 8, 128), b,
                torch.bfloat16, k_scale=torch.zeros(600, bs, 8), v_scale=torch.zeros(600, bs, 8)),
            lambda bs=bs, b=blocks: gather_kv_blocks(torch.zeros(600, bs, 8, 128, dtype=torch.bfloat16),
                                                     torch.zeros(600, bs, 8, 128, dtype=torch.bfloat16), b,
                                                     torch.bfloat16),
        ]
    from tritonllm.kernels import compute_logprobs, sample

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for batch in (1, 256):  # the default config differs for small batches
            rows = [torch.ones(batch), torch.zeros(batch, dtype=torch.int64), torch.ones(batch), torch.zeros(batch)]
            calls += [
                lambda d=dtype, r=rows: sample(torch.zeros(len(r[0]), 151936, dtype=d), *r),
                lambda d=dtype, r=rows: compute_logprobs(torch.zeros(len(r[0]), 151936, dtype=d), r[1]),
            ]
    from tritonllm.kernels import apply_penalties, compute_top_logprobs, count_tokens

    def vocab_rows(dtype, rows=8):
        return torch.zeros(rows, 151936, dtype=dtype)

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        calls += [
            lambda d=dtype: compute_top_logprobs(vocab_rows(d), 20),
            lambda d=dtype: apply_penalties(vocab_rows(d), vocab_rows(torch.int32, 4), vocab_rows(torch.uint8, 4),
                                            torch.zeros(8, dtype=torch.int32), *[torch.ones(8)] * 3),
        ]
    for buffer_dtype in (torch.int32, torch.uint8):  # generated-token counts, the prompt mask
        calls.append(lambda d=buffer_dtype: count_tokens(vocab_rows(d, 4), torch.zeros(300, dtype=torch.int32),
                                                         torch.zeros(300, dtype=torch.int64)))
    from tritonllm.kernels import decode_attention, prefill_attention
    from tritonllm.kernels.decode_attention import DECODE_TUNABLE, decode_attention_bucket

    def i32(*shape):
        return torch.zeros(*shape, dtype=torch.int32)

    # 16 q / 8 kv heads, D 128; caches of q's dtype, then e4m3 caches with their scales.
    for dtype, cache_dtype in [(d, c) for c in (None, torch.float8_e4m3fn) for d in (torch.float32, torch.float16,
                                                                                      torch.bfloat16)]:
        for bs in (16, 256):
            def cache(tokens, d=cache_dtype or dtype, bs=bs):
                return torch.zeros(tokens // bs, bs, 8, 128, dtype=d)

            def v_cache(tokens, d=cache_dtype or dtype, bs=bs):  # e4m3: key-major, as the engine keeps it
                return key_major_e4m3(tokens // bs, bs, 8, 128) if d == torch.float8_e4m3fn else cache(tokens, d, bs)

            def scales(tokens, fp8=cache_dtype is not None, bs=bs):
                return {name: torch.zeros(tokens // bs, bs, 8) for name in ("k_scale", "v_scale")} if fp8 else {}

            def q(tokens, d=dtype):
                return torch.zeros(tokens, 16, 128, dtype=d)

            # Decode as an H200 (132 SMs) would launch batch 1 x 32k: split, then the merge kernel.
            bucket = decode_attention_bucket(dtype, 128, 2, 8, bs, 1, 32768, cache_dtype)
            split = DECODE_TUNABLE.default(*bucket) | {"NUM_SPLITS": 50}
            cu = torch.arange(0, 8193, 1024, dtype=torch.int32)  # 8 sequences: 1024 cached + 1024 new tokens
            calls += [
                lambda q=q, c=cache, v=v_cache, s=scales, cu=cu, bs=bs: prefill_attention(
                    q(8192), c(16384), v(16384), cu, torch.full((8,), 2048, dtype=torch.int32), i32(8, 2048 // bs),
                    max_q_len=1024, **s(16384)),
                lambda q=q, c=cache, v=v_cache, s=scales, bs=bs: decode_attention(
                    q(256), c(65536), v(65536), i32(256), i32(256, 4096 // bs), **s(65536)),
                lambda q=q, c=cache, v=v_cache, s=scales, bs=bs, cfg=split: decode_attention(
                    q(1), c(32768), v(32768), i32(1), i32(1, 32768 // bs), config=cfg, **s(32768)),
            ]
    from tritonllm.kernels import tuning
    from tritonllm.kernels.prefill_attention_hopper import HOPPER_TUNABLE, prefill_attention_hopper

    # The Hopper path of prefill, bf16 and fp16, blocks of 16 and 256, long and short queries
    # (default configs of 128 and 64 rows, of 64- and 128-key tiles); called directly, as its wrapper
    # takes it on GPUs only.
    for dtype in (torch.float16, torch.bfloat16):
        for bs, q_len in ((16, 1024), (256, 4096), (16, 16)):
            config = HOPPER_TUNABLE.default(tuning.dtype_name(dtype), 128, 2, bs, q_len)
            calls.append(lambda d=dtype, bs=bs, n=q_len, cfg=config: prefill_attention_hopper(
                torch.zeros(8 * n, 16, 128, dtype=d), torch.zeros(16384 // bs, bs, 8, 128, dtype=d),
                torch.zeros(16384 // bs, bs, 8, 128, dtype=d), torch.arange(0, 8 * n + 1, n, dtype=torch.int32),
                torch.full((8,), 2048, dtype=torch.int32), i32(8, 2048 // bs), torch.zeros(8 * n, 16, 128, dtype=d),
                0.1, 2, n, cfg))
    from tritonllm.kernels import fused_moe, moe_route

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        calls.append(lambda d=dtype: moe_route(torch.zeros(4096, 128, dtype=d), 8, True))
        # Qwen3-30B-A3B's expert shapes, 8 experts (nothing compiled depends on E): one token (a block
        # per pair, no align), 16 (decode tiles, moe_align in one program), 4096 (wgmma tiles,
        # moe_align's three launches), k = 1.
        for tokens, top_k in ((1, 8), (16, 8), (4096, 8), (64, 1)):
            calls.append(lambda d=dtype, t=tokens, k=top_k: fused_moe(
                torch.zeros(t, 2048, dtype=d), torch.zeros(8, 1536, 2048, dtype=d), torch.zeros(8, 2048, 768, dtype=d),
                torch.zeros(t, k), torch.zeros(t, k, dtype=torch.int32)))
        # A prefill graph's count of real tokens: moe_align reads it on the device, in both forms.
        for tokens in (16, 4096):
            calls.append(lambda d=dtype, t=tokens: fused_moe(
                torch.zeros(t, 2048, dtype=d), torch.zeros(8, 1536, 2048, dtype=d), torch.zeros(8, 2048, 768, dtype=d),
                torch.zeros(t, 8), torch.zeros(t, 8, dtype=torch.int32), real_tokens=i32(1)))
    calls.append(lambda: moe_route(torch.zeros(1, 512), 8, False))
    return calls


def main(argv):
    launches = record_launches(cases())
    if argv[:1] == ["--ptx"]:
        for kernel, bound, options in launches:
            if kernel.__name__ == argv[1]:
                print(compile_sm90(kernel, bound, options).asm["ptx"])
                return 0
        return 1
    failed = 0
    seen = set()
    for kernel, bound, options in launches:
        key = launch_key(kernel, bound, options)
        if key in seen:
            continue
        seen.add(key)
        try:
            compile_sm90(kernel, bound, options)
            print(f"ok      {kernel.__name__} {options}")
        except Exception as error:  # report every failing kernel, not only the first
            failed += 1
            print(f"FAILED  {kernel.__name__} {options}: {type(error).__name__}: {str(error)[:2000]}")
    print(f"{len(seen) - failed} compiled, {failed} failed")
    return 1 if failed or not seen else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
