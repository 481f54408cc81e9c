"""The engine end to end on the tiny checkpoint: greedy completions equal HF transformers'."""
import gc
import re
import shutil
import socket
import subprocess
import sys
import weakref

import pytest
import torch
from parallel import ranks, running
from safetensors.torch import load_file, save_file
from tiny_qwen3 import hf_greedy, hf_prompt_ids
from tqdm import tqdm
from transformers.models.qwen3 import Qwen3ForCausalLM as HFQwen3

import tritonllm.engine.ranks
from tritonllm import LLM, SamplingParams
from tritonllm.distributed import free_port
from tritonllm.kernels import reference
from tritonllm.layers.attention import Attention

PROMPTS = ["hello world", "12 + 34 = 46, 100 + 7 =", [5], list(range(40, 80))]  # 2..40 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SMALL = {"max_num_seqs": 8}  # few CUDA graphs to capture on a GPU
two_ranks = ranks(2)


@pytest.fixture(scope="module")
def expected(tiny_qwen3):
    prompt_ids = hf_prompt_ids(tiny_qwen3, PROMPTS)
    return prompt_ids, [hf_greedy(tiny_qwen3, ids, GREEDY.max_tokens) for ids in prompt_ids]


def completions(llm, prompts=PROMPTS, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_equals_hf_and_prefix_cache_hits(tiny_qwen3, expected):
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected[1]
    assert [o.prompt_token_ids for o in outputs] == expected[0]
    assert all(o.finish_reason == "length" for o in outputs)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == expected[1]
    assert again[3].num_cached_tokens == 32  # 40 prompt tokens: two full blocks of 16 hit
    assert llm.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_the_progress_bar_shows_each_kind_of_steps_rate(tiny_qwen3, capsys, max_tokens):
    # The rates are read after every step: read when a request finished, the prefill rate stayed 0.
    with LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64) as llm:
        capsys.readouterr()
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    last = capsys.readouterr().err.rstrip().split("\r")[-1]
    rates = dict(re.findall(r"(prefill|decode)=(\d+)tok/s", last))
    assert int(rates["prefill"]) > 0 and (int(rates["decode"]) > 0) == (max_tokens > 1), last


def test_close_frees_the_weights_and_the_kv_cache(tiny_qwen3, expected):
    # A closed LLM still bound to a name held them: on a GPU the next LLM found no memory to size its cache.
    with LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64) as llm:
        assert completions(llm) == expected[1]
        attention = next(m for m in llm.runner.model.modules() if isinstance(m, Attention))
        held = [weakref.ref(t) for t in (attention.k_cache, attention.v_cache, llm.runner.model.lm_head.weight)]
        del attention
        llm.add_request(PROMPTS[0], GREEDY)  # still queued at the close
    gc.collect()
    assert all(ref() is None for ref in held)
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        completions(llm)
    assert not llm.has_unfinished()  # nothing step() could still do: `while llm.has_unfinished()` would raise


def test_chunked_prefill_gives_the_same_tokens(tiny_qwen3, expected):
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64, max_num_batched_tokens=16)
    assert completions(llm) == expected[1]


def test_prompts_queued_together_share_their_prefix(tiny_qwen3):
    # The second prompt is admitted while the first one's chunks run: it hits the two full blocks
    # they computed (registered when launched, not when the first token came back).
    shared = list(range(20, 60))
    prompts = [shared + [70, 71], shared + [80, 81]]
    with LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=16, max_num_batched_tokens=16) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outputs] == [hf_greedy(tiny_qwen3, p, GREEDY.max_tokens) for p in prompts]
        assert [o.num_cached_tokens for o in outputs] == [0, 32]
        assert llm.stats()["prefill_tokens_total"] == 42 + 10
        assert llm.block_manager.num_free_blocks == 16


def test_preemption_gives_the_same_tokens(tiny_qwen3):
    # Four 14-token prompts fit one block each; at the 17th token each needs a second one.
    prompts = [list(range(20 * i + 1, 20 * i + 15)) for i in range(4)]
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=6)
    assert completions(llm, prompts) == [hf_greedy(tiny_qwen3, p, GREEDY.max_tokens) for p in prompts]
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_free_blocks == 6


def test_reference_kernels_give_the_same_tokens(tiny_qwen3, expected):
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64, kernels="reference")
    assert llm.runner.model.model.layers[0].self_attn.attn.ops is reference  # the layers', not only the sampler's
    assert completions(llm) == expected[1]


