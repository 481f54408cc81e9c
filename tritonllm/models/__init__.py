"""Model classes by an HF config's `model_type`, and the checks of what the models implement."""
from tritonllm.kernels.paged import supported_head_dim
from tritonllm.models.qwen3 import Qwen3ForCausalLM, head_dim_of
from tritonllm.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer

MODELS = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}


def model_class(config):
    """The class for `config`, chosen by model_type as transformers chooses; `architectures`, where
    given, must name it (a Qwen3 file labelled as another model, or the reverse, would load as the
    wrong model or fail on its first tensor)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MODELS:
        raise ValueError(f"model_type={model_type!r} is not supported: supported are {', '.join(MODELS)}")
    cls = MODELS[model_type]
    architectures = getattr(config, "architectures", None)
    if architectures and cls.__name__ not in architectures:
        raise ValueError(f"architectures={architectures} disagrees with model_type={model_type!r}, "
                         f"whose model is {cls.__name__}")
    return cls


def sliding_layers(config) -> list[int]:
    """The layers HF runs with sliding-window attention: Qwen3's from max_window_layers on (or as
    layer_types says), Qwen3-MoE's all; none unless use_sliding_window."""
    if not getattr(config, "use_sliding_window", False) or getattr(config, "sliding_window", None) is None:
        return []
    layers = range(config.num_hidden_layers)
    if config.model_type == "qwen3_moe":
        return list(layers)
    types = getattr(config, "layer_types", None)
    return [i for i in layers if (types[i] == "sliding_attention" if types else i >= config.max_window_layers)]


def tensor_parallel_fields(config) -> list[str]:
    """The config's sizes that tensor parallelism splits across ranks (each must divide evenly): the
    heads, the dense MLP's width where a layer has one, the experts' width where a layer has them."""
    fields = ["num_attention_heads", "num_key_value_heads"]
    layers = range(config.num_hidden_layers)
    sparse = [config.model_type == "qwen3_moe" and is_sparse_layer(config, i) for i in layers]
    if not all(sparse):
        fields.append("intermediate_size")
    if any(sparse):
        fields.append("moe_intermediate_size")
    return fields


def check_model_config(config, max_model_len: int, kernels: str) -> None:
    """What a config asks for and these models (or the `kernels` backend) do not implement is a
    ValueError naming the field."""
    model_class(config)
    if config.model_type == "qwen3_moe" and config.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step={config.decoder_sparse_step} is invalid: it must be >= 1 (every "
                         f"decoder_sparse_step-th layer is sparse)")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} is invalid: it must be a multiple of "
                         f"num_key_value_heads={config.num_key_value_heads} (grouped-query attention)")
    head_dim = head_dim_of(config)
    if kernels == "triton" and not supported_head_dim(head_dim):
        raise ValueError(f"head_dim={head_dim} is invalid for kernels='triton': the attention kernels take a "
                         f"power of two >= 16 (kernels='reference' runs any)")
    activation = getattr(config, "hidden_act", "silu")
    if activation not in ("silu", "swish"):
        raise ValueError(f"hidden_act={activation!r} is not supported: the MLP is SiLU-and-mul ('silu')")
    sliding = sliding_layers(config)
    if sliding and config.sliding_window < max_model_len:
        # Within the window a sliding layer sees the whole context, so short enough sequences are right.
        raise ValueError(f"use_sliding_window is true (sliding_window={config.sliding_window}, layers "
                         f"{sliding[0]}-{sliding[-1]}) and tritonllm has no sliding-window attention: "
                         f"max_model_len={max_model_len} must be <= {config.sliding_window} to run it")
