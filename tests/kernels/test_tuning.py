"""The tuning scheme (kernels/tuning.py): buckets, the tuned-config file, and each kernel's bucket builder."""
import json

import pytest
import torch
from kernel_utils import DEVICE, HOPPER

from tritonllm import kernels
from tritonllm.kernels import tuning
from tritonllm.kernels.decode_attention import decode_attention_bucket
from tritonllm.kernels.fused_moe import fused_moe_bucket
from tritonllm.kernels.kv_cache import store_kv_cache_bucket
from tritonllm.kernels.linear import linear_bucket
from tritonllm.kernels.logprobs import compute_logprobs_bucket
from tritonllm.kernels.moe_routing import moe_route_bucket
from tritonllm.kernels.norm import rms_norm_bucket
from tritonllm.kernels.prefill_attention import prefill_attention_bucket
from tritonllm.kernels.qk_norm_rotary import qk_norm_rotary_store_bucket
from tritonllm.kernels.rotary import rotary_embedding_bucket
from tritonllm.kernels.sampler import sample_bucket
from tritonllm.kernels.silu_and_mul import silu_and_mul_bucket

SHIPPED = sorted(tuning.CONFIG_DIR.glob("*.json"))


def parse_bucket(key):
    return tuple(int(part) if part.isdigit() else part for part in key.split("/"))


def test_pow2_buckets():
    assert [tuning.pow2(n) for n in (0, 1, 2, 3, 100, 1024, 1025)] == [1, 1, 2, 4, 128, 1024, 2048]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_configs_match_their_kernels(path):
    # A tuned config must carry exactly the meta-parameters its kernel takes today, plus at most the
    # launch options a tuning space may add (decode's register cap): those of the default, or of a
    # config of the bucket's space (linear chooses between cuBLAS and its tiles).
    body = json.loads(path.read_text())
    assert body["kernels"]
    for name, rows in body["kernels"].items():
        tunable = tuning.REGISTRY[name]
        for key, config in rows.items():
            assert set(config) - {"maxnreg"} in tunable.bucket_key_sets(parse_bucket(key)), (name, key)


@pytest.fixture
def tuned_file(tmp_path, monkeypatch):
    """A tuned-config file in use, as on a GPU (the interpreter ignores the file)."""
    path = tmp_path / "tuned.json"
    monkeypatch.setenv("TRITONLLM_TUNED_CONFIGS", str(path))
    monkeypatch.setattr(tuning, "INTERPRET", False)
    monkeypatch.setattr(tuning, "_table", None)
    return path


def test_config_comes_from_the_file_else_the_default(tuned_file, monkeypatch):
    monkeypatch.setattr(tuning, "REGISTRY", {})
    tunable = tuning.Tunable("test_kernel", lambda n: [{"BLOCK": 8}, {"BLOCK": 16}], lambda n: {"BLOCK": n})
    tuned_file.write_text(json.dumps({"gpu": "x", "triton": "y", "kernels": {"test_kernel": {"64": {"BLOCK": 16}}}}))
    assert tunable.config((64,)) == {"BLOCK": 16}
    assert tunable.config((32,)) == {"BLOCK": 32}


def test_save_merges_with_the_file(tuned_file):
    tuned_file.write_text(json.dumps({"gpu": "x", "triton": "y", "kernels": {"a": {"1": {"X": 1}, "2": {"X": 2}}}}))
    tuning.tuned_table()["a"]["2"] = {"X": 3}
    tuning.tuned_table()["b"] = {"4": {"Y": 4}}
    tuning.save()
    assert json.loads(tuned_file.read_text())["kernels"] == {"a": {"1": {"X": 1}, "2": {"X": 3}}, "b": {"4": {"Y": 4}}}


def test_version_tuple_orders_numerically():
    assert tuning.version_tuple("3.9.0+git1a2b") == (3, 9, 0)
    assert tuning.version_tuple("3.10.0") > tuning.version_tuple("3.9.1") > tuning.version_tuple("3.9")
    assert tuning.version_tuple("main") == ()


