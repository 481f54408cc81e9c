"""Stream-K decode prototype against the shipped decode_attention: uniform cells (the fp8 table) and the
nano-vllm workload's decode steps (as bench/decode_workload.py builds them), graph-timed in one process."""
import json
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

sys.path.insert(0, HERE)
from tritonllm.kernels.decode_attention_lean import lean_decode_attention  # noqa: E402
from kernel_cases import paged_cache, randn  # noqa: E402
from throughput import workload  # noqa: E402
from timing import COPY_BYTES_PER_S, graph_time_ms  # noqa: E402
from tritonllm import kernels  # noqa: E402
from tritonllm.engine.model_runner import graph_batch_sizes  # noqa: E402
from tritonllm.kernels import reference  # noqa: E402
from tritonllm.kernels.fp8 import head_major_copy  # noqa: E402
from tritonllm.kernels.kv_cache import key_major_copy  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
FP8_TILES = [(16, 4, 128), (16, 5, 128), (32, 2, None), (32, 3, None)]
FP8_CONFIGS = [{"BLOCK_N": n, "num_warps": 1, "num_stages": s, "PROGRAMS_PER_SM": p, "MIN_TILES": 4, "FLAT": 1}
               | ({"maxnreg": r} if r else {}) for n, s, r in FP8_TILES for p in (8, 11, 14, 16)]
FP8_CONFIGS += [{"BLOCK_N": n, "num_warps": 1, "num_stages": s, "PROGRAMS_PER_SM": p, "MIN_TILES": 4}
                | ({"maxnreg": r} if r else {}) for n, s, r, p in ((16, 4, 128, 16), (16, 5, 128, 8), (32, 2, None, 11))]
BF16_CONFIGS = [{"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PROGRAMS_PER_SM": p, "MIN_TILES": 2, "FLAT": f}
                for p in (2, 3, 4) for f in (0, 1)]
FP8_TOKEN_BYTES = 8 * (128 * 2 + 8)
log = open(os.path.join(OUT, "lean_log.txt"), "w")


