"""The engine API (add_request / step / abort) and the LLM loops over it, on failure paths: aborts at
every point of a request's life, abandoned and nested streams, threads, two backends (interrupted
and failed steps: test_interrupts.py).

One engine serves a whole module, so every test also checks that the previous ones left it
serving: the next request is right and no block leaked.
"""
import subprocess
import sys
import threading

import pytest
from serving import NUM_BLOCKS, PARAMS, PROMPTS, assert_clean, assert_serving, expected, llm, run_to_end, run_to_end_outputs  # noqa: F401
from tiny_qwen3 import hf_greedy

from tritonllm import LLM, LLMEngine, SamplingParams

@pytest.mark.parametrize("steps", [0, 1, 2, 3, 4, 6, 9, 30])
def test_abort_at_every_point(llm, expected, steps):
    # 24-token steps: step 1 prefills request 0 and a chunk of 1, step 2 the rest of 1 and a chunk
    # of 2, ...; decode from step 4; request 1 is finished by step 9 (the abort is then a no-op).
    ids = [llm.add_request(p, PARAMS) for p in PROMPTS]
    tokens = {}
    for _ in range(steps):
        for out in llm.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    llm.abort(ids[1])
    llm.abort(ids[1])  # twice: a no-op
    llm.abort(10**9)  # unknown: a no-op
    for request_id, new in run_to_end(llm).items():
        tokens.setdefault(request_id, []).extend(new)
    for i in (0, 2, 3):
        assert tokens[ids[i]] == expected[i]
    assert tokens.get(ids[1], []) == expected[1][:len(tokens.get(ids[1], []))]
    assert_serving(llm, expected)


def test_abort_with_preemptions_pending(tiny_qwen3):
    # Four 14-token prompts take a block of 16 each; at their 17th token each needs a second one,
    # and 6 blocks cannot give four: preemptions on the way.
    small = LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=6)
    prompts = [list(range(20 * i + 1, 20 * i + 15)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [hf_greedy(tiny_qwen3, p, 12) for p in prompts]
    for steps in (2, 4, 6, 9):
        ids = [small.add_request(p, params) for p in prompts]
        outputs = sum((small.step() for _ in range(steps)), [])
        preempted = small.scheduler.num_preemptions
        small.abort(ids[3])
        small.abort(ids[0])
        outputs += run_to_end_outputs(small)
        for i in (1, 2):  # the survivors, preempted or not, are right
            assert sum((o.new_token_ids for o in outputs if o.request_id == ids[i]), []) == want[i]
        assert small.block_manager.num_free_blocks == 6 and not small.has_unfinished()
    assert preempted > 0
    assert [o.token_ids for o in small.generate(prompts, params, use_tqdm=False)] == want
    small.close()


@pytest.mark.parametrize("events", [0, 1, 3, 7])
def test_abandoned_stream(llm, expected, events):
    stream = llm.stream(PROMPTS, PARAMS)
    for _ in range(events):
        next(stream)
    stream.close()
    assert_serving(llm, expected)
    for i, _ in enumerate(llm.stream(PROMPTS, PARAMS)):  # a break
        if i == events:
            break
    assert_serving(llm, expected)


def test_exception_in_the_consumer(llm, expected):
    with pytest.raises(ZeroDivisionError):
        for event in llm.stream(PROMPTS, PARAMS):
            if event.new_token_ids:
                1 / 0
    assert_serving(llm, expected)


def test_the_step_api_beside_the_loops(llm, expected):
    """step() called while a stream is suspended leaves the stream its outputs, and the outputs of a
    step-API request that finishes inside a generate wait for the next step()."""
    stream = llm.stream(PROMPTS[:1], PARAMS)
    first = next(stream)
    assert all(llm.step() == [] for _ in range(8))
    assert first.new_token_ids + [t for event in stream for t in event.new_token_ids] == expected[0]
    request_id = llm.add_request(PROMPTS[1], PARAMS, stream=False)
    llm.step()
    assert [out.token_ids for out in llm.generate([PROMPTS[2]] * 3, PARAMS, use_tqdm=False)] == [expected[2]] * 3
    finished = []
    while llm.has_unfinished():
        finished += [(out.request_id, out.output.token_ids) for out in llm.step() if out.finished]
    assert finished == [(request_id, expected[1])]
    assert_clean(llm)


def test_an_abort_is_reported_by_the_next_step(llm, expected):
    """A loop following a request learns of an abort from elsewhere (another thread, a server) as
    the request's final output, finish_reason "abort", instead of waiting for it forever."""
    ids = [llm.add_request(p, PARAMS, stream=False) for p in PROMPTS]
    llm.step()
    llm.abort(ids[2])
    aborted = [out for out in llm.step() if out.request_id == ids[2]]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].output.finish_reason == "abort"
    assert aborted[0].output.prompt_token_ids == PROMPTS[2]
    finished = {out.request_id: out.output.token_ids for out in sum((llm.step() for _ in range(40)), [])}
    assert finished == {ids[i]: expected[i] for i in (0, 1, 3)}
    assert_clean(llm)


def test_abort_takes_one_id_or_a_list_and_refuses_other_types(llm, expected):
    """As vLLM's abort_request: one id or several. A string (vLLM's ids are strings) is a TypeError, not
    an unknown id ignored while the request runs on."""
    ids = [llm.add_request(p, PARAMS, stream=False) for p in PROMPTS]
    for bad in (str(ids[0]), [str(ids[0])], {ids[0]: 1}, 1.0):
        with pytest.raises(TypeError, match="request_id must be an int from add_request or a list of them"):
            llm.abort(bad)
    llm.abort(ids[1:3])
    llm.abort([])
    finals = {out.request_id: out.output for out in run_to_end_outputs(llm) if out.finished}
    assert [finals[i].finish_reason for i in ids] == ["length", "abort", "abort", "length"]
    assert [finals[ids[0]].token_ids, finals[ids[3]].token_ids] == [expected[0], expected[3]]
    with pytest.raises(TypeError, match="add_request takes \\(prompt, params, stream\\)"):
        llm.add_request("request-0", PROMPTS[0], PARAMS)  # vLLM's order
    with pytest.raises(TypeError, match=r"stream must be a bool \(True or False\), got str 'yes'"):
        llm.add_request(PROMPTS[0], PARAMS, stream="yes")  # it was taken as true
    assert_clean(llm)


def test_an_abort_keeps_the_engine_unfinished_until_reported(llm):
    """`while llm.has_unfinished(): llm.step()` sees the abort's final output."""
    request = llm.add_request(PROMPTS[0], PARAMS)
    llm.step()
    llm.abort(request)
    assert llm.has_unfinished()
    finals = [out for out in run_to_end_outputs(llm) if out.finished]
    assert [(out.request_id, out.output.finish_reason) for out in finals] == [(request, "abort")]
    assert_clean(llm)


def test_nested_calls(llm, expected):
    outer = {}
    for event in llm.stream(PROMPTS[:2], PARAMS):
        outer.setdefault(event.index, []).extend(event.new_token_ids)
        if event.index == 0 and len(outer[0]) == 2:
            inner = llm.generate(PROMPTS[2:], PARAMS, use_tqdm=False)
            assert [o.token_ids for o in inner] == expected[2:]
            nested_stream = llm.stream(PROMPTS[3:], PARAMS)
            next(nested_stream)  # and one abandoned inside
    assert [outer[0], outer[1]] == expected[:2]
    assert_serving(llm, expected)


def test_threads_share_one_llm(llm, expected):
    results, errors = {}, []

    def work(name, prompts, want):
        try:
            for _ in range(3):
                results[name] = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
                assert results[name] == want
        except Exception as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i, PROMPTS[i::2], expected[i::2])) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == {0: expected[0::2], 1: expected[1::2]}
    assert_clean(llm)


