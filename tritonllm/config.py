"""Engine configuration, validated before anything is allocated."""
from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    model: str
    tensor_parallel_size: int = 1
    dtype: str | torch.dtype | None = None  # None: the checkpoint's dtype (bfloat16 for presets; float32 on CPU)
    device: str | None = None  # None: "cuda" when available, else "cpu" (Triton's interpreter)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    kv_block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from gpu_memory_utilization (GPU) or 1 GiB (CPU)
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    load_format: str = "auto"  # "auto": safetensors of the checkpoint; "dummy": random weights
    seed: int = 0
    kernels: str = "triton"  # or "reference": the PyTorch references, for side-by-side runs

    @classmethod
    def from_options(cls, model: str, **options) -> "EngineConfig":
        known = {f.name for f in fields(cls)} - {"model"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(sorted(known))}")
        return cls(model=model, **options)

    def __post_init__(self):
        def check(ok: bool, field: str, allowed: str):
            if not ok:
                raise ValueError(f"{field}={getattr(self, field)!r} is invalid: {allowed}")

        for field in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "kv_block_size", "seed"):
            if isinstance(getattr(self, field), bool) or not isinstance(getattr(self, field), int):
                raise TypeError(f"{field} must be an int, got {type(getattr(self, field)).__name__}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        check(self.device in ("cuda", "cpu"), "device", "must be 'cuda' or 'cpu'")
        check(self.device == "cpu" or torch.cuda.is_available(), "device", "'cuda' needs a CUDA GPU")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        if self.device == "cuda":
            check(self.tensor_parallel_size <= torch.cuda.device_count(), "tensor_parallel_size",
                  f"must be <= the {torch.cuda.device_count()} visible GPU(s)")
        if isinstance(self.dtype, str):
            check(self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}")
            self.dtype = DTYPES[self.dtype]
        check(self.dtype is None or self.dtype in DTYPES.values(), "dtype", f"must be one of {', '.join(DTYPES)}")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1")
        check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        check(self.kv_block_size in (16, 32, 64, 128, 256), "kv_block_size", "must be a power of two from 16 to 256")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be >= 1")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]")
        check(self.load_format in ("auto", "dummy"), "load_format", "must be 'auto' or 'dummy'")
        check(self.kernels in ("triton", "reference"), "kernels", "must be 'triton' or 'reference'")

    def resolve(self, hf_config) -> None:
        """Fill the defaults that depend on the model and check the model-dependent limits."""
        positions = hf_config.max_position_embeddings
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
        for name in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(hf_config, name)
            if heads % self.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} is invalid: it must divide {name}={heads}")
