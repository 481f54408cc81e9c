"""Qwen3 model shapes by name (the published configs, dense and MoE), for dummy-weight runs without a checkpoint."""
from pathlib import Path

from transformers.models.qwen3 import Qwen3Config
from transformers.models.qwen3_moe import Qwen3MoeConfig

_COMMON = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=40960,
               rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
               architectures=["Qwen3ForCausalLM"])
PRESETS = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, tie_word_embeddings=False),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64, tie_word_embeddings=False),
}
_MOE = dict(num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
MOE_PRESETS = {
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32),
    "qwen3-235b-a22b": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
                            num_attention_heads=64),
}
PRESETS.update(MOE_PRESETS)


def is_preset(model: str) -> bool:
    """Whether `model` names a preset (exactly, in lower case) rather than a checkpoint folder, which
    comes first; a model that is neither is an error."""
    if Path(model).is_dir():
        return False
    if model in PRESETS:
        return True
    problem = "is not a folder" if Path(model).exists() else "does not exist"
    hint = f" (preset names are lower-case: {model.lower()!r})" if model.lower() in PRESETS else ""
    raise ValueError(f"model folder {model!r} {problem}, and it is not a preset name{hint}; "
                     f"the presets (random weights) are {', '.join(PRESETS)}")


def preset_config(name: str) -> Qwen3Config | Qwen3MoeConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
    if name in MOE_PRESETS:
        return Qwen3MoeConfig(**{**_COMMON, **_MOE, **MOE_PRESETS[name]})
    return Qwen3Config(**_COMMON, **PRESETS[name])