def test_two_llms_with_different_backends_interleaved(tiny_qwen3, expected):
    a = LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=NUM_BLOCKS, kernels="triton")
    b = LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=NUM_BLOCKS, kernels="reference")
    assert a.runner.ops is not b.runner.ops
    streams, got = [a.stream(PROMPTS, PARAMS), b.stream(PROMPTS, PARAMS)], [{}, {}]
    done = [False, False]
    while not all(done):
        for k in (0, 1):
            event = next(streams[k], None)
            if event is None:
                done[k] = True
            else:
                got[k].setdefault(event.index, []).extend(event.new_token_ids)
    for k in (0, 1):
        assert [got[k][i] for i in range(len(PROMPTS))] == expected
    a.close()
    b.close()


def test_engine_outputs(llm, expected):
    streamed = llm.add_request(PROMPTS[0], PARAMS)
    whole = llm.add_request(PROMPTS[1], PARAMS, stream=False)
    seen = {streamed: [], whole: []}
    while llm.has_unfinished():
        for out in llm.step():
            seen[out.request_id].append(out)
    assert [len(o.new_token_ids) for o in seen[streamed]] == [1] * 5 and seen[streamed][-1].finished
    assert len(seen[whole]) == 1 and seen[whole][0].new_token_ids == expected[1]
    final = seen[whole][0].output
    assert final.token_ids == expected[1] and final.finish_reason == "length" and final.prompt_token_ids == PROMPTS[1]
    assert final.text == llm.tokenizer.decode(expected[1], skip_special_tokens=True).rstrip("\ufffd")
    assert_clean(llm)


NO_MAIN_GUARD = """
import sys
from tritonllm import LLM
LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=16, max_num_seqs=2)
print("made")
"""


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU (gloo) path; GPU TP is tested in test_llm")
def test_tensor_parallel_without_a_main_guard_is_a_clear_error(tiny_qwen3, tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(NO_MAIN_GUARD)
    done = subprocess.run([sys.executable, str(script), str(tiny_qwen3)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "made" not in done.stdout
    assert 'if __name__ == "__main__":' in done.stderr, done.stderr[-3000:]


def test_the_step_api_closes_at_the_end_of_a_with_block(tiny_qwen3):
    # Only LLM could be used in a with block (a TypeError for LLMEngine).
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLMEngine(str(tiny_qwen3), max_num_seqs=2, num_kv_blocks=16) as engine:
        request = engine.add_request([5, 6, 7], greedy)
        tokens = run_to_end(engine)[request]
    assert tokens == hf_greedy(tiny_qwen3, [5, 6, 7], 3)
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()
