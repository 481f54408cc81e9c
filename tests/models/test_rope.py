"""Rope parameters from the config: the cos/sin table equals HF transformers' for default RoPE and YaRN,
a YaRN checkpoint decodes as HF does past its original context, and other rope types are refused by name."""
import json
import math
from types import SimpleNamespace

import pytest
import torch
from tiny_qwen3 import build_tiny_qwen3, hf_greedy
from transformers.models.qwen3 import Qwen3Config
from transformers.models.qwen3 import Qwen3ForCausalLM as HFQwen3
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from tritonllm import LLM, SamplingParams
from tritonllm.layers.rotary import RotaryEmbedding, max_positions, rope_parameters

# Qwen3's model cards: YaRN over the 32,768 pretraining positions, 4x longer.
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def qwen3_config(rope_parameters=None):
    rope = {"rope_theta": 1e6, **(rope_parameters or {"rope_type": "default"})}
    return Qwen3Config(head_dim=128, max_position_embeddings=40960, rope_parameters=rope)


def hf_table(config, positions):
    """HF's cos and sin (attention scaling included) in the table's layout: cos half, then sin half."""
    rotary = Qwen3RotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)


@pytest.mark.parametrize("rope", [
    None,
    QWEN3_YARN,
    {**QWEN3_YARN, "attention_factor": 1.5},
    {**QWEN3_YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {**QWEN3_YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 2.0},  # the original length defaults to max_position_embeddings
], ids=["default", "qwen3-yarn", "attention-factor", "betas-untruncated", "mscale", "no-original-length"])
def test_table_equals_hf(rope):
    config = qwen3_config(rope)
    table = RotaryEmbedding(config, 128).cos_sin_cache
    expected = hf_table(config, table.shape[0])
    assert table.dtype == torch.float32 and table.shape == expected.shape
    # Built on the same device in the same order of operations they agree to the bit; a float32 ulp of slack.
    torch.testing.assert_close(table, expected, rtol=0, atol=1e-6)


def test_yarn_table_covers_the_stretched_context_and_scales_attention():
    config = qwen3_config(QWEN3_YARN)
    assert max_positions(config) == 4 * 32768
    assert max_positions(qwen3_config()) == 40960
    table = RotaryEmbedding(config, 128).cos_sin_cache
    # cos^2 + sin^2 is the attention factor squared: 0.1 ln(4) + 1 for factor 4.
    norm = table[:, :64] ** 2 + table[:, 64:] ** 2
    torch.testing.assert_close(norm, torch.full_like(norm, (0.1 * math.log(4) + 1) ** 2))


@pytest.mark.parametrize("rope_scaling", [
    None, QWEN3_YARN, {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}])
def test_older_transformers_layout(rope_scaling):
    # Before transformers 5: rope_theta beside rope_scaling, whose type may be under "type".
    old = SimpleNamespace(rope_theta=1e6, rope_scaling=rope_scaling, max_position_embeddings=40960)
    new = qwen3_config(rope_scaling and QWEN3_YARN)
    assert rope_parameters(old)["rope_type"] == rope_parameters(new)["rope_type"]
    assert torch.equal(RotaryEmbedding(old, 128).cos_sin_cache, RotaryEmbedding(new, 128).cos_sin_cache)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "llama3", "longrope"])
def test_other_rope_types_are_refused_by_name(rope_type):
    for config in (SimpleNamespace(rope_parameters={"rope_type": rope_type, "factor": 2.0, "rope_theta": 1e4}),
                   SimpleNamespace(rope_theta=1e4, rope_scaling={"type": rope_type, "factor": 2.0})):
        field = "rope_parameters" if hasattr(config, "rope_parameters") else "rope_scaling"
        with pytest.raises(ValueError, match=f"{field} rope_type '{rope_type}' is not supported"):
            RotaryEmbedding(config, 32)


@pytest.fixture(scope="module")
def tiny_yarn(tmp_path_factory):
    """The tiny checkpoint with YaRN over 16 original positions stretched to 64, in Qwen3's config.json layout."""
    path = build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-yarn"))
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(max_position_embeddings=64, rope_theta=10000.0,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_yarn_greedy_equals_hf_past_the_original_context(tiny_yarn):
    prompts = [list(range(3, 27)), list(range(100, 140))]  # 24 and 40 tokens, past the 16 original positions
    assert HFQwen3.from_pretrained(tiny_yarn).config.rope_parameters["rope_type"] == "yarn"  # HF reads it as YaRN
    llm = LLM(str(tiny_yarn), num_kv_blocks=16, max_num_seqs=4)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    llm.close()
    assert [o.token_ids for o in outputs] == [hf_greedy(tiny_yarn, p, 12) for p in prompts]
