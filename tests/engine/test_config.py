"""EngineConfig: bad options name their field, and the model argument (a folder, or a preset name
exactly) decides where the weights come from, all before anything is loaded."""
import json
import math

import numpy as np
import pytest
import torch

from tritonllm import LLM
from tritonllm.config import EngineConfig
from tritonllm.loader import load_config
from tritonllm.tiny_tasks import BUNDLED_MODEL

BUNDLED = str(BUNDLED_MODEL)


@pytest.mark.parametrize("options, error", [
    ({"max_model_len": 32.5}, TypeError), ({"max_model_len": "32"}, TypeError), ({"num_kv_blocks": 2.5}, TypeError),
    ({"gpu_memory_utilization": "0.5"}, TypeError), ({"gpu_memory_utilization": math.nan}, ValueError),
    ({"enforce_eager": "yes"}, TypeError), ({"seed": 1.0}, TypeError), ({"max_num_seqs": True}, TypeError),
    ({"max_num_seqs": 65536}, ValueError), ({"seed": 2**64}, ValueError), ({"seed": -2**63 - 1}, ValueError),
    ({"gpu_memory_utilization": 10**400}, ValueError), ({"max_num_batched_tokens": 255}, ValueError),
    ({"tensor_parallel_size": 0}, ValueError), ({"dtype": torch.int8}, ValueError), ({"dtype": 16}, TypeError),
    ({"kernels": "cuda"}, ValueError), ({"device": "tpu"}, ValueError), ({"load_format": "pt"}, ValueError),
])
def test_bad_options_name_the_field(options, error):
    [field] = options
    with pytest.raises(error, match=rf"\b{field}\b"):
        EngineConfig.from_options(BUNDLED, **options)


def test_llm_checks_its_options_before_loading():
    with pytest.raises(TypeError, match="max_model_len must be an int or None, got float 32.5"):
        LLM(BUNDLED, max_model_len=32.5)


def test_options_are_normalized():
    config = EngineConfig.from_options(BUNDLED_MODEL, max_model_len=np.int64(32), num_kv_blocks=torch.tensor(4),
                                       gpu_memory_utilization=torch.tensor(0.5), dtype=torch.bfloat16,
                                       enforce_eager=np.bool_(True))
    assert config.model == BUNDLED and type(config.max_model_len) is int and config.num_kv_blocks == 4
    assert config.enforce_eager is True
    assert config.gpu_memory_utilization == 0.5 and type(config.gpu_memory_utilization) is float
    assert EngineConfig.from_options(BUNDLED, gpu_memory_utilization=1).gpu_memory_utilization == 1.0
    assert config.dtype is torch.bfloat16
    assert EngineConfig.from_options(BUNDLED, dtype="float16").dtype is torch.float16
    # vLLM's names: "auto" is the checkpoint's dtype (resolved later), "half" and "float" torch's aliases
    assert EngineConfig.from_options(BUNDLED, dtype="auto").dtype is None
    assert EngineConfig.from_options(BUNDLED, dtype="half").dtype is torch.float16
    assert EngineConfig.from_options(BUNDLED, dtype="float").dtype is torch.float32
    assert EngineConfig.from_options(BUNDLED, dtype=torch.float32).dtype is torch.float32


def test_a_preset_name_means_random_weights(capsys):
    config = EngineConfig.from_options("qwen3-0.6b")
    assert config.load_format == "dummy"
    config.resolve(load_config(config.model))
    assert "qwen3-0.6b runs with random weights" in capsys.readouterr().err
    assert EngineConfig.from_options(BUNDLED).load_format == "auto"
    with pytest.raises(ValueError, match="load_format='auto' is invalid with preset 'qwen3-0.6b'"):
        EngineConfig.from_options("qwen3-0.6b", load_format="auto")


def test_a_model_that_is_neither_a_folder_nor_a_preset(tmp_path):
    for load in (EngineConfig.from_options, load_config):
        with pytest.raises(ValueError, match=r"'Qwen3-0.6B' does not exist.*lower-case: 'qwen3-0.6b'.*qwen3-32b"):
            load("Qwen3-0.6B")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is not a folder"):
        EngineConfig.from_options(str(tmp_path / "weights.bin"))


def test_missing_weights_fail_in_from_options(tmp_path):
    (tmp_path / "config.json").write_text((BUNDLED_MODEL / "config.json").read_text())
    with pytest.raises(ValueError, match="no .safetensors"):
        EngineConfig.from_options(tmp_path)
    shard = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
    with pytest.raises(ValueError, match=f"lacks {shard}"):
        EngineConfig.from_options(tmp_path)
    assert EngineConfig.from_options(tmp_path, load_format="dummy").load_format == "dummy"  # the folder's shape only
