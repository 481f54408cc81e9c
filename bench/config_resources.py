"""Shared memory, registers and spills of every shipped tuned config, compiled for sm_90 on any machine.

    python bench/config_resources.py [--file PATH] [--only KERNEL ...] > RESOURCES.jsonl
    python bench/config_resources.py --diff BEFORE.jsonl AFTER.jsonl

A config tuned under one Triton version can describe another kernel under the next: from Triton 3.8
the pipeliner gives the bf16 cache's four-warp decode tiles two K/V slots where 3.6 gave one, twice
the shared memory (bench/NOTES-decode-attention.md). This compiles each tuned entry of the kernels
Triton pipelines or whose tiles are tuned (decode and portable prefill attention, the Hopper prefill
kernel, fused_moe, linear) as its bucket's call would launch it, through
tests/kernels/sm90_compile.py, and prints one JSON line an entry: each launch's kernel with its
shared memory (bytes), registers, stack frame (bytes a thread) and local loads and stores (LDL and
STL in the SASS: register spills), as cuobjdump reports them. Run it under two Triton versions and
--diff the two files: the entries it lists are the ones to time, and retune, under the new one. No
GPU needed; the file defaults to the H200's table of the installed Triton (else the nearest version).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "kernels"))
os.environ["TRITON_INTERPRET"] = "0"  # real JITFunctions, compiled rather than interpreted

import torch  # noqa: E402
import triton  # noqa: E402

import sm90_compile  # noqa: E402
from tritonllm.kernels import decode_attention, fused_moe, linear, prefill_attention, tuning  # noqa: E402
from tritonllm.kernels.kv_cache import empty_kv_cache  # noqa: E402
from tritonllm.kernels.prefill_attention_hopper import prefill_attention_hopper  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
E4M3 = torch.float8_e4m3fn


def i32(*shape):
    return torch.zeros(*shape, dtype=torch.int32)


def paged(tokens, block_size, heads, head_dim, dtype, fp8):
    """Zero K/V caches of `tokens` slots as the engine keeps them (an e4m3 V key-major), and the e4m3 scales."""
    blocks = tokens // block_size + 1
    if not fp8:
        return torch.zeros(blocks, block_size, heads, head_dim, dtype=dtype), \
            torch.zeros(blocks, block_size, heads, head_dim, dtype=dtype), {}
    scales = {name: torch.zeros(blocks, block_size, heads) for name in ("k_scale", "v_scale")}
    return (torch.zeros(blocks, block_size, heads, head_dim, dtype=E4M3),
            empty_kv_cache(blocks, block_size, heads, head_dim, E4M3, key_major=True).zero_(), scales)


# One call a kernel, built from its bucket key (the kernels' *_bucket functions define the fields)
# and forced to the entry's config. Sizes that compile to nothing different are kept small.

def decode_call(key, config):
    dtype, head_dim, group, kv_heads, block_size, batch, context, *cache = key.split("/")
    dtype, head_dim, kv_heads, block_size, batch, context = (DTYPES[dtype], int(head_dim), int(kv_heads),
                                                             int(block_size), int(batch), int(context))
    k, v, scales = paged(context, block_size, kv_heads, head_dim, dtype, bool(cache))
    q = torch.zeros(batch, kv_heads * int(group), head_dim, dtype=dtype)
    return lambda: decode_attention(q, k, v, i32(batch), i32(batch, context // block_size), config=config, **scales)


def prefill_inputs(q_len, group, head_dim, dtype, block_size):
    """q, cu_seqlens_q, seq_lens and block tables of 8 sequences of q_len new tokens, 8 KV heads, 2048 keys each."""
    q = torch.zeros(8 * q_len, 8 * group, head_dim, dtype=dtype)
    cu = torch.arange(0, 8 * q_len + 1, q_len, dtype=torch.int32)
    return q, cu, torch.full((8,), 2048, dtype=torch.int32), i32(8, 2048 // block_size)


def prefill_call(key, config):
    dtype, head_dim, group, block_size, q_len, *cache = key.split("/")
    dtype, head_dim, block_size, q_len = DTYPES[dtype], int(head_dim), int(block_size), int(q_len)
    k, v, scales = paged(16384, block_size, 8, head_dim, dtype, bool(cache))
    q, cu, lens, tables = prefill_inputs(q_len, int(group), head_dim, dtype, block_size)
    return lambda: prefill_attention(q, k, v, cu, lens, tables, max_q_len=q_len, config=config, path="portable",
                                     **scales)


def hopper_call(key, config):
    dtype, head_dim, group, block_size, q_len = key.split("/")
    # The query length only sizes the grid: 2048 rows a sequence compile the same as the bucket's 16k.
    dtype, head_dim, block_size, q_len = DTYPES[dtype], int(head_dim), int(block_size), min(int(q_len), 2048)
    k, v, _ = paged(16384, block_size, 8, head_dim, dtype, False)
    q, cu, lens, tables = prefill_inputs(q_len, int(group), head_dim, dtype, block_size)
    return lambda: prefill_attention_hopper(q, k, v, cu, lens, tables, torch.empty_like(q), 0.1, int(group), q_len,
                                            config)


def moe_call(key, config):
    dtype, _, inter, hidden, tokens = key.split("/")
    dtype, inter, hidden, tokens = DTYPES[dtype], int(inter), int(hidden), int(tokens)
    experts = 8  # nothing compiled depends on E
    return lambda: fused_moe(torch.zeros(tokens, hidden, dtype=dtype),
                             torch.zeros(experts, 2 * inter, hidden, dtype=dtype),
                             torch.zeros(experts, hidden, inter, dtype=dtype),
                             torch.zeros(tokens, 8), i32(tokens, 8), config=config)


def linear_call(key, config):
    dtype, n, k, rows = key.split("/")
    dtype, n, k, rows = DTYPES[dtype], int(n), int(k), int(rows)
    return lambda: linear(torch.zeros(rows, k, dtype=dtype), torch.zeros(n, k, dtype=dtype), config=config)


CALLS = {"decode_attention": decode_call, "prefill_attention": prefill_call,
         "prefill_attention_hopper": hopper_call, "fused_moe": moe_call, "linear": linear_call}


def resources(compiled, folder: str) -> dict:
    """Shared memory from the compile's metadata; registers and the stack frame from cuobjdump on its
    cubin, and the SASS's local loads and stores (LDL, STL: register spills)."""
    cubin = Path(folder) / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True).stdout
    sass = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True).stdout
    return {"shared": compiled.metadata.shared, "registers": int(re.search(r"REG:(\d+)", usage)[1]),
            "stack": int(re.search(r"STACK:(\d+)", usage)[1]), "spills": len(re.findall(r"\b(?:LDL|STL)\b", sass))}


