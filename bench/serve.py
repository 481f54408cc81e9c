"""Serving benchmark: `tritonllm serve` under Poisson load through its HTTP API, and the offline engine.

    python bench/serve.py [--model qwen3-0.6b] [--rates 2 4 8 16 32] [--requests-per-rate 64] [--offline]
                          [--plot serve.png] [--json serve.json]

Starts the server as a subprocess (max_model_len 4096, as bench/throughput.py), warms it up, then
for each rate sends requests of the nano-vllm workload (bench/throughput.py: prompts of 100-1024
random token ids, outputs of 100-1024 tokens with ignore_eos, temperature 0.6) at Poisson arrival
times, each streamed, and reports output throughput, time to first token (TTFT) and inter-token
latency (ITL, the gaps between a stream's chunks) at p50 and p99. Last comes the saturated run:
bench/throughput.py's whole workload (256 requests, seed 0) sent at once. With --offline, after the
server has stopped, this process runs that same workload through LLM.generate, as
bench/throughput.py does, and prints serving / offline throughput. --plot draws latency and
throughput against load (matplotlib).

The client is a small asyncio HTTP/1.1 reader written for this bench (the openai client parses
each chunk into objects: too slow to keep up with a saturated server); requests ask for
return_token_ids, so it works on presets, which have no tokenizer.
"""
import argparse
import asyncio
import gc
import json
import math
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from throughput import MIN_LEN, workload  # noqa: E402
from throughput import make_parser as throughput_parser  # noqa: E402
from throughput import run as run_offline  # noqa: E402

from tritonllm.cli import int_at_least  # noqa: E402
from tritonllm.config import DEVICES, KERNEL_BACKENDS, KV_CACHE_DTYPES  # noqa: E402
from tritonllm.distributed import free_port  # noqa: E402
from tritonllm.loader import load_config  # noqa: E402


@dataclass
class Result:
    start: float  # when the request was sent
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried tokens
    tokens: int = 0
    error: str | None = None


async def stream_completion(port: int, body: bytes, start_at: float) -> Result:
    """POST a streamed completion and time each chunk that carries tokens. One connection per
    request; the raw bytes are split at the SSE events' blank lines (the HTTP chunk-size lines
    between them never hold "data: ")."""
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    result = Result(time.perf_counter())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    status = (await reader.readline()).split()[1]
    buffer = b""
    while data := await reader.read(1 << 16):
        now = time.perf_counter()
        *events, buffer = (buffer + data).split(b"\n\n")
        for event in events:
            at = event.find(b"data: ")
            if at < 0 or event.endswith(b"[DONE]"):
                continue
            chunk = json.loads(event[at + 6:])
            if "error" in chunk:
                result.error = chunk["error"]["message"]
            count = sum(len(choice.get("token_ids", ())) for choice in chunk.get("choices", ()))
            if count:
                result.chunk_times.append(now)
                result.tokens += count
    writer.close()
    result.end = time.perf_counter()
    if status != b"200":
        result.error = (buffer.split(b"\r\n\r\n", 1)[-1] or status).decode(errors="replace")[:300]
    return result


def request_bodies(model: str, prompts, params, max_tokens=None) -> list[bytes]:
    return [json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens or p.max_tokens,
                        "temperature": p.temperature, "ignore_eos": True, "stream": True,
                        "return_token_ids": True}).encode() for prompt, p in zip(prompts, params)]


async def send_all(port: int, bodies: list[bytes], rate: float, seed: int) -> list[Result]:
    """Send the requests at Poisson arrival times of `rate` per second (inf: all at once)."""
    rng, offset, start = random.Random(seed), 0.0, time.perf_counter()
    tasks = []
    for body in bodies:
        if math.isfinite(rate):
            offset += rng.expovariate(rate)
        tasks.append(asyncio.create_task(stream_completion(port, body, start + offset)))
    return await asyncio.gather(*tasks)


