"""Autotuning: config spaces, bucketed shape keys and the tuned-config file.

Each kernel family declares a `Tunable`: a config space and a heuristic default, both functions
of a bucket (a tuple of the shape features that matter, rounded up to powers of two, plus the
dtype). At run time `Tunable.config(bucket)` answers from the tuned-config JSON of this GPU and
Triton version (else of the nearest version tuned on this GPU, else on a GPU of the same compute
capability and SM count) when it has the bucket, else from the default. Serving never tunes
unless TRITONLLM_AUTOTUNE=1; bench/kernels.py tunes with `Tunable.tune` and writes the file with
`save`.

A config is a dict of the kernel's constexpr meta-parameters plus `num_warps` / `num_stages`,
passed straight to the launch: `kernel[grid](*args, **config)`.
"""
import copy
import fcntl
import functools
import json
import math
import os
import re
import tempfile
import warnings
from pathlib import Path

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CONFIG_DIR = Path(__file__).with_name("configs")
REGISTRY: dict[str, "Tunable"] = {}

_table: dict[str, dict[str, dict]] | None = None  # kernel name -> bucket key -> config
_loaded: dict[str, dict[str, dict]] = {}  # the table as read from the file, to tell what save() must write
_tuning: set[str] = set()  # kernels whose buckets are tuned afresh on first use (start_tuning)


@functools.cache
def has_tma(device_index: int) -> bool:
    """Whether CUDA device `device_index` has TMA (the Tensor Memory Accelerator: Hopper, sm_90, and later)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device `device_index`."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pow2(n: int) -> int:
    """The bucket of a size: the next power of two (at least 1)."""
    return triton.next_power_of_2(max(int(n), 1))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bucket_key(bucket: tuple) -> str:
    return "/".join(str(part) for part in bucket)


def config_path() -> Path:
    """The tuned-config file of the current GPU and Triton version, the one `save` writes
    (TRITONLLM_TUNED_CONFIGS overrides)."""
    if "TRITONLLM_TUNED_CONFIGS" in os.environ:
        return Path(os.environ["TRITONLLM_TUNED_CONFIGS"])
    gpu = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
    return CONFIG_DIR / f"{gpu}__triton-{triton.__version__}.json"


def version_tuple(version: str) -> tuple[int, ...]:
    """'3.6.0' or '3.9.0+git1a2b' -> (3, 6, 0): the leading numbers, for ordering versions (() if none)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def gpu_traits() -> dict:
    """What a tuned config depends on beyond the current GPU's name: its compute capability
    (instructions, shared memory a block) and SM count (programs a wave)."""
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return {"capability": f"{major}.{minor}", "sm_count": sm_count(index)}


def _nearest_version(files: list[Path], version: str) -> Path | None:
    """Of files named NAME__triton-VERSION.json: one of `version`, else the newest older one, else
    the oldest newer one."""
    wanted = version_tuple(version)
    others = sorted((version_tuple(p.stem.rpartition("__triton-")[2]), p) for p in files)
    same = [p for v, p in others if v == wanted]
    older = [p for v, p in others if v < wanted]
    newer = [p for v, p in others if v > wanted]
    return (same or older[-1:] or newer[:1] or [None])[0]


def nearest_config_file(path: Path, traits: dict | None = None) -> Path | None:
    """`path` (GPU__triton-VERSION.json) if it exists, else the same GPU's file of the nearest other
    Triton version beside it (_nearest_version), else, where `traits` are given (gpu_traits), the
    nearest version's file of another GPU whose recorded traits are the same (an H100 SXM reads the
    H200's: both sm_90 with 132 SMs). A config holds launch parameters that every version and such
    GPU take; tuned elsewhere it may not be the best, but it is a measurement on the same kind of
    SM, which the untuned defaults are not."""
    if path.exists():
        return path
    gpu, _, version = path.stem.rpartition("__triton-")
    if not gpu:
        return None
    found = _nearest_version(list(path.parent.glob(f"{gpu}__triton-*.json")), version)
    if found is not None or traits is None:
        return found
    siblings = []
    for p in path.parent.glob("*__triton-*.json"):
        try:
            body = read_config_file(p)
        except ValueError as error:  # another GPU's broken file must not stop this one from loading
            warnings.warn(f"skipped {error}", stacklevel=2)
            continue
        if all(body.get(key) == value for key, value in traits.items()):
            siblings.append(p)
    return _nearest_version(siblings, version)


