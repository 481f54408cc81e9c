"""The command line and the bundled tiny model, end to end through subprocesses and the engine."""
import subprocess
import sys

import torch
from transformers import AutoTokenizer
from transformers.models.qwen3 import Qwen3ForCausalLM

from tritonllm import LLM, SamplingParams
from tritonllm.cli import BUNDLED
from tritonllm.tiny_tasks import EVAL_SEED, problems


def tritonllm(*args):
    return subprocess.run([sys.executable, "-m", "tritonllm", *args], capture_output=True, text=True, timeout=900)


def test_help_and_bad_arguments():
    result = tritonllm("--help")
    assert result.returncode == 0 and "generate" in result.stdout and "chat" in result.stdout
    result = tritonllm("generate", "--temperature", "hot")
    assert result.returncode == 2 and "invalid float value" in result.stderr
    result = tritonllm("generate", "--prompt", "1+1=", "--top-p", "1.5")
    assert result.returncode == 2 and "top_p" in result.stderr


def test_generate_runs_the_task_set():
    result = tritonllm("generate", "--num-problems", "6")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "accuracy" in result.stdout and "tok/s" in result.stdout


def test_bundled_model_scores_as_in_transformers():
    tasks = problems(40, EVAL_SEED)
    llm = LLM(str(BUNDLED))
    outputs = llm.generate([p for p, _ in tasks], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    ours = [o.text for o in outputs]
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED)
    model = Qwen3ForCausalLM.from_pretrained(BUNDLED, dtype=torch.float32)
    theirs = []
    for prompt, _ in tasks:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
        theirs.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    assert ours == theirs
    assert sum(o == answer for o, (_, answer) in zip(ours, tasks)) >= 0.9 * len(tasks)