def summarize(label: str, rate: float, results: list[Result], expected_tokens: int) -> dict:
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(results)} requests failed at load {label}, e.g. {errors[0]}")
    tokens = sum(r.tokens for r in results)
    if tokens != expected_tokens:
        raise RuntimeError(f"load {label}: {tokens} tokens streamed, {expected_tokens} expected")
    duration = max(r.end for r in results) - min(r.start for r in results)
    ttft = np.array([r.chunk_times[0] - r.start for r in results]) * 1e3
    itl = np.concatenate([np.diff(r.chunk_times) for r in results]) * 1e3
    tpot = np.array([(r.chunk_times[-1] - r.chunk_times[0]) / max(1, r.tokens - 1) for r in results]) * 1e3
    return {"load": label, "rate": rate, "requests": len(results), "seconds": duration,
            "requests_per_s": len(results) / duration, "output_tokens": tokens, "tokens_per_s": tokens / duration,
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "itl_p50_ms": float(np.percentile(itl, 50)), "itl_p99_ms": float(np.percentile(itl, 99)),
            "tpot_mean_ms": float(tpot.mean())}


def get_json(port: int, path: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
        return json.loads(response.read())


def start_server(args, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "tritonllm", "serve", "--model", args.model, "--port", str(port),
               "--tp", str(args.tp), "--max-model-len", str(args.max_model_len), "--kernels", args.kernels,
               "--kv-cache-dtype", args.kv_cache_dtype, "--log-level", "warning"]
    command += ["--device", args.device] if args.device else []
    command += ["--enforce-eager"] if args.enforce_eager else []
    server = subprocess.Popen(command)
    deadline = time.monotonic() + 1800
    while True:
        try:
            if get_json(port, "/health")["status"] == "ok":
                return server
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"the server did not start (exit code {server.poll()})")
        time.sleep(0.5)


def wait_idle(port: int) -> dict:
    while True:
        stats = get_json(port, "/stats")
        if stats["num_running_seqs"] == stats["num_waiting_seqs"] == 0:
            return stats
        time.sleep(0.2)


def serve_runs(args, prompts, params) -> list[dict]:
    gc.freeze()  # torch is imported here too: keep the collector's full passes (~0.4 s) out of the timings
    port = args.port or free_port()
    server = start_server(args, port)
    try:
        # Warm-up as bench/throughput.py's: other prompts of the workload's lengths, 1..16 tokens
        # out, so that every kernel variant is compiled before the clock starts.
        rng = random.Random(1)
        others = [[rng.randint(0, max(prompt)) for _ in prompt] for prompt in prompts]
        warm = [SimpleNamespace(max_tokens=rng.randint(1, 16), temperature=1.0) for _ in prompts]
        asyncio.run(send_all(port, request_bodies(args.model, others, warm), math.inf, 0))
        wait_idle(port)
        rows = []
        for i, rate in enumerate([*sorted(args.rates), math.inf]):
            if math.isfinite(rate):  # a workload of its own, so nothing comes from the prefix cache
                run_prompts, run_params = workload(args.requests_per_rate, args.max_input_len, args.max_output_len,
                                                   args.max_token_id, seed=100 + i)
            else:
                run_prompts, run_params = prompts, params
            bodies = request_bodies(args.model, run_prompts, run_params)
            results = asyncio.run(send_all(port, bodies, rate, seed=i))
            label = f"{rate:g}/s" if math.isfinite(rate) else "all at once"
            rows.append(summarize(label, rate, results, sum(p.max_tokens for p in run_params)))
            print_row(rows[-1])
            wait_idle(port)
        stats = get_json(port, "/stats")
        print(f"\nserver: {stats['num_preemptions']} preemptions, {stats['num_kv_blocks']} KV blocks")
        return rows
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)


HEADER = ("| load | requests | req/s | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT mean (ms) |\n"
          "|---|---|---|---|---|---|---|")


def print_row(r: dict) -> None:
    print(f"| {r['load']} | {r['requests']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.0f} | "
          f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
          f"{r['tpot_mean_ms']:.1f} |", flush=True)


