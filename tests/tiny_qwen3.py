"""Tiny random Qwen3 and Qwen3-MoE checkpoints in HF layout (config, safetensors, tokenizer) for model and engine tests."""
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast
from transformers.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "tritonllm runs qwen3 with triton kernels on a paged kv cache",
    "12 + 34 = 46, 100 + 7 = 107, reverse abc = cba, sort dcba = abcd",
    "Hello, world! How are you today? I am fine, thank you.",
]


def build_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a fixed corpus: deterministic, any text round-trips."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
    )


def _save(path: Path, model_class, config_class, dtype, seed: int, **shapes) -> Path:
    path = Path(path)
    tokenizer = build_tokenizer()
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=eos_ids[0], pad_token_id=eos_ids[1],
        torch_dtype=dtype, **{"max_position_embeddings": 512, **shapes},
    )
    torch.manual_seed(seed)
    model = model_class(config).to(dtype)
    # Larger than HF's init (std 0.02) so that logits differ clearly between tokens.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 or name.endswith(".bias"):  # HF starts biases at zero
                param.normal_(0.0, 0.2)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos_ids[1])
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_qwen3(path: Path, *, tie_word_embeddings: bool = True, dtype=torch.float32, seed: int = 0,
                     **config) -> Path:
    """Write a 2-layer random Qwen3 (GQA 4/2 heads, head_dim 32) with its tokenizer to `path`; `config`
    sets other Qwen3Config fields."""
    return _save(path, Qwen3ForCausalLM, Qwen3Config, dtype, seed, intermediate_size=96, num_hidden_layers=2,
                 tie_word_embeddings=tie_word_embeddings, **config)


def build_tiny_qwen3_moe(path: Path, *, top_k: int = 2, norm_topk_prob: bool = True, dtype=torch.float32,
                         seed: int = 0) -> Path:
    """Write a 3-layer random Qwen3-MoE to `path`: 8 experts of width 48 (not a power of two), the
    top `top_k` of them, and a dense middle layer (mlp_only_layers) between two sparse ones."""
    return _save(path, Qwen3MoeForCausalLM, Qwen3MoeConfig, dtype, seed, intermediate_size=96, num_hidden_layers=3,
                 moe_intermediate_size=48, num_experts=8, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                 mlp_only_layers=[1], decoder_sparse_step=1, tie_word_embeddings=False)


def hf_prompt_ids(path, prompts: list) -> list[list[int]]:
    """Each prompt's token ids from HF's tokenizer at `path` (token-id prompts as they are): the
    expected ids of an engine test, independent of the engine's encode."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


def hf_greedy(path, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt_ids from HF transformers' float32 model (Qwen3 or Qwen3-MoE) at `path`."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def greedy_agreement(outputs: list[list[int]], expected: list[list[int]]) -> tuple[int, int]:
    """How far greedy completions follow the expected ones: (prompts whose first token matches, those of them whose
    second token matches too). The first token comes from the prefill, the second from the first decode step: for a
    fresh prompt over an e4m3 cache, the first read of the stored codes and scales (prefill runs on copies)."""
    matched = [(o, e) for o, e in zip(outputs, expected) if o[0] == e[0]]
    return len(matched), sum(o[1] == e[1] for o, e in matched)