def test_nearest_config_file(tmp_path):
    for name in ("GPU__triton-3.4.0.json", "GPU__triton-3.6.0.json", "GPU__triton-3.10.0.json",
                 "OTHER__triton-3.8.0.json"):
        (tmp_path / name).write_text("{}")

    def nearest(version):
        found = tuning.nearest_config_file(tmp_path / f"GPU__triton-{version}.json")
        return found and found.name

    assert nearest("3.6.0") == "GPU__triton-3.6.0.json"  # its own
    assert nearest("3.9.0") == "GPU__triton-3.6.0.json"  # the newest older one, not another GPU's 3.8
    assert nearest("3.12.1") == "GPU__triton-3.10.0.json"  # 3.10 sorts above 3.6
    assert nearest("3.2.0") == "GPU__triton-3.4.0.json"  # none older: the oldest newer one
    assert tuning.nearest_config_file(tmp_path / "NONE__triton-3.6.0.json") is None
    assert tuning.nearest_config_file(tmp_path / "tuned.json") is None


def test_nearest_config_file_of_a_gpu_with_the_same_traits(tmp_path):
    h200 = {"capability": "9.0", "sm_count": 132}
    files = {"H200__triton-3.4.0.json": h200, "H200__triton-3.6.0.json": h200,
             "PCIE__triton-3.6.0.json": {"capability": "9.0", "sm_count": 114},
             "ADA__triton-3.6.0.json": {"capability": "8.9", "sm_count": 132}, "OLD__triton-3.6.0.json": {}}
    for name, traits in files.items():
        (tmp_path / name).write_text(json.dumps({**traits, "kernels": {}}))

    def nearest(name, traits):
        found = tuning.nearest_config_file(tmp_path / name, traits)
        return found and found.name

    assert nearest("H100__triton-3.6.0.json", h200) == "H200__triton-3.6.0.json"  # same version first
    assert nearest("H100__triton-3.5.0.json", h200) == "H200__triton-3.4.0.json"  # then the newest older one
    assert nearest("H100__triton-3.6.0.json", None) is None  # traits unknown: no other GPU's file
    assert nearest("H100__triton-3.6.0.json", {"capability": "9.0", "sm_count": 78}) is None
    assert nearest("H100__triton-3.6.0.json", {"capability": "8.9", "sm_count": 132}) == "ADA__triton-3.6.0.json"
    (tmp_path / "H100__triton-3.2.0.json").write_text(json.dumps({"kernels": {}}))
    assert nearest("H100__triton-3.6.0.json", h200) == "H100__triton-3.2.0.json"  # its own GPU's file wins


def test_save_records_the_gpu_traits(tuned_file, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "GPU")
    monkeypatch.setattr(tuning, "gpu_traits", lambda: {"capability": "9.0", "sm_count": 132})
    tuning.tuned_table()["a"] = {"1": {"X": 1}}
    body = json.loads(tuning.save().read_text())
    assert (body["gpu"], body["capability"], body["sm_count"]) == ("GPU", "9.0", 132)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_files_record_their_gpu_traits(path):
    body = json.loads(path.read_text())
    assert tuning.version_tuple(body["capability"]) >= (8, 0) and body["sm_count"] > 0


def test_another_versions_configs_load_and_save_writes_this_versions_file(tmp_path, monkeypatch):
    ours, theirs = tmp_path / "GPU__triton-3.9.0.json", tmp_path / "GPU__triton-3.6.0.json"
    theirs.write_text(json.dumps({"gpu": "GPU", "triton": "3.6.0", "kernels": {"a": {"1": {"X": 1}}}}))
    monkeypatch.setattr(tuning, "config_path", lambda: ours)
    monkeypatch.setattr(tuning, "INTERPRET", False)
    monkeypatch.setattr(tuning, "_table", None)
    with pytest.warns(UserWarning, match="GPU__triton-3.6.0.json"):
        assert tuning.tuned_table() == {"a": {"1": {"X": 1}}}
    tuning.tuned_table()["a"]["2"] = {"X": 2}
    assert tuning.save() == ours
    assert json.loads(theirs.read_text())["kernels"] == {"a": {"1": {"X": 1}}}
    assert json.loads(ours.read_text())["kernels"] == {"a": {"1": {"X": 1}, "2": {"X": 2}}}