def plot(rows: list[dict], offline: dict | None, path: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib); the numbers are above")
        return
    poisson = [r for r in rows if math.isfinite(r["rate"])]
    saturated = [r for r in rows if not math.isfinite(r["rate"])]
    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4.2))

    def draw(axes, key, style, color, label):  # Poisson runs at their offered rate; a star: all at once
        axes.plot([r["rate"] for r in poisson], [r[key] for r in poisson], style, color=color, label=label)
        axes.plot([r["requests_per_s"] for r in saturated], [r[key] for r in saturated], "*", color=color, markersize=13)

    for key, style, color in (("ttft_p50_ms", "o-", "C0"), ("ttft_p99_ms", "o--", "C0"), ("itl_p50_ms", "s-", "C1"),
                              ("itl_p99_ms", "s--", "C1")):
        draw(latency, key, style, color, key.removesuffix("_ms").replace("_", " ").upper())
    xlabel = "requests/s offered (star: all at once, at the rate it reached)"
    latency.set(xlabel=xlabel, ylabel="ms", yscale="log", title="latency")
    latency.legend()
    latency.grid(True, which="both", alpha=0.3)
    draw(throughput, "tokens_per_s", "o-", "C2", "serving (HTTP)")
    if offline is not None:
        throughput.axhline(offline["tokens_per_s"], color="gray", linestyle="--", label="offline LLM.generate")
    throughput.set(xlabel=xlabel, ylabel="output tokens/s", title="throughput")
    throughput.legend()
    throughput.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="preset name (dummy weights) or checkpoint folder")
    parser.add_argument("--rates", type=float, nargs="+", default=[2, 4, 8, 16, 32], help="Poisson arrival rates (requests/s)")
    parser.add_argument("--requests-per-rate", type=int_at_least(1), default=64)
    parser.add_argument("--num-seqs", type=int_at_least(1), default=256, help="requests of the saturated (and offline) run")
    parser.add_argument("--max-input-len", type=int_at_least(MIN_LEN), default=1024)
    parser.add_argument("--max-output-len", type=int_at_least(MIN_LEN), default=1024)
    parser.add_argument("--max-model-len", type=int_at_least(1), default=4096)
    parser.add_argument("--tp", type=int_at_least(1), default=1)
    parser.add_argument("--kernels", default="triton", choices=KERNEL_BACKENDS)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    parser.add_argument("--device", choices=DEVICES, help="default: cuda when available")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--port", type=int, help="default: a free one")
    parser.add_argument("--offline", action="store_true", help="then the same workload through LLM.generate, in this process")
    parser.add_argument("--plot", help="write the latency/throughput plot here (PNG)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.max_input_len + args.max_output_len > args.max_model_len:
        parser.error(f"--max-model-len {args.max_model_len} must be >= --max-input-len + --max-output-len")
    try:
        vocab = load_config(args.model).vocab_size
    except ValueError as error:
        parser.error(str(error))
    args.max_token_id = min(10000, vocab - 1)  # as bench/throughput.py: inside the vocabulary
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len, args.max_token_id)
    print(f"{args.model}, TP {args.tp}, kernels {args.kernels}, KV {args.kv_cache_dtype}: rates {args.rates} req/s x "
          f"{args.requests_per_rate} requests, then {len(prompts)} requests at once ({sum(map(len, prompts))} prompt "
          f"tokens, {sum(p.max_tokens for p in params)} output tokens)\n\n{HEADER}", flush=True)
    rows = serve_runs(args, prompts, params)
    offline = None
    if args.offline:
        # throughput.py's own defaults for every option run() reads, then this run's.
        options = throughput_parser().parse_args([])
        options.model, options.tp, options.max_model_len = args.model, args.tp, args.max_model_len
        options.enforce_eager, options.no_tqdm = args.enforce_eager, True
        offline = run_offline(options, args.kernels, args.kv_cache_dtype, prompts, params)
        print(f"\noffline LLM.generate, same {len(prompts)} requests: {offline['tokens_per_s']:.0f} tok/s "
              f"({offline['seconds']:.2f} s)")
        print(f"serving all at once / offline: {rows[-1]['tokens_per_s'] / offline['tokens_per_s']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "serving": rows, "offline": offline}, indent=1))
    if args.plot:
        plot(rows, offline, args.plot, f"tritonllm serve, {args.model}, TP {args.tp} (nano-vllm workload)")


if __name__ == "__main__":
    main()