def say(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    log.write(line + "\n")
    log.flush()


def key(cfg):
    return json.dumps(cfg, sort_keys=True)


def fp8_cache(k, v):
    (k8, ks), (v8, vs) = reference.quantize_e4m3(k), reference.quantize_e4m3(v)
    return k8, key_major_copy(v8), head_major_copy(ks), head_major_copy(vs)


def time_sets(fn, sets):
    try:
        return graph_time_ms(fn, sets, replays=20) * 1e3
    except Exception as e:  # a config that does not compile or fit
        say("   failed:", repr(e)[:200])
        return float("nan")


def best(times):
    ok = {k: t for k, t in times.items() if t == t}
    k = min(ok, key=ok.get)
    return k, ok[k]


def uniform():
    rows = []
    cells = [(1, 16384), (1, 32768), (8, 16384), (32, 1024), (32, 4096), (128, 1024), (128, 4096), (128, 16384),
             (256, 1024), (256, 4096)]
    for b, c in cells:
        fp8_bytes = b * c * FP8_TOKEN_BYTES
        n_sets = max(1, math.ceil(150e6 / fp8_bytes))
        sets = []
        for _ in range(n_sets):
            k, v, tables = paged_cache(c, b, 16)
            k8, v8, ks, vs = fp8_cache(k, v)
            seq_lens = torch.full((b,), c, device="cuda", dtype=torch.int32)
            sets.append((randn(b, 16, 128), k, v, k8, v8, ks, vs, seq_lens, tables))
        bf16 = time_sets(lambda q, k, v, k8, v8, ks, vs, sl, t: kernels.decode_attention(q, k, v, sl, t), sets)
        fp8 = time_sets(lambda q, k, v, k8, v8, ks, vs, sl, t: kernels.decode_attention(q, k8, v8, sl, t, k_scale=ks,
                                                                                        v_scale=vs), sets)
        q, k, v, k8, v8, ks, vs, sl, t = sets[0]
        want8 = kernels.decode_attention(q, k8, v8, sl, t, k_scale=ks, v_scale=vs).float()
        want = kernels.decode_attention(q, k, v, sl, t).float()
        lean8, lean16 = {}, {}
        for cfg in FP8_CONFIGS:
            got = lean_decode_attention(q, k8, v8, sl, t, config=cfg, k_scale=ks, v_scale=vs).float()
            err = ((got - want8).norm() / want8.norm()).item()
            lean8[key(cfg)] = time_sets(lambda q, k, v, k8, v8, ks, vs, sl, t, c=cfg: lean_decode_attention(
                q, k8, v8, sl, t, config=c, k_scale=ks, v_scale=vs), sets) if err < 1e-2 else float("nan")
            if err >= 1e-2:
                say("   wrong:", cfg, err)
        for cfg in BF16_CONFIGS:
            got = lean_decode_attention(q, k, v, sl, t, config=cfg).float()
            err = ((got - want).norm() / want.norm()).item()
            lean16[key(cfg)] = time_sets(lambda q, k, v, k8, v8, ks, vs, sl, t, c=cfg: lean_decode_attention(
                q, k, v, sl, t, config=c), sets) if err < 1e-2 else float("nan")
        bk8, bt8 = best(lean8)
        bk16, bt16 = best(lean16)
        floor = fp8_bytes / COPY_BYTES_PER_S * 1e6
        say(f"B{b} x {c}: bf16 {bf16:8.1f}  fp8 {fp8:8.1f} ({bf16 / fp8:.2f}x)  lean fp8 {bt8:8.1f} "
            f"({bf16 / bt8:.2f}x, {fp8_bytes / bt8 / 1e6:5.2f} TB/s, floor {floor:6.1f})  lean bf16 {bt16:8.1f} "
            f"(lean/lean {bt16 / bt8:.2f}x)  {bk8}  {bk16}")
        rows.append({"batch": b, "context": c, "bf16": bf16, "fp8": fp8, "lean_fp8": lean8, "lean_bf16": lean16})
        del sets
        torch.cuda.empty_cache()
    return rows


def steps(stride):
    prompts, params = workload(256, 1024, 1024)
    requests = [(len(p), sp.max_tokens) for p, sp in zip(prompts, params)]
    sizes = graph_batch_sizes(256)
    total = sum(p + o for p, o in requests)
    k, v, _ = paged_cache(total + 64 * 16, 1, 16)
    k8, v8, ks, vs = fp8_cache(k, v)
    del k, v
    num_blocks = k8.shape[0]
    rows = []
    for step in range(0, max(o for _, o in requests), stride):
        lens = sorted((p + step + 1 for p, o in requests if o > step), reverse=True)
        batch = next(s for s in sizes if s >= len(lens))
        seq_lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
        seq_lens[: len(lens)] = torch.tensor(lens, dtype=torch.int32)
        tables = torch.randint(0, num_blocks, (batch, 4096 // 16), dtype=torch.int32, device="cuda")
        q = randn(batch, 16, 128)
        want = kernels.decode_attention(q, k8, v8, seq_lens, tables, max_seq_len=4096, k_scale=ks, v_scale=vs).float()
        engine = time_sets(lambda: kernels.decode_attention(q, k8, v8, seq_lens, tables, max_seq_len=4096,
                                                            k_scale=ks, v_scale=vs), [()])
        lean = {}
        for cfg in FP8_CONFIGS:
            got = lean_decode_attention(q, k8, v8, seq_lens, tables, config=cfg, k_scale=ks, v_scale=vs).float()
            err = ((got - want).norm() / want.norm()).item()
            lean[key(cfg)] = time_sets(lambda c=cfg: lean_decode_attention(q, k8, v8, seq_lens, tables, config=c,
                                                                            k_scale=ks, v_scale=vs), [()]) \
                if err < 1e-2 else float("nan")
        bk, bt = best(lean)
        floor = sum(lens) * FP8_TOKEN_BYTES / COPY_BYTES_PER_S * 1e6
        say(f"step {step:4d} batch {len(lens):3d} (graph {batch}) mean ctx {sum(lens) / len(lens):6.0f}: engine "
            f"{engine:7.1f} us ({floor / engine:.0%} of floor)  lean best {bt:7.1f} ({floor / bt:.0%})  {bk}")
        rows.append({"step": step, "batch": len(lens), "graph": batch, "engine": engine, "lean": lean,
                     "floor": floor})
    return rows


def main():
    stride = int(os.environ.get("STRIDE", "64"))
    uni = uniform() if os.environ.get("UNIFORM", "1") == "1" else []
    wl = steps(stride) if os.environ.get("WORKLOAD", "1") == "1" else []
    json.dump({"uniform": uni, "workload": wl}, open(os.path.join(OUT, "lean.json"), "w"))
    if wl:
        layers = 28 * stride * 1e-6
        engine_s = sum(r["engine"] for r in wl) * layers
        per_cfg = {k: sum(r["lean"][k] for r in wl) * layers for k in wl[0]["lean"]}
        bk, bs = best(per_cfg)
        buckets = {}
        for r in wl:
            b = buckets.setdefault(2 ** math.ceil(math.log2(r["graph"])), {"engine": 0.0, "lean": {}})
            b["engine"] += r["engine"] * layers
            for k, t in r["lean"].items():
                b["lean"][k] = b["lean"].get(k, 0.0) + t * layers
        best_per_bucket = sum(best(b["lean"])[1] for b in buckets.values())
        floor = sum(r["floor"] for r in wl) * layers
        say(f"\nworkload estimate: engine {engine_s:.3f} s, lean one config {bs:.3f} s ({bk}), lean best per bucket "
            f"{best_per_bucket:.3f} s, floor {floor:.3f} s")
        for bucket, b in sorted(buckets.items()):
            k, t = best(b["lean"])
            say(f"  bucket {bucket:3d}: engine {b['engine']:.4f} s, lean best {t:.4f} s  {k}")
    say("\nSUMMARY (us)")
    for r in uni:
        bk8, bt8 = best(r["lean_fp8"])
        bk16, bt16 = best(r["lean_bf16"])
        say(f"B{r['batch']:3d} x {r['context']:5d}: bf16 {r['bf16']:7.1f} fp8 {r['fp8']:7.1f} ({r['bf16'] / r['fp8']:.2f}x) "
            f"lean8 {bt8:7.1f} ({r['bf16'] / bt8:.2f}x) lean16 {bt16:7.1f} (lean16/lean8 {bt16 / bt8:.2f}x)")


if __name__ == "__main__":
    main()