def test_save_keeps_rows_another_process_saved_since(tuned_file):
    # Two tuning runs load the same file; each saves only what it changed, so neither reverts the other's rows.
    tuned_file.write_text(json.dumps({"gpu": "x", "triton": "y", "kernels": {"a": {"1": {"X": 1}}, "b": {"1": {"Y": 1}}}}))
    tuning.tuned_table()["a"]["1"] = {"X": 2}
    other = json.loads(tuned_file.read_text())
    other["kernels"]["b"]["1"] = {"Y": 2}  # the other run's save, after this one loaded the file
    tuned_file.write_text(json.dumps(other))
    tuning.save()
    assert json.loads(tuned_file.read_text())["kernels"] == {"a": {"1": {"X": 2}}, "b": {"1": {"Y": 2}}}
    assert list(tuned_file.parent.iterdir()) == [tuned_file]  # no temporary file left beside it


@pytest.mark.parametrize("text", ['{"gpu": "x", "kernels": {"a": {"1": {"X"', '{"gpu": "x"}', '[1]', '{"kernels": [1]}'])
def test_a_broken_file_is_an_error_naming_it_every_time(tuned_file, text):
    tuned_file.write_text(text)
    for _ in range(2):
        with pytest.raises(ValueError, match="tuned.json"):
            tuning.tuned_table()


def test_another_gpus_broken_file_is_skipped(tmp_path):
    h200 = {"capability": "9.0", "sm_count": 132}
    (tmp_path / "H200__triton-3.6.0.json").write_text(json.dumps({**h200, "kernels": {}}))
    (tmp_path / "BROKEN__triton-3.6.0.json").write_text('{"capability": "9.0", "kern')
    with pytest.warns(UserWarning, match="BROKEN"):
        found = tuning.nearest_config_file(tmp_path / "H100__triton-3.6.0.json", h200)
    assert found.name == "H200__triton-3.6.0.json"


def test_a_missing_override_file_warns(tuned_file):
    with pytest.warns(UserWarning, match="does not exist"):
        assert tuning.tuned_table() == {}


@pytest.mark.parametrize("row", [{"X": 1, "EXTRA": 2}, {}, {"X": "8"}, {"X": 1.5}, [8]])
def test_a_tuned_config_the_kernel_cannot_take_gives_the_default(tuned_file, monkeypatch, row):
    monkeypatch.setattr(tuning, "REGISTRY", {})
    tunable = tuning.Tunable("k", lambda n: [{"X": 4}, {"X": 8, "maxnreg": 128}], lambda n: {"X": n})
    tuned_file.write_text(json.dumps({"kernels": {"k": {"2": row, "4": {"X": 8, "maxnreg": 128}}}}))
    with pytest.warns(UserWarning, match="tuned config .* of k bucket 2 .*tuned.json"):
        assert tunable.config((2,)) == {"X": 2}
    assert tunable.config((4,)) == {"X": 8, "maxnreg": 128}


def test_key_sets_admit_configs_a_buckets_space_leaves_out(tuned_file, monkeypatch):
    # linear's small buckets offer only cuBLAS, yet its tiles run there too.
    monkeypatch.setattr(tuning, "REGISTRY", {})
    tunable = tuning.Tunable("k", lambda n: [], lambda n: {"X": n}, key_sets=[{"X"}, {"Y", "Z"}])
    tuned_file.write_text(json.dumps({"kernels": {"k": {"2": {"Y": 1, "Z": 2}, "4": {"Y": 1}}}}))
    assert tunable.config((2,)) == {"Y": 1, "Z": 2}
    with pytest.warns(UserWarning, match="of k bucket 4"):
        assert tunable.config((4,)) == {"X": 4}


