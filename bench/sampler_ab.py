"""A/B of the sampler against another tree's, on the same logits in one process.

    python bench/sampler_ab.py OTHER/kernels [--batches 1 8 32 128 256] [--tiles 4 8 16 32 64 128]

OTHER/kernels/sampler*.py are copied to a scratch folder with their imports of one another made
local, so the other tree's search and race go with its sampler. Each case times the other tree's
`sample` (its shipped or default config) and the installed one at each FILTER_TILES (the rest of
each bucket's default config), as CUDA-graph replays over input sets filling 3x L2, best of two,
on peaked logits (kernel_cases.sampler_logits) at V 151936. Seeded draws of both must be the same
tokens. Prints a table, us; "default" is the installed default's part size.
"""
import argparse
import importlib
import re
import sys
import tempfile
from pathlib import Path

import torch

from kernel_cases import sampler_logits
from timing import graph_time_ms, input_sets
from tritonllm.kernels.sampler import _default, sample_with_threshold

VOCAB = 151936
MODES = {  # temperature, top_k, top_p, min_p
    "Qwen3 defaults (t 0.6, top-k 20, top-p 0.95)": (0.6, 20, 0.95, 0.0),
    "top-k 50 + top-p 0.9 + min-p 0.05": (0.8, 50, 0.9, 0.05),
    "min-p 0.05": (0.8, 0, 1.0, 0.05),
    "top-p 0.95 alone": (0.8, 0, 0.95, 0.0),
    "temperature": (0.8, 0, 1.0, 0.0),
    "greedy": (0.0, 0, 1.0, 0.0),
}


def load_other(kernels: Path):
    """The other tree's sampler module, with its sampler_* siblings imported from the same copy."""
    folder = Path(tempfile.mkdtemp())
    prefix = f"other_{abs(hash(str(kernels.resolve())))}_"
    for path in kernels.glob("sampler*.py"):
        text = re.sub(r"tritonllm\.kernels\.(sampler\w*)", lambda m: prefix + m.group(1), path.read_text())
        (folder / (prefix + path.name)).write_text(text)
    sys.path.insert(0, str(folder))
    return importlib.import_module(prefix + "sampler")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", type=Path, help="the kernels folder of the other tree")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    parser.add_argument("--tiles", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128], help="FILTER_TILES")
    args = parser.parse_args()
    other = load_other(args.other)
    print("| B | mode | other | " + " | ".join(f"{t} tiles" for t in args.tiles) + " | best | other / best | "
          "default | other / default | same tokens |")
    for batch in args.batches:
        base = _default(torch.float32, batch, VOCAB)
        for mode, values in MODES.items():
            params = [torch.full((batch,), v, device="cuda") for v in values]
            params[1] = params[1].long()
            sets = [(sampler_logits(batch, VOCAB, "peaked"), *params) for _ in range(input_sets(batch * VOCAB * 4))]
            tiles = args.tiles if values[1] or values[2] < 1 or values[3] else args.tiles[:1]  # unfiltered: one form
            ours = {t: (lambda *a, t=t: sample_with_threshold(*a, config={**base, "FILTER_TILES": t})[0]) for t in tiles}
            seeds = torch.arange(batch, device="cuda") * 7919 + 11
            same = all(torch.equal(other.sample(*s, seeds), ours[t](*s, seeds)) for s in sets[:2] for t in tiles)
            before = min(1000 * graph_time_ms(other.sample, sets) for _ in range(2))
            after = {t: min(1000 * graph_time_ms(ours[t], sets) for _ in range(2)) for t in tiles}
            best = min(after, key=after.get)
            default = after.get(base["FILTER_TILES"], float("nan"))
            cells = " | ".join(f"{after[t]:.1f}" if t in after else "-" for t in args.tiles)
            print(f"| {batch} | {mode} | {before:.1f} | {cells} | {best} | {before / after[best]:.2f} | "
                  f"{base['FILTER_TILES']} | {before / default:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
