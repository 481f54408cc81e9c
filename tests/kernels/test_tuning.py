import json

import pytest

import tritonllm.kernels  # noqa: F401  (registers every Tunable)
from tritonllm.kernels import tuning

SHIPPED = sorted(tuning.CONFIG_DIR.glob("*.json"))


def parse_bucket(key):
    return tuple(int(part) if part.isdigit() else part for part in key.split("/"))


def test_pow2_buckets():
    assert [tuning.pow2(n) for n in (0, 1, 2, 3, 100, 1024, 1025)] == [1, 1, 2, 4, 128, 1024, 2048]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_configs_match_their_kernels(path):
    # A tuned config must carry exactly the meta-parameters its kernel takes today.
    body = json.loads(path.read_text())
    assert body["kernels"]
    for name, rows in body["kernels"].items():
        tunable = tuning.REGISTRY[name]
        for key, config in rows.items():
            assert set(config) == set(tunable.default(*parse_bucket(key))), (name, key)


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
