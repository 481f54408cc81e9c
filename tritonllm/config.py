"""Engine configuration, validated before anything is allocated."""
import os
import sys
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path

import torch

from tritonllm.kernels.decode_attention import MAX_BATCH
from tritonllm.layers.ops import BACKENDS
from tritonllm.layers.rotary import max_positions
from tritonllm.loader import safetensors_files
from tritonllm.models import check_model_config, tensor_parallel_fields
from tritonllm.models.presets import is_preset
from tritonllm.validation import check_field

# "auto": the checkpoint's; "float" and "half" are vLLM's (and torch's) other names.
DTYPES = {"auto": None, "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16}
KERNEL_BACKENDS = tuple(BACKENDS)  # "triton", and "reference": the PyTorch references, for side-by-side runs
DEVICES = ("cuda", "cpu")
LOAD_FORMATS = ("auto", "dummy")  # safetensors of the checkpoint folder; random weights
# "auto": the model's dtype; "fp8": float8 e4m3 with a float32 scale per (token, KV head), set when stored
# "fp8_e4m3" is vLLM's name for the same cache: its users' settings carry over.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class EngineConfig:
    model: str  # a checkpoint folder, or a preset name: that shape with random weights
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas, each tensor_parallel_size ranks wide (LLM.generate splits prompts)
    dtype: str | torch.dtype | None = None  # None or "auto": the checkpoint's (presets bfloat16; float32 on CPU)
    device: str | None = None  # None: "cuda" when available, else "cpu" (Triton's interpreter)
    max_model_len: int | None = None  # None: the positions the model's rotary table covers
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    kv_block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from gpu_memory_utilization (GPU) or 1 GiB (CPU)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    load_format: str | None = None  # None: "dummy" for a preset, "auto" for a folder
    seed: int = 0
    kernels: str = "triton"  # one of KERNEL_BACKENDS
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES

    @classmethod
    def from_options(cls, model: str | os.PathLike, **options) -> "EngineConfig":
        known = {f.name for f in fields(cls)} - {"model"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(sorted(known))}")
        return cls(model=model, **options)

    def __post_init__(self):
        field = partial(check_field, self)

        def one_of(choices):
            return lambda value: value in choices, f"one of {', '.join(choices)}"

        self.model = os.fspath(self.model) if isinstance(self.model, os.PathLike) else self.model
        field("model", str)
        preset = is_preset(self.model)
        field("load_format", str, *one_of(LOAD_FORMATS), optional=True)
        if self.load_format is None:
            self.load_format = "dummy" if preset else "auto"
        if preset and self.load_format == "auto":
            raise ValueError(f"load_format='auto' is invalid with preset {self.model!r}: a preset has no checkpoint, "
                             "only random weights (leave load_format unset, or give a checkpoint folder)")
        if self.load_format == "auto":
            safetensors_files(Path(self.model))  # no weights: an error before anything is allocated
        field("device", str, *one_of(DEVICES), optional=True)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        field("device", str, lambda d: d == "cpu" or torch.cuda.is_available(), "'cpu' without a CUDA GPU")
        field("tensor_parallel_size", int, lambda n: n >= 1, ">= 1")
        field("data_parallel_size", int, lambda n: n >= 1, ">= 1")
        if self.device == "cuda" and "WORLD_SIZE" not in os.environ:  # under torchrun the ranks span hosts
            gpus = torch.cuda.device_count()
            field("tensor_parallel_size", int, lambda n: n <= gpus, f"<= the {gpus} visible GPU(s)")
            field("data_parallel_size", int, lambda n: n * self.tensor_parallel_size <= gpus,
                  f"<= the {gpus} visible GPU(s) / tensor_parallel_size {self.tensor_parallel_size}")
        if "WORLD_SIZE" in os.environ:
            world = self.tensor_parallel_size * self.data_parallel_size
            field("data_parallel_size", int, lambda n: world == int(os.environ["WORLD_SIZE"]),
                  f"such that data_parallel_size * tensor_parallel_size = WORLD_SIZE ({os.environ['WORLD_SIZE']})")
        if isinstance(self.dtype, torch.dtype):  # checked by its name
            self.dtype = {v: k for k, v in DTYPES.items()}.get(self.dtype, str(self.dtype))
        field("dtype", str, *one_of(DTYPES), optional=True)
        self.dtype = DTYPES.get(self.dtype)
        field("max_model_len", int, lambda n: n >= 1, ">= 1", optional=True)
        # A decode step runs every scheduled sequence in one attention launch, whose grid caps the batch.
        field("max_num_seqs", int, lambda n: 1 <= n <= MAX_BATCH, f"in 1..{MAX_BATCH}")
        field("max_num_batched_tokens", int, lambda n: n >= self.max_num_seqs,
              f">= max_num_seqs ({self.max_num_seqs}): a decode step takes a token of every running sequence")
        field("kv_block_size", int, lambda n: n in (16, 32, 64, 128, 256), "a power of two from 16 to 256")
        field("num_kv_blocks", int, lambda n: n >= 1, ">= 1", optional=True)
        field("gpu_memory_utilization", float, lambda u: 0 < u <= 1, "in (0, 1]")
        field("enforce_eager", bool)
        field("seed", int, lambda n: -2**63 <= n < 2**64, "in [-2**63, 2**64) (torch.manual_seed's range)")
        field("kernels", str, *one_of(KERNEL_BACKENDS))
        field("kv_cache_dtype", str, *one_of(KV_CACHE_DTYPES))
        if KV_CACHE_DTYPES[self.kv_cache_dtype] is not None and self.device == "cuda" and self.kernels == "triton":
            # Triton has no e4m3 type below compute capability 8.9 (Ada): its kernels would not compile.
            capability = torch.cuda.get_device_capability()
            field("kv_cache_dtype", str, lambda _: capability >= (8, 9),
                  f"'auto' on this GPU (compute capability {capability[0]}.{capability[1]}): "
                  f"{self.kv_cache_dtype!r} needs 8.9 or later")

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's torch dtype (the model's for "auto"; known once resolve() set the dtype)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @property
    def prefill_gather_blocks(self) -> int:
        """Most cache blocks a prefill step copies out of an fp8 cache for its attention (layers/attention.py;
        0 for a cache of the model's dtype, which is read in place): the blocks of a step's worth of new
        tokens plus a partial one a sequence. A step whose sequences hold more (long cached prefixes)
        reads the fp8 cache directly."""
        if self.cache_dtype != torch.float8_e4m3fn:
            return 0
        return -(-self.max_num_batched_tokens // self.kv_block_size) + self.max_num_seqs

    def resolve(self, hf_config) -> None:
        """Fill the defaults that depend on the model and check the model-dependent limits."""
        positions = max_positions(hf_config)  # YaRN stretches the model's context by its factor
        if positions < 1:
            raise ValueError(f"the model's config has max_position_embeddings={hf_config.max_position_embeddings}: "
                             f"it must be >= 1")
        if self.max_model_len is None:
            self.max_model_len = positions
        if self.max_model_len > positions:
            raise ValueError(f"max_model_len={self.max_model_len} is invalid: the model has {positions} positions")
        if self.dtype is None:
            # transformers 5 names it dtype (reading torch_dtype warns); older versions torch_dtype.
            default = hf_config.dtype if hasattr(hf_config, "dtype") else getattr(hf_config, "torch_dtype", None)
            default = default or torch.bfloat16
            default = DTYPES[default] if isinstance(default, str) else default
            self.dtype = torch.float32 if self.device == "cpu" else default
        check_model_config(hf_config, self.max_model_len, self.kernels)
        for name in tensor_parallel_fields(hf_config):
            size = getattr(hf_config, name)
            if size % self.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} is invalid: it must divide {name}={size}")
        if self.load_format == "dummy":
            print(f"tritonllm: {self.model} runs with random weights (load_format='dummy'): its outputs mean nothing",
                  file=sys.stderr)