def test_stream_yields_what_generate_returns(tiny_qwen3, expected):
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64)
    tokens = {i: [] for i in range(len(PROMPTS))}
    texts = {i: "" for i in range(len(PROMPTS))}
    finals = {}
    for event in llm.stream(PROMPTS, GREEDY):
        tokens[event.index] += event.new_token_ids
        texts[event.index] += event.text_delta
        if event.finished:
            finals[event.index] = event.output
    assert [tokens[i] for i in range(len(PROMPTS))] == expected[1] and sorted(finals) == list(range(len(PROMPTS)))
    assert [texts[i] for i in finals] == [finals[i].text for i in finals]
    # The whole decode, less a character the last token left incomplete (vLLM's detokenizer never shows one).
    assert [texts[i] for i in range(len(PROMPTS))] == [
        llm.tokenizer.decode(t, skip_special_tokens=True).rstrip("\ufffd") for t in expected[1]]


def test_sampling_params_per_request_and_seeds(tiny_qwen3, expected):
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, seed=7, ignore_eos=True)
    (alone,) = completions(llm, PROMPTS[:1], sampled)
    beside = completions(llm, [PROMPTS[3], PROMPTS[0], PROMPTS[1]], [GREEDY, sampled, GREEDY])
    assert beside[1] == alone and len(alone) == 5  # a seeded request draws the same tokens whatever runs beside it
    assert [beside[0], beside[2]] == [expected[1][3], expected[1][1]]


def test_stop_token_ids_and_logprobs(tiny_qwen3, expected):
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64)
    stop_at = expected[1][0][2]
    params = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at], logprobs=True, ignore_eos=True)
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    cut = expected[1][0].index(stop_at) + 1
    assert out.token_ids == expected[1][0][:cut] and out.finish_reason == "stop"
    model = HFQwen3.from_pretrained(tiny_qwen3, dtype=torch.float32)
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        logp = model(ids).logits[0].log_softmax(-1)
    n = len(out.prompt_token_ids)
    want = [float(logp[n - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(want, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(want), abs=1e-3)  # vLLM's CompletionOutput field


def test_stop_strings_are_cut_from_the_text(tiny_qwen3, expected):
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64)
    full = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].text
    stop = full[3:5]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, stop=stop, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == full[: full.find(stop)]
    assert out["text"] == out.text and out["token_ids"] == out.token_ids and out.get("text") == out.text
    assert "text" in out and "missing" not in out and out.get("missing", 7) == 7 and dict(out)["text"] == out.text
    with pytest.raises(KeyError):
        out["missing"]


def test_use_tqdm_takes_a_bar_factory_as_vllms_does(tiny_qwen3):
    made = []

    def bar(**options):
        made.append(options)
        return tqdm(**options)

    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64)
    assert len(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=bar)) == 2
    assert len(made) == 1 and made[0]["total"] == 2 and not made[0]["disable"]
    with pytest.raises(TypeError, match="use_tqdm must be a bool or a callable"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm="no")


def test_chat_uses_the_template(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64)
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()  # vLLM's name for it
    template = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == tokenizer.encode(template, add_special_tokens=False)
    assert out.token_ids == hf_greedy(tiny_qwen3, out.prompt_token_ids, 6)