def test_interpreter_never_tunes(monkeypatch):
    monkeypatch.setenv("TRITONLLM_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "INTERPRET", True)
    assert not tuning.autotune_enabled("sample")
    with pytest.raises(RuntimeError, match="GPU"):
        tuning.start_tuning(["sample"])


def test_tuning_run_forgets_only_the_kernels_it_tunes(tuned_file, monkeypatch):
    monkeypatch.setattr(tuning, "_tuning", set())
    tuned_file.write_text(json.dumps({"gpu": "x", "triton": "y", "kernels": {"a": {"1": {"X": 1}}, "b": {"2": {"Y": 2}}}}))
    tuning.start_tuning(["a"])
    assert tuning.tuned_table() == {"b": {"2": {"Y": 2}}}
    assert tuning.autotune_enabled("a") and not tuning.autotune_enabled("b")


def zeros(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def cache():
    return zeros(4, 16, 2, 64)


def index(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def hopper_prefill():
    if not HOPPER:
        pytest.skip("prefill_attention's Hopper path runs on sm_90 GPUs only")
    kernels.prefill_attention(zeros(5, 4, 64), cache(), cache(), index(0, 2, 5), index(2, 3), index(0, 1)[:, None],
                              max_q_len=3, path="hopper")


# Per tunable kernel: a call of its wrapper, and the bucket its exported builder gives for that call.
WRAPPERS = {
    "rms_norm": (lambda: kernels.rms_norm(zeros(5, 3, 48), zeros(48), 1e-6), rms_norm_bucket(torch.float16, 48, 15)),
    "fused_add_rms_norm": (lambda: kernels.fused_add_rms_norm(zeros(5, 48), zeros(5, 48), zeros(48), 1e-6),
                           rms_norm_bucket(torch.float16, 48, 5)),
    "silu_and_mul": (lambda: kernels.silu_and_mul(zeros(3, 200)), silu_and_mul_bucket(torch.float16, 100, 3)),
    "store_kv_cache": (lambda: kernels.store_kv_cache(zeros(3, 2, 64), zeros(3, 2, 64), cache(), cache(), index(0, 1, 2)),
                       store_kv_cache_bucket(torch.float16, 2, 64, 3)),
    "rotary_embedding": (lambda: kernels.rotary_embedding(index(0, 1, 2), zeros(3, 6, 64), zeros(3, 2, 64),
                                                          zeros(10, 64, dtype=torch.float32)),
                         rotary_embedding_bucket(torch.float16, 6, 2, 64, 3)),
    "qk_norm_rotary_store": (lambda: kernels.qk_norm_rotary_store(
        index(0, 1, 2), zeros(3, 10 * 64), zeros(64), zeros(64), 1e-6, zeros(10, 64, dtype=torch.float32), cache(),
        cache(), index(0, 1, 2), 6, 2), qk_norm_rotary_store_bucket(torch.float16, 6, 2, 64, 3)),
    "prefill_attention": (lambda: kernels.prefill_attention(zeros(5, 4, 64), cache(), cache(), index(0, 2, 5),
                                                            index(2, 3), index(0, 1)[:, None], max_q_len=3,
                                                            path="portable"),  # not Hopper's, on an H200
                          prefill_attention_bucket(torch.float16, 64, 2, 16, 3)),
    "prefill_attention_hopper": (hopper_prefill, prefill_attention_bucket(torch.float16, 64, 2, 16, 3, hopper=True)),
    "decode_attention": (lambda: kernels.decode_attention(zeros(3, 4, 64), cache(), cache(), index(1, 2, 3),
                                                          index(0, 1, 2)[:, None], max_seq_len=100),
                         decode_attention_bucket(torch.float16, 64, 2, 2, 16, 3, 100)),
    "sample": (lambda: kernels.sample(zeros(3, 100), zeros(3, dtype=torch.float32), zeros(3, dtype=torch.int64),
                                      zeros(3, dtype=torch.float32) + 1, zeros(3, dtype=torch.float32)),
               sample_bucket(torch.float16, 3, 100)),
    "compute_logprobs": (lambda: kernels.compute_logprobs(zeros(3, 100), index(0, 1, 2)),
                         compute_logprobs_bucket(torch.float16, 100)),
    "moe_route": (lambda: kernels.moe_route(zeros(3, 60), 4, True), moe_route_bucket(torch.float16, 60, 3)),
    "linear": (lambda: kernels.linear(zeros(3, 32), zeros(8, 32)), linear_bucket(torch.float16, 8, 32, 3)),
    "fused_moe": (lambda: kernels.fused_moe(zeros(3, 32), zeros(8, 96, 32), zeros(8, 32, 48),
                                            zeros(3, 2, dtype=torch.float32), index(0, 1, 2, 3, 4, 5).view(3, 2)),
                  fused_moe_bucket(torch.float16, 8, 48, 32, 3)),
}


def test_every_tunable_has_a_bucket_check():
    assert set(WRAPPERS) == set(tuning.REGISTRY)


@pytest.mark.parametrize("name", WRAPPERS)
def test_wrappers_look_up_their_exported_bucket(name):
    # Scripts that write configs for a bucket (bench/decode_workload.py) build it with the kernel's
    # own builder: a wrapper that looked up anything else would leave those configs dead.
    call, bucket = WRAPPERS[name]
    call()
    assert tuning.REGISTRY[name].last_key == tuning.bucket_key(bucket)
