"""Bad sampling parameters and checkpoint files fail with errors that name the field or the file (issue 16.5)."""
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from tritonllm import LLM, SamplingParams
from tritonllm.loader import build_model, load_config, load_weights
from tritonllm.validation import check


@pytest.mark.parametrize("field, value, error", [
    ("temperature", math.inf, ValueError), ("temperature", math.nan, ValueError), ("top_p", math.nan, ValueError),
    ("min_p", -math.inf, ValueError), ("temperature", "0.5", TypeError), ("top_p", None, TypeError),
    ("top_k", 2.5, TypeError), ("max_tokens", True, TypeError), ("min_tokens", "1", TypeError),
    ("stop", 123, TypeError), ("stop", [""], ValueError), ("stop", ["ok", 1], TypeError),
    ("stop_token_ids", 5, TypeError), ("stop_token_ids", "12", TypeError), ("stop_token_ids", [-1], ValueError),
    ("stop_token_ids", [1.5], TypeError), ("stop_token_ids", [True], TypeError),
    ("logprobs", "yes", TypeError), ("logprobs", 21, ValueError), ("logprobs", -1, ValueError),
    ("ignore_eos", "no", TypeError), ("top_k", -2, ValueError),
    ("seed", 1.5, TypeError), ("seed", "7", TypeError), ("temperature", 10**400, ValueError),
    ("presence_penalty", -10**400, ValueError),
])
def test_bad_sampling_params_name_the_field(field, value, error):
    with pytest.raises(error, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_vllm_spellings_are_accepted():
    """vLLM's top_k=-1 (off) and logprobs=k (the chosen token's logprob and the k most likely)."""
    p = SamplingParams(top_k=-1, logprobs=3)
    assert (p.top_k, p.logprobs, p.top_logprobs) == (0, True, 3) and p.wants_logprobs
    p.validate()
    assert (p.top_k, p.logprobs, p.top_logprobs) == (0, True, 3)
    assert (SamplingParams(logprobs=0).logprobs, SamplingParams(logprobs=0).top_logprobs) == (True, 0)
    assert SamplingParams(logprobs=np.int64(2), top_logprobs=2).top_logprobs == 2
    with pytest.raises(ValueError, match=r"SamplingParams\.logprobs=2 and top_logprobs=5 disagree"):
        SamplingParams(logprobs=2, top_logprobs=5)


def test_validate_normalizes_and_is_idempotent():
    p = SamplingParams(temperature=1, top_k=10**9, stop="###", stop_token_ids=(np.int64(5), torch.tensor(7)),
                       seed=np.int32(-3))
    assert p.stop == ["###"] and p.stop_token_ids == [5, 7] and p.seed == -3 and p.temperature == 1.0
    assert all(type(t) is int for t in p.stop_token_ids) and type(p.seed) is int and type(p.temperature) is float
    before = dataclasses.asdict(p)
    p.validate()
    assert dataclasses.asdict(p) == before
    assert SamplingParams(stop_token_ids=np.array([1, 2]), seed=2**100).stop_token_ids == [1, 2]
    p.stop, p.max_tokens = "end", 3  # fields changed after construction: the engine validates again
    p.validate()
    assert p.stop == ["end"]
    p.min_tokens = 4
    with pytest.raises(ValueError, match="min_tokens"):
        p.validate()


def test_check_converts_integer_scalars_and_rejects_bools():
    assert check("n", np.int16(3), int) == 3 and check("x", np.float32(0.5), float) == 0.5
    assert check("x", 2, float) == 2.0 and check("n", None, int, optional=True) is None
    for value in (True, np.bool_(True), torch.tensor(True)):
        with pytest.raises(TypeError, match="n must be an int"):
            check("n", value, int)
    with pytest.raises(ValueError, match=r"n=0 is invalid: must be >= 1"):
        check("n", 0, int, lambda n: n >= 1, ">= 1")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_an_unreadable_checkpoint_file_is_named(tiny_qwen3, tmp_path, damage):
    data = (tiny_qwen3 / "model.safetensors").read_bytes()
    (tmp_path / "config.json").write_text((tiny_qwen3 / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(data[:len(data) // 2] if damage == "truncated" else bytes(range(256)) * 16)
    model = build_model(load_config(str(tmp_path)), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"model\.safetensors' is unreadable: .*header"):
        load_weights(model, tmp_path)


def test_a_quantized_checkpoint_is_named_before_loading(tiny_qwen3, tmp_path):
    # As Qwen3-30B-A3B-FP8's config has it: an error before any weight is read.
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(tiny_qwen3 / "model.safetensors")
    with pytest.raises(ValueError, match=r"quantized checkpoint \(quantization_config\.quant_method 'fp8'\)"):
        LLM(str(tmp_path))
