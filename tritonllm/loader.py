"""Checkpoints: HF config and safetensors (sharded or not) into the tensor-parallel model, or dummy weights.

Only safetensors are read (no pickle) and no remote code runs.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import AutoConfig, GenerationConfig

from tritonllm.layers.linear import copy_weight
from tritonllm.layers.ops import backend
from tritonllm.models import model_class
from tritonllm.models.presets import is_preset, preset_config


def load_config(model: str):
    """The HF config of a checkpoint folder, or of a preset name (qwen3-0.6b ... qwen3-32b)."""
    if is_preset(model):
        return preset_config(model)
    if not Path(model, "config.json").exists():
        raise ValueError(f"model folder {model!r} has no config.json")
    try:  # may fail as: not JSON, an unknown model_type, a field missing, a dtype torch lacks ("auto")
        config = AutoConfig.from_pretrained(model, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"model folder {model!r}: config.json is unreadable: {error!r}") from None
    # A quantized checkpoint (Qwen3-*-FP8, AWQ, GPTQ) stores codes plus scale tensors; read as plain
    # weights it would fail on the first scale tensor, after loading gigabytes.
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else type(quantization).__name__
        raise ValueError(f"model folder {model!r} is a quantized checkpoint (quantization_config.quant_method "
                         f"{method!r}): tritonllm loads float32/float16/bfloat16 weights only; use the unquantized "
                         f"checkpoint")
    return config


def load_generation_config(model: str) -> GenerationConfig | None:
    """A checkpoint folder's generation_config.json (its sampling defaults and EOS ids), if it has one."""
    if not Path(model, "generation_config.json").exists():
        return None
    try:
        return GenerationConfig.from_pretrained(model)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"model folder {model!r}: generation_config.json is unreadable: {error!r}") from None


def eos_token_ids(model: str, config, tokenizer, generation) -> tuple[int | None, set[int]]:
    """The model's EOS id (the tokenizer's; None without one) and every id that ends a completion as
    EOS: it and those of the config and generation_config (the others are stop tokens in vLLM, with
    their id as stop_reason, and here too). Ids outside the vocabulary are never sampled: dropped."""
    ids = set()
    for source in (tokenizer, config, generation):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    outside = sorted(i for i in ids if not 0 <= i < config.vocab_size)
    if outside:
        print(f"tritonllm: EOS token ids {outside} of {model!r} are outside its vocabulary [0, {config.vocab_size}): "
              f"ignored", file=sys.stderr)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    return (None if eos_id in outside else eos_id), ids.difference(outside)


def has_tokenizer(model: str) -> bool:
    """Whether a checkpoint folder carries a tokenizer (a preset has none; a name that is neither is
    is_preset's ValueError)."""
    names = ("tokenizer.json", "tokenizer_config.json")
    return not is_preset(model) and any(Path(model, name).exists() for name in names)


def build_model(config, dtype: torch.dtype, device: torch.device, kernels: str = "triton") -> nn.Module:
    """The model for `config` with uninitialized weights of `dtype` on `device` (this rank's shards),
    its layers calling the `kernels` backend ("triton" or "reference")."""
    ops = backend(kernels)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_class(config)(config, ops)
    finally:
        torch.set_default_dtype(default_dtype)


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes a weight may be stored in


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:  # not JSON, or no {"weight_map": {...}}
            raise ValueError(f"{str(index)!r} is unreadable: {type(error).__name__}: {error}") from None
        missing = [name for name in names if not (path / name).exists()]
        if missing:
            raise ValueError(f"model folder {str(path)!r} lacks {', '.join(missing)}, named by model.safetensors.index.json")
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(path)!r} has no .safetensors weights")
    return files


def open_safetensors(file: Path):
    """safe_open, naming the file when it is truncated or garbled (the library's message does not)."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as error:
        raise ValueError(f"checkpoint file {str(file)!r} is unreadable: {error}") from error


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Read the checkpoint's safetensors into the model, each rank only its shard of each tensor."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    embedding = params["model.embed_tokens.weight"]
    stored_head = None  # a tied checkpoint's own lm_head.weight, as this rank's embedding shard
    loaded = set()  # (parameter, part): a packed parameter (qkv, gate/up, stacked experts) takes several tensors
    for file in safetensors_files(Path(path)):
        with open_safetensors(file) as f:
            for name in f.keys():
                target, shard_id = model.checkpoint_target(name)
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {type(model).__name__}")
                param = params[target]
                parts = getattr(param, "shard_ids", (None,))
                if shard_id not in parts:
                    raise ValueError(f"checkpoint tensor {name!r} matches no part of {target} ({len(parts)} parts, "
                                     f"e.g. {list(parts[:3])})")
                tensor = f.get_slice(name)
                stored = tensor.get_dtype()
                if stored not in FLOAT_DTYPES:
                    # An integer or fp8 tensor is a quantized weight: cast, it would load as garbage.
                    raise ValueError(f"checkpoint tensor {name!r} is {stored}; weights load from "
                                     f"{', '.join(FLOAT_DTYPES)} (quantized checkpoints are not supported)")
                loader = getattr(param, "weight_loader", None)
                if tied and name == "lm_head.weight":  # the embedding's alias: compared with it once all is read
                    param = stored_head = torch.zeros_like(param)
                try:
                    if loader is None:
                        copy_weight(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                except ValueError as error:
                    raise ValueError(f"checkpoint tensor {name!r}: {error}") from None
                loaded.add((target, shard_id))
    missing = [model.checkpoint_name(name, part) for name, param in params.items()
               if not (tied and name == "lm_head.weight")
               for part in getattr(param, "shard_ids", (None,)) if (name, part) not in loaded]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    if stored_head is not None and not torch.equal(stored_head, embedding):
        # transformers 5 would then use the stored head; tied, the model would compute other logits.
        raise ValueError(f"checkpoint {str(path)!r}: config.json sets tie_word_embeddings, but its lm_head.weight "
                         f"differs from model.embed_tokens.weight; set tie_word_embeddings to false to use it")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks without a checkpoint: N(0, 0.02) matrices, unit norm weights."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if param.dim() == 1:
            param.data.fill_(1.0 if "norm" in name else 0.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)