def report(path: Path, only) -> None:
    table = json.loads(path.read_text())["kernels"]
    compiled = {}  # launches that compile alike (sm90_compile.launch_key) share a result
    with tempfile.TemporaryDirectory() as folder:
        for name, make in CALLS.items():
            if only and name not in only:
                continue
            for bucket, config in sorted(table.get(name, {}).items()):
                if config.get("TORCH"):  # linear's entries that keep cuBLAS
                    continue
                launches = []
                for kernel, bound, options in sm90_compile.record_launches([make(bucket, config)]):
                    key = sm90_compile.launch_key(kernel, bound, options)
                    if key not in compiled:
                        compiled[key] = resources(sm90_compile.compile_sm90(kernel, bound, options), folder)
                    launches.append({"kernel": kernel.__name__, **compiled[key]})
                print(json.dumps({"name": name, "key": bucket, "config": config, "triton": triton.__version__,
                                  "launches": launches}), flush=True)


def diff(before: Path, after: Path) -> None:
    """The launches whose stack or spills changed between the two reports, or their shared memory by
    1 KiB or more (a reduction's scratch moves by a few hundred bytes between versions)."""
    rows = [{(r["name"], r["key"]): r for r in map(json.loads, path.read_text().splitlines())}
            for path in (before, after)]
    changed, versions = 0, None
    for entry, old in rows[0].items():
        new = rows[1].get(entry)
        if new is None:
            continue
        versions = (old["triton"], new["triton"])
        for a, b in zip(old["launches"], new["launches"]):
            if (a["stack"], a["spills"]) != (b["stack"], b["spills"]) or abs(a["shared"] - b["shared"]) >= 1024:
                changed += 1
                print(f"{entry[0]} {entry[1]} {a['kernel']}: shared {a['shared'] / 1024:.1f} -> "
                      f"{b['shared'] / 1024:.1f} KiB, registers {a['registers']} -> {b['registers']}, "
                      f"stack {a['stack']} -> {b['stack']} B, LDL/STL {a['spills']} -> {b['spills']}  "
                      f"{json.dumps(old['config'])}")
    print(f"{changed} launches changed (Triton {versions[0]} -> {versions[1]})" if versions else "no entry in common")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", type=Path, help="tuned-config JSON (default: the H200's, nearest Triton version)")
    parser.add_argument("--only", nargs="+", choices=list(CALLS), help="these kernels only")
    parser.add_argument("--diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="compare two reports")
    args = parser.parse_args()
    if args.diff:
        diff(*args.diff)
        return
    path = args.file or tuning.nearest_config_file(tuning.CONFIG_DIR / f"NVIDIA_H200__triton-{triton.__version__}.json")
    report(path, args.only)


if __name__ == "__main__":
    main()
