"""A tiny random Qwen3 checkpoint in HF layout (config, safetensors, tokenizer) for model and engine tests."""
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

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


def build_tiny_qwen3(path: Path, *, tie_word_embeddings: bool = True, dtype=torch.float32, seed: int = 0) -> Path:
    """Write a 2-layer random Qwen3 (GQA 4/2 heads, head_dim 32) with its tokenizer to `path`."""
    path = Path(path)
    tokenizer = build_tokenizer()
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None, eos_token_id=eos_ids[0], pad_token_id=eos_ids[1], torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype)
    # Larger than HF's init (std 0.02) so that logits differ clearly between tokens.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos_ids[1])
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def hf_greedy(path, prompt_ids: list[int], n: int) -> list[int]:
    """n greedy tokens after prompt_ids from HF transformers' float32 Qwen3 at `path`."""
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt_ids):].tolist()