def test_chat_takes_openai_text_parts(tiny_qwen3):
    """Text parts are joined by newlines, as vLLM joins them (the server too); other parts and a
    message without a role are errors naming the message."""
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64)
    plain = [{"role": "user", "content": "h\ni"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    want = llm.chat(plain, GREEDY, use_tqdm=False)[0]
    got = llm.chat(parts, GREEDY, use_tqdm=False)[0]
    assert (got.prompt_token_ids, got.token_ids) == (want.prompt_token_ids, want.token_ids)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)
    with pytest.raises(ValueError, match=r"messages\[1\]\[0\]"):
        llm.chat([plain, [{"content": "no role"}]], GREEDY)
    llm.close()


@two_ranks
def test_tensor_parallel_2_equals_1(tiny_qwen3, expected):
    with LLM(str(tiny_qwen3), **SMALL, tensor_parallel_size=2, num_kv_blocks=64) as llm:
        assert completions(llm) == expected[1]
    assert all(not p.is_alive() for p in llm._workers)


@two_ranks
def test_a_dead_tensor_parallel_worker_is_an_error(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), **SMALL, tensor_parallel_size=2, num_kv_blocks=64)
    llm._workers[0].kill()
    llm._workers[0].join()
    with pytest.raises(RuntimeError, match="rank 1"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.close()
    assert not torch.distributed.is_initialized()


@two_ranks
def test_a_worker_killed_during_generate_is_an_error(tiny_qwen3):
    """The worker dies while steps it must join are in flight (collectives it never enters): rank 0
    raises instead of waiting forever, and closing the LLM still releases the process group."""
    llm = LLM(str(tiny_qwen3), **SMALL, tensor_parallel_size=2, num_kv_blocks=64)
    outputs = llm.stream(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    next(outputs)
    llm._workers[0].kill()
    with pytest.raises(RuntimeError, match="rank 1"):
        for _ in outputs:
            pass
    llm.close()
    assert not torch.distributed.is_initialized()


@two_ranks
def test_a_tensor_parallel_llm_that_fails_to_load_leaves_no_process_group(tiny_qwen3, tmp_path, expected):
    """A load error on the ranks (here a missing tensor) kills the workers and closes the group made
    for them: the next LLM, of one rank or two, starts clean (it used to find the dead group)."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen3, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.self_attn.q_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e.g. \['model.layers.1.self_attn.q_proj.weight'\]"):
        LLM(str(broken), **SMALL, tensor_parallel_size=2, num_kv_blocks=64)
    assert not torch.distributed.is_initialized()
    with LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=64) as llm:
        assert completions(llm) == expected[1]
    with LLM(str(tiny_qwen3), **SMALL, tensor_parallel_size=2, num_kv_blocks=64) as llm:
        assert completions(llm) == expected[1]


def test_a_closed_llm_says_so(tiny_qwen3):
    """After close() (twice is fine) every call that would run the model is one clear error, whatever the
    parallelism (TP 1 used to go on working, TP 2 named an exited worker, DP 2 a missing process group)."""
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=16)
    llm.close()
    llm.close()
    for call in (lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False), llm.step, lambda: llm.add_request([5, 6]),
                 lambda: next(llm.stream(PROMPTS))):
        with pytest.raises(RuntimeError, match="this LLM is closed"):
            call()


@two_ranks
def test_close_and_del_leave_no_worker_or_port_and_a_second_llm_works(tiny_qwen3, expected, monkeypatch):
    ports = []
    monkeypatch.setattr(tritonllm.engine.ranks, "free_port", lambda: ports.append(free_port()) or ports[-1])
    for release in ("close", "del"):
        llm = LLM(str(tiny_qwen3), **SMALL, tensor_parallel_size=2, num_kv_blocks=64)
        assert completions(llm) == expected[1]
        workers = llm._workers
        if release == "close":
            llm.close()
        else:
            del llm
        assert not any(running(p.pid) for p in workers), release
        assert not torch.distributed.is_initialized(), release
        with socket.socket() as s:
            # Raises while the rendezvous store still listens there; SO_REUSEADDR only lets closed
            # connections in TIME_WAIT (timing-dependent, not a leak) share the port.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", ports[-1]))


EXIT_WITHOUT_CLOSE = """
import sys
from tritonllm import LLM, SamplingParams
llm = LLM(sys.argv[1], max_num_seqs=8, tensor_parallel_size=2, num_kv_blocks=64)
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
print(*[p.pid for p in llm._workers])
"""


@two_ranks
def test_exit_without_close_leaves_no_worker(tiny_qwen3):
    done = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tiny_qwen3)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 1 and not running(pids[0])


@pytest.mark.parametrize("options, match", [
    ({"max_num_seqs": 0}, "max_num_seqs"), ({"kv_block_size": 24}, "kv_block_size"), ({"dtype": "int8"}, "dtype"),
    ({"max_model_len": 10**6}, "max_model_len"), ({"tensor_parallel_size": 3}, "tensor_parallel_size"),
    ({"load_format": "pt"}, "load_format"), ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
])
def test_bad_options_are_errors(tiny_qwen3, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_qwen3), **{**SMALL, **options})


def test_checkpoint_without_weights_fails_before_loading(tiny_qwen3, tmp_path):
    (tmp_path / "config.json").write_text((tiny_qwen3 / "config.json").read_text())
    with pytest.raises(ValueError, match="no .safetensors"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="load_format='auto'"):
        LLM("qwen3-0.6b", load_format="auto")


def test_unknown_option_and_bad_requests(tiny_qwen3):
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(str(tiny_qwen3), **SMALL, max_num_sequences=4)
    llm = LLM(str(tiny_qwen3), **SMALL, num_kv_blocks=4, max_model_len=128)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[1, 10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 128 tokens"):  # a prompt past it; a max_tokens past it is capped
        llm.generate([[1] * 129], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="never fit"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=20), use_tqdm=False)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0), ("max_tokens", 0), ("min_tokens", 99),
])
def test_sampling_params_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
