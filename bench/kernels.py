"""Autotune every kernel over its benchmark shapes and report it against its anchors.

    python bench/kernels.py [--quick] [--only NAME ...] [--match TEXT ...] [--exclude TEXT ...] [--no-tune]
                            [--configs PATH] [--report PATH] [--plot PATH]

For each case: every config tried with its median time, the best, the achieved GB/s or TFLOP/s
and its percent of the ceiling (bench/timing.py), and the speed ratio to each anchor (the PyTorch
reference, torch.compile of it, vendor kernels) timed in the same run. Writes the tuned configs to the
tuned-config JSON of this GPU and Triton version (merged with what it holds). Needs a GPU.
"""
import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton

from kernel_cases import all_cases
from moe_cases import moe_cases
from prefill_cases import prefill_cases
from timing import BF16_FLOPS_PER_S, COPY_BYTES_PER_S, graph_time_ms, input_sets, time_ms
from tritonllm.kernels import tuning


@dataclass
class Result:
    case: str
    config: dict
    ms: float
    rate: str
    percent: float
    ratios: dict = field(default_factory=dict)


def run_case(case) -> Result:
    args = case.make()
    tunable = tuning.REGISTRY[case.kernel]
    tuned_before = set(tunable.results)
    case.triton(*args)  # the first call tunes the case's bucket, unless an earlier case did
    key = tunable.last_key
    print(f"\n## {case.kernel} {case.label}  (bucket {key})")
    if key in tuned_before:
        print("   bucket tuned by an earlier case")
    else:
        for config, ms in tunable.results.get(key, []):
            print(f"   {ms * 1e3:10.1f} us  {config}")
    if case.graph:
        arg_sets = [args] + [case.make() for _ in range(input_sets(case.bytes) - 1)]
        timer = lambda fn: graph_time_ms(fn, arg_sets)  # noqa: E731
    else:
        timer = lambda fn: time_ms(lambda: fn(*args))  # noqa: E731
    ms = timer(case.triton)
    if case.flops:
        rate, percent = f"{case.flops / ms / 1e9:.0f} TFLOP/s", 100 * case.flops / (ms * 1e-3) / BF16_FLOPS_PER_S
    else:
        rate, percent = f"{case.bytes / ms / 1e6:.0f} GB/s", 100 * case.bytes / (ms * 1e-3) / COPY_BYTES_PER_S
    ratios = {}
    for name, anchor in case.anchors.items():
        try:
            eager = name in case.eager_anchors
            ratios[name] = (time_ms(lambda: anchor(*args)) if eager else timer(anchor)) / ms
        except Exception as error:  # an anchor that does not run here is reported, not fatal
            print(f"   anchor {name} failed: {type(error).__name__}: {str(error)[:200]}")
            ratios[name] = math.nan
    config = tuning.tuned_table().get(case.kernel, {}).get(key, {})
    print(f"   best {config}: {ms * 1e3:.1f} us, {rate}, {percent:.0f}% of ceiling; "
          + ", ".join(f"{ratio:.2f}x {name}" for name, ratio in ratios.items()))
    return Result(f"{case.kernel} {case.label}", config, ms, rate, percent, ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape per kernel")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="kernels to run (by name), in this order")
    parser.add_argument("--match", nargs="+", metavar="TEXT",
                        help="only the cases whose label contains one of the TEXTs (e.g. 'fp8 cache')")
    parser.add_argument("--exclude", nargs="+", metavar="TEXT",
                        help="leave out the cases whose label contains one of the TEXTs (e.g. 'fp8')")
    parser.add_argument("--configs", type=Path, help="tuned-config JSON to write (default: the shipped file)")
    parser.add_argument("--report", type=Path, help="also write the summary table (markdown) here")
    parser.add_argument("--no-tune", action="store_true", help="time the shipped tuned configs (or defaults) without tuning")
    parser.add_argument("--plot", type=Path, help="also plot prefill attention's TFLOP/s against S here (PNG)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU (the interpreter cannot time kernels)")
    torch.manual_seed(0)
    cases = all_cases(args.quick) + prefill_cases(args.quick) + moe_cases(args.quick)
    if args.only:  # in the order given
        cases = [case for name in args.only for case in cases if case.kernel == name]
    if args.match:
        cases = [case for case in cases if any(text in case.label for text in args.match)]
    if args.exclude:
        cases = [case for case in cases if not any(text in case.label for text in args.exclude)]
    if not cases:
        sys.exit(f"no benchmark case for {args.only} {args.match or ''} {args.exclude or ''}")
    if not args.no_tune:  # the kernels benchmarked; what anchors call keeps its shipped configs
        tuning.start_tuning({case.kernel for case in cases})
    results = []
    for case in cases:  # configs and table saved after every case: a run cut short keeps what it measured
        results.append(run_case(case))
        if not args.no_tune:
            path = tuning.save(args.configs)
        table = report(results)
        if args.report:
            args.report.write_text(table + "\n")
    if not args.no_tune:
        print(f"\ntuned configs written to {path}")
    if args.plot:
        plot_prefill(results, args.plot)
    print(f"\n{table}")


def plot_prefill(results: list[Result], path: Path):
    """TFLOP/s against S of the equal-length prefill cases: ours per cache block size, and the SDPA
    anchors (their TFLOP/s: ours divided by the time ratio)."""
    import re

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, dict[int, float]] = {}
    for r in results:
        match = re.search(r"^prefill_attention_hopper B\d+ x S(\d+) .* block (\d+) bf16$", r.case)
        if not match:
            continue
        seq, block = int(match[1]), int(match[2])
        if block not in (16, 256):  # the other block sizes are timed at two lengths only
            continue
        ours = float(r.rate.split()[0])
        lines.setdefault(f"tritonllm, block {block}", {})[seq] = ours
        if block == 16:  # the anchors read contiguous K/V: one line each
            for name in ("sdpa cudnn", "sdpa flash"):
                if r.ratios.get(name, 0) > 0:
                    lines.setdefault(name, {})[seq] = ours / r.ratios[name]
    if not lines:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in lines.items():
        seqs = sorted(points)
        ax.plot(seqs, [points[s] for s in seqs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length S (B x S = 16k tokens)")
    ax.set_ylabel("TFLOP/s (causal FLOPs)")
    ax.set_title(f"Causal prefill, 16/8 heads, D 128, bf16 ({torch.cuda.get_device_name()})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def report(results: list[Result]) -> str:
    anchors = list(dict.fromkeys(name for r in results for name in r.ratios))
    lines = [
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        "ratio = anchor time / Triton time (> 1: Triton faster)",
        "",
        "| kernel and shape | us | rate | % of ceiling | " + " | ".join(f"vs {a}" for a in anchors) + " |",
        "|---|---|---|---|" + "---|" * len(anchors),
    ]
    for r in results:
        cells = [f"{r.ratios[a]:.2f}x" if a in r.ratios else "" for a in anchors]
        lines.append(f"| {r.case} | {r.ms * 1e3:.1f} | {r.rate} | {r.percent:.0f}% | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
