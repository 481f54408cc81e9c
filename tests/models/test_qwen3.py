"""Qwen3 through the kernels equals HF transformers' Qwen3ForCausalLM."""
import importlib

import pytest
import torch
from model_utils import (DEVICE, SEQ_LENS, hf_logits, load, prefill_then_decode, random_sequences,
                         tensor_parallel_2_error)
from numerics import rel_err
from tiny_qwen3 import build_tiny_qwen3
from transformers.models.qwen3 import Qwen3ForCausalLM as HFQwen3

from tritonllm.kernels import tuning
from tritonllm.kernels.linear import linear_bucket
from tritonllm.loader import build_model, init_dummy_weights, load_config
from tritonllm.models.presets import preset_config


def assert_logits_equal_hf_float32(path, model):
    """Prefill and one decode step of random sequences through `model` give HF's float32 logits."""
    sequences = random_sequences(model.config.vocab_size, SEQ_LENS)
    prefill, longer, decode = prefill_then_decode(model, sequences, torch.float32)
    expected = hf_logits(path, longer)
    offsets = [0] + torch.tensor(SEQ_LENS).cumsum(0).tolist()
    for b, n in enumerate(SEQ_LENS):
        assert rel_err(prefill[offsets[b]:offsets[b + 1]], expected[b][:n]) < 1e-4
        assert rel_err(decode[b], expected[b][n]) < 1e-4
        assert torch.equal(prefill[offsets[b]:offsets[b + 1]].argmax(-1), expected[b][:n].argmax(-1))


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_untied"])
def test_logits_equal_hf_float32(fixture, request):
    path = request.getfixturevalue(fixture)
    assert_logits_equal_hf_float32(path, load(path))


def test_attention_biases_equal_hf_float32(tmp_path):
    # attention_bias puts a bias on q, k, v and o alike (HF's Qwen3); random here, as HF starts them at zero.
    path = build_tiny_qwen3(tmp_path, attention_bias=True)
    model = load(path)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    assert_logits_equal_hf_float32(path, model)


def test_logits_close_to_hf_bfloat16(tiny_qwen3):
    model = load(tiny_qwen3, torch.bfloat16)
    sequences = random_sequences(model.config.vocab_size, SEQ_LENS)
    prefill, longer, decode = prefill_then_decode(model, sequences, torch.bfloat16)
    expected = hf_logits(tiny_qwen3, longer, torch.float32)
    offsets = [0] + torch.tensor(SEQ_LENS).cumsum(0).tolist()
    for b, n in enumerate(SEQ_LENS):
        assert rel_err(prefill[offsets[b]:offsets[b + 1]], expected[b][:n]) < 3e-2
        assert rel_err(decode[b], expected[b][n]) < 3e-2


linear_module = importlib.import_module("tritonllm.kernels.linear")  # the package exports linear, the function


class LaunchSpy:
    """Stands in for a @triton.jit kernel: counts its launches and runs it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_decode_projections_through_the_triton_linear(fixture, request, monkeypatch):
    # A tuned table that sends the decode step's projections (3 rows: qkv, o, gate/up, down, the MoE
    # router) to kernels.linear's split tiles, as the H200 table does for small batches; the prefill
    # (54 rows) stays on cuBLAS. Same logits as cuBLAS within bf16 rounding, and every layer's
    # counter buffer is zero again after the step.
    path = request.getfixturevalue(fixture)
    model = load(path, torch.bfloat16)
    sequences = random_sequences(model.config.vocab_size, SEQ_LENS)
    _, _, cublas = prefill_then_decode(model, sequences, torch.bfloat16)
    tile = {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2}
    layers = [m for m in model.modules() if hasattr(m, "split_counts")]
    buckets = {tuning.bucket_key(linear_bucket(torch.bfloat16, *m.weight.shape, len(SEQ_LENS))) for m in layers}
    monkeypatch.setattr(tuning, "_table", {"linear": dict.fromkeys(buckets, tile)})
    spy = LaunchSpy(linear_module._linear_kernel)
    monkeypatch.setattr(linear_module, "_linear_kernel", spy)
    _, _, triton_rows = prefill_then_decode(model, sequences, torch.bfloat16)
    assert spy.launches == len(layers)
    assert rel_err(triton_rows, cublas) < 2e-2
    assert all(not m.split_counts.any() for m in layers)


def test_sharded_checkpoint_loads_the_same_weights(tiny_qwen3, tmp_path):
    HFQwen3.from_pretrained(tiny_qwen3).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    whole, sharded = load(tiny_qwen3, device="cpu"), load(tmp_path, device="cpu")
    for (name, a), (_, b) in zip(whole.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpoint_without_weights_is_an_error(tiny_qwen3, tmp_path):
    (tmp_path / "config.json").write_text((tiny_qwen3 / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        load(tmp_path, device="cpu")
    with pytest.raises(ValueError, match="preset"):
        load_config("qwen3-7b")


@pytest.mark.parametrize("name, total, non_embedding", [
    ("qwen3-0.6b", 0.6e9, 0.44e9), ("qwen3-1.7b", 1.7e9, 1.4e9), ("qwen3-4b", 4.0e9, 3.6e9),
    ("qwen3-8b", 8.2e9, 6.95e9), ("qwen3-14b", 14.8e9, 13.2e9), ("qwen3-32b", 32.8e9, 31.2e9),
    ("qwen3-30b-a3b", 30.5e9, 29.9e9), ("qwen3-235b-a22b", 235e9, 234e9),
])
def test_presets_have_the_published_sizes(name, total, non_embedding):
    config = preset_config(name)
    model = build_model(config, torch.bfloat16, torch.device("meta"))
    params = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    embedding = config.vocab_size * config.hidden_size
    assert abs(params - total) / total < 0.05
    assert abs(params - embedding * (1 if config.tie_word_embeddings else 2) - non_embedding) / non_embedding < 0.05


def test_dummy_weights_are_deterministic():
    config = preset_config("qwen3-0.6b")
    config.num_hidden_layers, config.vocab_size = 1, 1000
    a, b = (build_model(config, torch.float32, torch.device("cpu")) for _ in range(2))
    init_dummy_weights(a, seed=3)
    init_dummy_weights(b, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert float(a.model.layers[0].mlp.down_proj.weight.std()) == pytest.approx(0.02, rel=0.05)


@pytest.fixture(scope="module")
def qwen3_0_6b_shaped(tmp_path_factory):
    """A random bf16 checkpoint with Qwen3-0.6B's shapes, made by transformers on the GPU (too big for
    the interpreter, so GPU only)."""
    if DEVICE == "cpu":
        pytest.skip("a 0.6B model is too big for Triton's interpreter; the tiny model covers TP on CPU")
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = HFQwen3(preset_config("qwen3-0.6b")).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("qwen3-0.6b-shaped")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "qwen3_0_6b_shaped"])
def test_tensor_parallel_2_equals_1(fixture, request, tmp_path):
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("TP=2 on GPUs needs two of them; on CPU it runs under gloo")
    path = request.getfixturevalue(fixture)
    assert tensor_parallel_2_error(path, tmp_path) < 1e-5
