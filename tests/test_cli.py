"""The command line and the bundled tiny model, end to end through subprocesses and the engine."""
import io
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer
from transformers.models.qwen3 import Qwen3ForCausalLM

from tritonllm import LLM, SamplingParams, cli
from tritonllm.tiny_tasks import BUNDLED_MODEL, EVAL_SEED, problems


def tritonllm(*args):
    return subprocess.run([sys.executable, "-m", "tritonllm", *args], capture_output=True, text=True, timeout=900)


def test_help_and_bad_arguments():
    result = tritonllm("--help")
    assert result.returncode == 0 and "generate" in result.stdout and "chat" in result.stdout
    result = tritonllm("generate", "--temperature", "hot")
    assert result.returncode == 2 and "invalid float value" in result.stderr
    result = tritonllm("generate", "--prompt", "1+1=", "--top-p", "1.5")
    assert result.returncode == 2 and "top_p" in result.stderr
    # Not a folder here, and presets go by their exact lower-case names: an error, not random weights.
    result = tritonllm("generate", "--model", "Qwen3-0.6B", "--prompt", "hi")
    assert result.returncode == 2 and "does not exist" in result.stderr and "qwen3-0.6b" in result.stderr
    assert "Traceback" not in result.stderr


def test_counts_are_checked_as_arguments(capsys):
    for option in ("--num-problems", "--tp"):
        with pytest.raises(SystemExit) as exited:
            cli.main(["generate", option, "0"])
        assert exited.value.code == 2 and f"argument {option}: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "qwen3-30b-a3b, qwen3-235b-a22b" in " ".join(capsys.readouterr().out.split())  # every preset
    script = Path(__file__).parents[1] / "bench" / "throughput.py"
    result = subprocess.run([sys.executable, script, "--max-input-len", "8"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "argument --max-input-len: must be >= 100, got 8" in result.stderr


def test_generate_runs_the_task_set():
    result = tritonllm("generate", "--num-problems", "6")
    assert result.returncode == 0, result.stderr[-2000:]
    accuracy = re.search(r"accuracy (\d+)/6", result.stdout)
    assert accuracy and int(accuracy[1]) >= 5 and "tok/s" in result.stdout
    assert "6/6" in result.stderr  # the progress bar


def test_bundled_model_scores_as_in_transformers():
    tasks = problems(40, EVAL_SEED)
    llm = LLM(str(BUNDLED_MODEL))
    outputs = llm.generate([p for p, _ in tasks], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    ours = [o.text for o in outputs]
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    model = Qwen3ForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    theirs = []
    for prompt, _ in tasks:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        theirs.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert ours == theirs
    assert sum(o == answer for o, (_, answer) in zip(ours, tasks)) >= 0.9 * len(tasks)


def test_bundled_tokenizer_skips_its_special_tokens_as_qwen3s_does():
    # <|im_start|> was a plain vocabulary entry: a reply held past EOS (min_tokens) showed it in its text.
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    special = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert tokenizer.decode([4, *special, 5], skip_special_tokens=True) == "12"
    assert tokenizer.decode([4, *special, 5]) == "1<|endoftext|><|im_start|><|im_end|>2"


def test_bundled_chat_template_gives_the_model_its_problem():
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+34="},
               {"role": "assistant", "content": "46"}, {"role": "user", "content": " sort dcab\n"}]
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert text == "sort dcab="  # the last user message only, trimmed, with its "="
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text  # every character known


class StubTokenizer:
    """A token per character of the messages' contents."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(m["content"] for m in messages)

    def encode(self, text, add_special_tokens):
        return list(text)


class StubLLM:
    """LLM for the chat loop: replies with the message reversed, and rejects "?" as the engine rejects
    characters the tokenizer lacks."""
    calls = []

    def __init__(self, model, **options):
        self.tokenizer = StubTokenizer()
        self.config = SimpleNamespace(max_model_len=64)

    def chat(self, messages, params, stream=False):
        StubLLM.calls.append(([dict(m) for m in messages], params.max_tokens, stream))
        if "?" in messages[-1]["content"]:
            raise ValueError("'?' is not in the vocabulary")
        if sum(len(m["content"]) for m in messages) + params.max_tokens > self.config.max_model_len:
            raise ValueError("the conversation is too long")
        for char in messages[-1]["content"][::-1]:
            yield SimpleNamespace(text_delta=char)


def test_chat_streams_replies_and_goes_on_after_a_bad_message(monkeypatch, capsys):
    monkeypatch.setattr("tritonllm.LLM", StubLLM)
    monkeypatch.setattr(sys, "stdin", io.StringIO("abc\nwhy?\nxy\n\nnot read\n"))
    cli.main(["chat"])
    out, err = capsys.readouterr()
    assert out.splitlines()[1:] == ["cba", "yx"] and "error: '?' is not in the vocabulary" in err
    history, max_tokens, stream = StubLLM.calls[-1]
    assert history == [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"},
                       {"role": "user", "content": "xy"}]
    assert max_tokens == 8 and stream  # an eighth of the 64 positions


def test_chat_refuses_a_tokenizer_without_a_chat_template_before_loading(monkeypatch, capsys, tmp_path):
    # It loaded the model, then answered every message with an error.
    monkeypatch.setattr("tritonllm.LLM", None)  # never called
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(SystemExit) as exited:
        cli.main(["chat", "--model", str(tmp_path)])
    assert exited.value.code == 2 and "has no chat template" in capsys.readouterr().err


def test_chat_refuses_a_max_tokens_that_leaves_no_room(monkeypatch, capsys):
    monkeypatch.setattr("tritonllm.LLM", StubLLM)
    monkeypatch.setattr(sys, "stdin", io.StringIO("abc\n"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["chat", "--max-tokens", "64"])
    assert exited.value.code == 2 and "--max-tokens 64 leaves no room" in capsys.readouterr().err
    cli.main(["chat", "--max-tokens", "63"])  # one position left for the message
    assert StubLLM.calls[-1][1] == 63


def test_chat_drops_the_oldest_exchanges_to_fit(monkeypatch, capsys):
    """64 positions, 8 for the reply: a third message of 20 characters would not fit after two exchanges of 40."""
    monkeypatch.setattr("tritonllm.LLM", StubLLM)
    monkeypatch.setattr(sys, "stdin", io.StringIO("a" * 20 + "\n" + "b" * 20 + "\n" + "c" * 20 + "\n"))
    cli.main(["chat"])
    out, err = capsys.readouterr()
    assert out.splitlines()[1:] == ["a" * 20, "b" * 20, "c" * 20]
    assert [call[0] for call in StubLLM.calls[-3:]] == [
        [{"role": "user", "content": "a" * 20}],
        [{"role": "user", "content": "b" * 20}],  # a's exchange (40) + b (20) + 8 > 64
        [{"role": "user", "content": "c" * 20}]]
    assert err.count("exchange(s) dropped to fit max_model_len=64") == 2


def test_chat_keeps_its_history_when_a_message_is_refused_as_too_long(monkeypatch, capsys):
    """64 positions, 8 for the reply: 60 characters never fit; the exchange before them must stay."""
    monkeypatch.setattr("tritonllm.LLM", StubLLM)
    monkeypatch.setattr(sys, "stdin", io.StringIO("a" * 20 + "\n" + "x" * 60 + "\n" + "b" * 10 + "\n"))
    cli.main(["chat"])
    out, err = capsys.readouterr()
    assert "error: the conversation is too long" in err and "dropped" not in err
    assert StubLLM.calls[-1][0] == [{"role": "user", "content": "a" * 20}, {"role": "assistant", "content": "a" * 20},
                                    {"role": "user", "content": "b" * 10}]


def test_serve_arguments_are_checked_before_loading(capsys):
    for args, error in ((["--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
                        (["--shutdown-timeout", "nan"], "argument --shutdown-timeout: must be >= 0.0, got nan"),
                        (["--shutdown-timeout", "-5"], "argument --shutdown-timeout: must be >= 0.0, got -5.0")):
        with pytest.raises(SystemExit) as exited:
            cli.main(["serve", *args])
        assert exited.value.code == 2 and error in capsys.readouterr().err


def test_chat_template_is_a_template_or_a_file(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert cli.chat_template_text(template) == cli.chat_template_text(str(tmp_path / "t.jinja")) == template
    assert cli.chat_template_text(None) is None
    with pytest.raises(ValueError, match=r"--chat-template '.*nothing.jinja' is neither a file nor a Jinja template"):
        cli.chat_template_text(str(tmp_path / "nothing.jinja"))


def test_a_text_prompt_for_a_model_without_a_tokenizer_is_named():
    with pytest.raises(ValueError, match=r"--prompt 'hello': this model has no tokenizer, give token ids"):
        cli.token_ids("hello")
    assert cli.token_ids(" 5 6  7 ") == [5, 6, 7]


@pytest.mark.parametrize("args, error", [(["generate", "--prompt", "hello"], "--prompt 'hello': this model has no tokenizer"),
                                         (["chat"], "has no tokenizer to chat with")])
def test_a_preset_is_refused_text_before_it_is_loaded(monkeypatch, capsys, args, error):
    """A preset has no tokenizer: text needs none of its weights to be refused (a large one takes minutes)."""
    monkeypatch.setattr("tritonllm.LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exited:
        cli.main([*args, "--model", "qwen3-0.6b"])
    assert exited.value.code == 2 and error in capsys.readouterr().err


def test_a_folder_without_weights_is_named_before_its_prompts(monkeypatch, capsys, tmp_path):
    # It was refused as "this model has no tokenizer, give token ids".
    monkeypatch.setattr("tritonllm.LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "--prompt", "hello", "--model", str(tmp_path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "has no .safetensors weights" in err and "token ids" not in err, err


def test_serve_checks_the_engine_options_before_starting_the_engine(monkeypatch, capsys):
    # The engine process found them, after the spawn and its imports, as "error: ValueError: ...".
    monkeypatch.setattr("tritonllm.server.app.EngineClient", None)  # never called
    for args, error in ((["--max-num-seqs", "0"], "max_num_seqs=0 is invalid"),
                        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization=1.5 is invalid"),
                        (["--kv-block-size", "24"], "kv_block_size=24 is invalid")):
        with pytest.raises(SystemExit) as exited:
            cli.main(["serve", "--device", "cpu", *args])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and error in err and "ValueError" not in err, err


def test_serve_refuses_a_chat_template_for_a_model_without_a_tokenizer_before_loading(monkeypatch, capsys):
    # It was refused after the engine process had loaded the model.
    monkeypatch.setattr("tritonllm.server.app.EngineClient", None)  # never called
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--model", "qwen3-0.6b", "--chat-template", "{{ messages }}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "model 'qwen3-0.6b' has no tokenizer to render chats with" in err, err


def test_serve_refuses_a_busy_port_or_an_unknown_host_before_loading(monkeypatch, capsys):
    # It loaded the model first (minutes for a real checkpoint), printed that it served, then uvicorn failed.
    monkeypatch.setattr("tritonllm.server.app.EngineClient", None)  # never called
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, where in ((["--port", str(port)], f"127.0.0.1:{port}"),
                            (["--host", "no.such.host.invalid"], "no.such.host.invalid:8000")):
            with pytest.raises(SystemExit) as exited:
                cli.main(["serve", *args])
            err = capsys.readouterr().err
            assert exited.value.code == 2 and f"cannot serve on {where} (--host, --port)" in err, err


def test_chat_into_a_pipe_its_reader_closed_ends_without_a_traceback():
    # `tritonllm chat | head -1`: the reply's write raised BrokenPipeError, printed with its traceback.
    process = subprocess.Popen([sys.executable, "-m", "tritonllm", "chat", "--device", "cpu", "--kernels", "reference"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # the reader leaves before anything is written
    _, err = process.communicate("12+34\nrev abc\n", timeout=900)
    assert process.returncode == 1 and "Traceback" not in err and "Error" not in err, err
