"""Model classes by the `architectures` name of an HF config."""
from tritonllm.models.qwen3 import Qwen3ForCausalLM
from tritonllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS = {"Qwen3ForCausalLM": Qwen3ForCausalLM, "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}


def model_class(config):
    for name in getattr(config, "architectures", None) or []:
        if name in MODELS:
            return MODELS[name]
    raise ValueError(f"unsupported architectures {config.architectures}: supported are {sorted(MODELS)}")
