"""Bad sampling parameters and checkpoint files fail with errors that name the field or the file (issue 16.5)."""
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig
from tiny_qwen3 import hf_greedy

from tritonllm import LLM, SamplingParams
from tritonllm.sampling_params import generation_defaults
from tritonllm.config import EngineConfig
from tritonllm.loader import build_model, load_config, load_generation_config, load_weights
from tritonllm.validation import check


@pytest.mark.parametrize("field, value, error", [
    ("temperature", math.inf, ValueError), ("temperature", math.nan, ValueError), ("top_p", math.nan, ValueError),
    ("min_p", -math.inf, ValueError), ("temperature", "0.5", TypeError), ("top_p", None, TypeError),
    ("top_k", 2.5, TypeError), ("max_tokens", True, TypeError), ("min_tokens", "1", TypeError),
    ("stop", 123, TypeError), ("stop", [""], ValueError), ("stop", ["ok", 1], TypeError), ("stop", {"a": 1}, TypeError),
    ("stop_token_ids", 5, TypeError), ("stop_token_ids", "12", TypeError), ("stop_token_ids", [-1], ValueError),
    ("stop_token_ids", [1.5], TypeError), ("stop_token_ids", [True], TypeError),
    ("logprobs", "yes", TypeError), ("logprobs", 21, ValueError), ("logprobs", -1, ValueError),
    ("ignore_eos", "no", TypeError), ("top_k", -2, ValueError),
    ("seed", 1.5, TypeError), ("seed", "7", TypeError), ("temperature", 10**400, ValueError),
    ("temperature", 1e38, ValueError),  # float32 holds it, but 1 / t is subnormal: the sampler would drop top_p
    ("presence_penalty", -10**400, ValueError), ("skip_special_tokens", 0, TypeError),
    ("include_stop_str_in_output", "yes", TypeError), ("logit_bias", [(5, 1.0)], TypeError),
    ("logit_bias", {5: 101}, ValueError), ("logit_bias", {5: math.nan}, ValueError), ("logit_bias", {5: True}, TypeError),
    ("logit_bias", {-1: 1.0}, ValueError), ("logit_bias", {"5": 1.0}, TypeError), ("logit_bias", {1.5: 1.0}, TypeError),
])
def test_bad_sampling_params_name_the_field(field, value, error):
    with pytest.raises(error, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_vllm_spellings_are_accepted():
    """vLLM's top_k=-1 (off) and logprobs=k (the chosen token's logprob and the k most likely) or None (off)."""
    p = SamplingParams(top_k=-1, logprobs=3)
    assert (p.top_k, p.logprobs, p.num_top_logprobs) == (0, 3, 3) and p.wants_logprobs
    p.validate()
    assert (p.top_k, p.logprobs, p.num_top_logprobs) == (0, 3, 3)
    zero = SamplingParams(logprobs=0)
    assert zero.wants_logprobs and zero.num_top_logprobs == 0
    assert type(SamplingParams(logprobs=np.int64(2), top_logprobs=2).logprobs) is int
    assert SamplingParams(logprobs=True, top_logprobs=4).num_top_logprobs == 4
    off = SamplingParams(logprobs=None)
    assert off.logprobs is False and not off.wants_logprobs and off.num_top_logprobs == 0
    with pytest.raises(ValueError, match=r"SamplingParams\.logprobs=2 and top_logprobs=5 disagree"):
        SamplingParams(logprobs=2, top_logprobs=5)


def test_logprobs_can_be_changed_after_construction():
    """The engine validates a copy of the fields as they are when a request is added: a logprobs
    set as k and changed later means its new value, with no stale top_logprobs left behind."""
    p = SamplingParams(logprobs=5)
    p.logprobs = False
    p.validate()
    assert not p.wants_logprobs and p.num_top_logprobs == 0
    p.logprobs = 2
    p.validate()
    assert p.wants_logprobs and p.num_top_logprobs == 2
    assert dataclasses.replace(SamplingParams(logprobs=5), logprobs=2).num_top_logprobs == 2
    assert not dataclasses.replace(SamplingParams(logprobs=5), logprobs=None).wants_logprobs


def test_validate_normalizes_and_is_idempotent():
    p = SamplingParams(temperature=1, top_k=10**9, stop="###", stop_token_ids=(np.int64(5), torch.tensor(7)),
                       seed=np.int32(-3))
    assert p.stop == ["###"] and p.stop_token_ids == [5, 7] and p.seed == -3 and p.temperature == 1.0
    assert all(type(t) is int for t in p.stop_token_ids) and type(p.seed) is int and type(p.temperature) is float
    before = dataclasses.asdict(p)
    p.validate()
    assert dataclasses.asdict(p) == before
    assert SamplingParams(stop_token_ids=np.array([1, 2]), seed=2**100).stop_token_ids == [1, 2]
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    assert [SamplingParams(temperature=t).temperature for t in (0, 1e-6, 0.005, 0.01, 0.5, 2.0**126)] == [
        0, 0.01, 0.01, 0.01, 0.5, 2.0**126]
    bias = SamplingParams(logit_bias={np.int64(3): 2, 4: np.float32(-0.5)}).logit_bias
    assert bias == {3: 2.0, 4: -0.5} and all(type(t) is int and type(b) is float for t, b in bias.items())
    assert SamplingParams(logit_bias={}).logit_bias is None
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


def _with_config(source, tmp_path, **fields):
    """The checkpoint at `source` (its weights linked) with config.json fields set anew (None: removed)."""
    config = json.loads((source / "config.json").read_text())
    config.update(fields)
    config = {key: value for key, value in config.items() if value is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(source / "model.safetensors")
    return tmp_path


UNSUPPORTED = {  # a config field these models do not implement -> the error naming it, raised by LLM()
    "gelu": ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    "llama": ({"model_type": "llama"}, r"model_type='llama' is not supported: supported are qwen3, qwen3_moe"),
    "MoE label": ({"architectures": ["Qwen3MoeForCausalLM"]},
                  r"architectures=\['Qwen3MoeForCausalLM'\] disagrees with model_type='qwen3'"),
    "sliding": ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
                r"use_sliding_window is true \(sliding_window=8, layers 1-1\).*max_model_len=512 must be <= 8"),
    "head_dim 48": ({"head_dim": 48}, r"head_dim=48 is invalid for kernels='triton'"),
    "heads not in groups": ({"num_key_value_heads": 3},
                            r"num_attention_heads=4 is invalid: it must be a multiple of num_key_value_heads=3"),
    "linear rope": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                    r"rope_parameters rope_type 'linear' is not supported"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_an_unsupported_config_is_named_before_loading(tiny_qwen3, tmp_path, case):
    # Each ran as plain Qwen3 with no word (other tokens than HF's), or failed later on a tensor or in a kernel.
    fields, error = UNSUPPORTED[case]
    with pytest.raises(ValueError, match=error):
        LLM(str(_with_config(tiny_qwen3, tmp_path, **fields)))


def test_a_moe_config_without_a_sparse_step_is_named_before_loading(tiny_qwen3_moe, tmp_path):
    # decoder_sparse_step 0 was a ZeroDivisionError choosing the sparse layers (HF's model fails so too).
    with pytest.raises(ValueError, match=r"decoder_sparse_step=0 is invalid: it must be >= 1"):
        LLM(str(_with_config(tiny_qwen3_moe, tmp_path, decoder_sparse_step=0)))


@pytest.mark.parametrize("moe, field", [(False, "intermediate_size"), (True, "moe_intermediate_size")])
def test_a_width_tensor_parallelism_cannot_split_is_named_before_loading(tiny_qwen3, tiny_qwen3_moe, tmp_path, moe,
                                                                         field):
    # It failed in the spawned ranks' model build, without the field's name.
    path = _with_config(tiny_qwen3_moe if moe else tiny_qwen3, tmp_path, **{field: 47})
    config = EngineConfig.from_options(str(path), tensor_parallel_size=2, device="cpu")
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=2 is invalid: it must divide {field}=47"):
        config.resolve(load_config(str(path)))


def test_sliding_window_runs_where_it_cannot_slide(tiny_qwen3, tmp_path):
    # Sequences no longer than the window see their whole context in HF too.
    path = _with_config(tiny_qwen3, tmp_path, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                        layer_types=None)  # as released Qwen3 configs: transformers derives them
    prompt = [11, 12, 13]
    with LLM(str(path), max_model_len=8) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert out[0].token_ids == hf_greedy(path, prompt, 5)


def _damaged(source, tmp_path, edit):
    """A copy of the checkpoint at `source` whose tensors `edit` changed (in place)."""
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    return tmp_path


LAYER = "model.layers.0."


def _replace(key, change):
    return lambda tensors: tensors.__setitem__(key, change(tensors[key]).contiguous())


DAMAGE = {  # damage -> (a MoE checkpoint?, edit, the error)
    "a packed part missing (k of qkv)": (False, lambda t: t.pop(LAYER + "self_attn.k_proj.weight"),
                                         r"lacks 1 tensors, e.g. \['model.layers.0.self_attn.k_proj.weight'\]"),
    "up of gate/up missing": (False, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
                              r"\['model.layers.1.mlp.up_proj.weight'\]"),
    "one expert's up missing": (True, lambda t: t.pop(LAYER + "mlp.experts.3.up_proj.weight"),
                                r"\['model.layers.0.mlp.experts.3.up_proj.weight'\]"),
    "a q_proj of one row (would broadcast)": (False, _replace(LAYER + "self_attn.q_proj.weight", lambda w: w[:1]),
                                              r"q_proj.weight': its shape \(1, 64\) is not the \(128, 64\)"),
    "an o_proj too wide (would be cut)": (False, _replace(LAYER + "self_attn.o_proj.weight", lambda w: w.repeat(1, 2)),
                                          r"o_proj.weight': its shape \(64, 256\) is not the \(64, 128\)"),
    "an embedding of extra rows": (False, _replace("model.embed_tokens.weight", lambda w: w.repeat(2, 1)),
                                   r"embed_tokens.weight': its shape"),
    "an expert past num_experts": (True, lambda t: t.update(
        {LAYER + "mlp.experts.99.up_proj.weight": t[LAYER + "mlp.experts.0.up_proj.weight"].clone()}),
        r"experts.99.up_proj.weight' matches no part of model.layers.0.mlp.experts.w13"),
    "a tied checkpoint's own lm_head.weight, not the embedding": (False, lambda t: t.update(
        {"lm_head.weight": t["model.embed_tokens.weight"] + 0.01}), r"sets tie_word_embeddings, but its lm_head"),
    "q, k and v already packed": (False, lambda t: t.update(
        {LAYER + "self_attn.qkv_proj.weight": torch.cat([t.pop(LAYER + f"self_attn.{p}_proj.weight") for p in "qkv"])}),
        r"qkv_proj.weight' matches no part of .*\['q', 'k', 'v'\]"),
    "an int8 weight (would be cast)": (False, _replace(LAYER + "mlp.down_proj.weight", lambda w: w.to(torch.int8)),
                                       r"down_proj.weight' is I8; weights load from F16, BF16, F32, F64"),
    "an fp8 expert without its scale": (True, _replace(LAYER + "mlp.experts.1.gate_proj.weight",
                                                       lambda w: w.to(torch.float8_e4m3fn)),
                                        r"experts.1.gate_proj.weight' is F8_E4M3; .*quantized checkpoints"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_names_the_tensor(tiny_qwen3, tiny_qwen3_moe, tmp_path, damage):
    """A tensor missing, of the wrong shape or of no parameter is an error before any token: packed
    parameters (qkv, gate/up, stacked experts) used to count as loaded from one of their parts."""
    moe, edit, error = DAMAGE[damage]
    path = _damaged(tiny_qwen3_moe if moe else tiny_qwen3, tmp_path, edit)
    model = build_model(load_config(str(path)), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=error):
        load_weights(model, path)


@pytest.mark.parametrize("text, error", [("{not json", "JSONDecodeError"), ('{"metadata": {}}', "weight_map")])
def test_an_unreadable_index_or_config_is_named(tiny_qwen3, tmp_path, text, error):
    (tmp_path / "config.json").write_text((tiny_qwen3 / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(tiny_qwen3 / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(text)
    model = build_model(load_config(str(tmp_path)), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=rf"model\.safetensors\.index\.json' is unreadable: .*{error}"):
        load_weights(model, tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="config.json is unreadable"):
        load_config(str(tmp_path))


def test_unusable_configs_are_named(tiny_qwen3, tmp_path):
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(tiny_qwen3 / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 0}))
    with pytest.raises(ValueError, match=r"max_position_embeddings=0: it must be >= 1"):
        EngineConfig.from_options(str(tmp_path)).resolve(load_config(str(tmp_path)))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is unreadable"):
        load_generation_config(str(tmp_path))


def test_generation_config_defaults_are_the_sampling_fields_it_sets():
    """vLLM's request defaults from a checkpoint's generation_config: its sampling fields only, checked."""
    qwen3 = GenerationConfig(temperature=0.6, top_k=20, top_p=0.95, do_sample=True, eos_token_id=[1, 2], max_new_tokens=9)
    assert generation_defaults(qwen3) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert generation_defaults(GenerationConfig(eos_token_id=3)) == {} and generation_defaults(None) == {}
    bad = GenerationConfig(do_sample=True)
    bad.min_p = 2.0
    with pytest.raises(ValueError, match=r"generation_config.json: SamplingParams\.min_p=2.0"):
        generation_defaults(bad)