def read_config_file(path: Path) -> dict:
    """The body of a tuned-config file: a JSON object whose "kernels" maps kernel -> bucket key ->
    config; a ValueError naming the file where it is not one."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"tuned-config file {path}: {error}") from None
    kernels = body.get("kernels") if isinstance(body, dict) else None
    if not (isinstance(kernels, dict) and all(isinstance(rows, dict) for rows in kernels.values())):
        raise ValueError(f"tuned-config file {path}: not an object with \"kernels\": {{kernel: {{bucket: config}}}}")
    return body


def config_file_in_use() -> Path | None:
    """The file the tuned configs are read from: `config_path()`, or where this Triton version has
    none for the GPU, the nearest one (nearest_config_file with this GPU's traits); None under the
    interpreter or where there is no file."""
    if INTERPRET:
        return None
    return nearest_config_file(config_path(), gpu_traits() if torch.cuda.is_available() else None)


def tuned_table() -> dict[str, dict[str, dict]]:
    """The tuned configs, loaded from `config_file_in_use()` on first use (a warning names the file
    where it is another version's or another GPU's); empty where there is none."""
    global _table, _loaded
    if _table is None:
        path, wanted = config_file_in_use(), config_path()
        table = {}
        if path is not None:
            if path != wanted:
                warnings.warn(f"no tuned configs for {wanted.name}; using those of {path.name}", stacklevel=2)
            table = read_config_file(path)["kernels"]
        elif not INTERPRET and "TRITONLLM_TUNED_CONFIGS" in os.environ:
            warnings.warn(f"TRITONLLM_TUNED_CONFIGS names {wanted}, which does not exist: every kernel runs "
                          "its default configs", stacklevel=2)
        _table, _loaded = table, copy.deepcopy(table)
    return _table


def start_tuning(names) -> None:
    """Forget the loaded configs of the kernels named and tune each of their buckets on its first
    call (bench/kernels.py). Other kernels, e.g. those an anchor calls, keep their tuned configs."""
    if INTERPRET:
        raise RuntimeError("tuning needs a GPU: Triton's interpreter cannot time kernels")
    for name in names:
        tuned_table().pop(name, None)
    _tuning.update(names)


def save(path: Path | None = None) -> Path:
    """Merge the configs tuned in this process into the tuned-config file; returns its path.

    Into an existing file go only the rows this process changed since it loaded the table, so two
    tuning runs that save one after the other keep each other's rows; a new file (this Triton
    version's first) starts from the whole table, the rows borrowed from another file included. The
    file is replaced whole (a reader never sees half of it), under a lock on its folder."""
    path = Path(path or config_path())
    table = tuned_table()
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        exists = path.exists()
        if exists:
            kernels = read_config_file(path)["kernels"]
            table = {name: {key: config for key, config in rows.items() if _loaded.get(name, {}).get(key) != config}
                     for name, rows in table.items()}
        else:
            kernels = {}
        for name, rows in table.items():
            if rows:
                kernels[name] = dict(sorted({**kernels.get(name, {}), **rows}.items()))
        body = {
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            **(gpu_traits() if torch.cuda.is_available() else {}),
            "triton": triton.__version__,
            "kernels": dict(sorted(kernels.items())),
        }
        mode = path.stat().st_mode & 0o777 if exists else 0o644
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            f.write(json.dumps(body, indent=1) + "\n")
        try:
            os.chmod(f.name, mode)
            os.replace(f.name, path)
        except BaseException:
            os.unlink(f.name)
            raise
    finally:
        os.close(folder)
    return path


def autotune_enabled(name: str) -> bool:
    return (name in _tuning or os.environ.get("TRITONLLM_AUTOTUNE") == "1") and not INTERPRET


# Up to this many tokens (decode-sized calls) a tuned config is timed as a graph replay: eager launches
# would add tens of microseconds of host overhead to kernels of a few.
GRAPH_TUNING_TOKENS = 256


def graph_replay(launch):
    """launch(config) as a tuning launcher that replays it from a CUDA graph, one graph per config,
    captured after an eager call that compiles and loads its kernels: the engine replays decode
    steps so, and eager Python launch overhead would hide differences of a few microseconds."""
    graphs = {}

    def replay(config):
        key = repr(sorted(config.items()))
        if key not in graphs:
            launch(config)
            graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[key]):
                launch(config)
        graphs[key].replay()
    return replay


def tuning_launcher(launch, on_gpu: bool, tokens: int):
    """The launcher a call of `tokens` tokens tunes with: graph replays where decode-sized on a GPU
    (each config keeps the scratch its launch allocated), else launch itself."""
    return graph_replay(launch) if on_gpu and tokens <= GRAPH_TUNING_TOKENS else launch


class Tunable:
    """A kernel's config space and heuristic default, keyed by bucket.

    space(*bucket) -> list of configs to try; default(*bucket) -> the config used untuned.
    key_sets: the sets of keys a config of the kernel may carry, where a bucket's default and space do
    not show them all (linear: cuBLAS, or tiles that small buckets' spaces leave out).
    """

    def __init__(self, name: str, space, default, key_sets: list[set] | None = None):
        self.name = name
        self.space = space
        self.default = default
        self.key_sets = key_sets
        self.results: dict[str, list[tuple[dict, float]]] = {}  # bucket key -> timings of the last tune
        self.last_key: str | None = None  # the bucket of the latest call, for reports
        self._checked: dict[str, tuple[dict, bool]] = {}  # bucket key -> (tuned config, whether it is valid)
        REGISTRY[name] = self

    def config(self, bucket: tuple, launch=None, restore=()) -> dict:
        """The config for `bucket`: tuned if known; tuned now on `launch` if TRITONLLM_AUTOTUNE=1."""
        self.last_key = bucket_key(bucket)
        tuned = tuned_table().get(self.name, {}).get(self.last_key)
        if tuned is not None:
            checked = self._checked.get(self.last_key)
            if checked is None or checked[0] is not tuned:
                checked = self._checked[self.last_key] = (tuned, self._valid(bucket, tuned))
            if checked[1]:
                return tuned
        if launch is not None and autotune_enabled(self.name):
            return self.tune(bucket, launch, restore)[0][0]
        return self.default(*bucket)

    def bucket_key_sets(self, bucket: tuple) -> list[set]:
        """The key sets of the bucket's default and of each config of its space, less the register cap
        (`maxnreg`) that some spaces add."""
        return [set(self.default(*bucket))] + [set(c) - {"maxnreg"} for c in self.space(*bucket)]

    def _valid(self, bucket: tuple, tuned) -> bool:
        """Whether a tuned config carries the meta-parameters the kernel takes (one of key_sets, else
        those of the default or of a config of the bucket's space; plus at most a register cap) as
        ints; else a warning
        naming it, and the default serves (a stale or hand-edited file must not fail a launch)."""
        if isinstance(tuned, dict) and all(isinstance(value, int) for value in tuned.values()):
            if set(tuned) - {"maxnreg"} in (self.key_sets or self.bucket_key_sets(bucket)):
                return True
        warnings.warn(f"tuned config {tuned!r} of {self.name} bucket {self.last_key} in {config_file_in_use()} does "
                      f"not match the kernel's parameters: the default serves", stacklevel=3)
        return False

    def tune(self, bucket: tuple, launch, restore=()) -> list[tuple[dict, float]]:
        """Time `launch(config)` for every config of the space; record and return the results.

        restore: tensors the launch modifies in place; they are put back after each config.
        Returns [(config, median ms)] fastest first; configs that fail to compile get inf.
        """
        saved = [t.clone() for t in restore]
        results = []
        for config in self.space(*bucket):
            try:
                ms = triton.testing.do_bench(lambda: launch(config), warmup=10, rep=50, return_mode="median")
            except (triton.runtime.errors.OutOfResources, triton.CompilationError):
                ms = math.inf
            for tensor, copy in zip(restore, saved):
                tensor.copy_(copy)
            results.append((config, ms))
        results.sort(key=lambda row: row[1])
        self.results[bucket_key(bucket)] = results
        tuned_table().setdefault(self.name, {})[bucket_key(bucket)] = results[0][0]
        return results
