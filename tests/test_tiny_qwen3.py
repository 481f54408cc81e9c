"""The tiny checkpoint fixture is a valid HF Qwen3 checkpoint: loads, round-trips text, generates."""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer
from transformers.models.qwen3 import Qwen3ForCausalLM


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_untied"])
def test_checkpoint_loads_in_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    with safe_open(path / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not config["tie_word_embeddings"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    text = "12 + 34 = 46, héllo wörld"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert max(ids) < config["vocab_size"]
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config["vocab_size"]) and torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0.1  # random weights large enough to separate tokens


def test_chat_template(tiny_qwen3):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
