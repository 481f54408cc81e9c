"""Steps that fail or are interrupted midway (Ctrl-C, an error from a kernel or the tokenizer, the
garbage collector closing a stream): whatever they leave, the requests that live on end with the
tokens HF gives, every loop ends, and the engine keeps serving with no block leaked."""
import gc
import weakref

import pytest
from serving import (PARAMS, PROMPTS, assert_clean, assert_serving, expected, llm, resolving,  # noqa: F401
                     run_to_end_outputs)

from tritonllm import SamplingParams
from tritonllm.engine import engine as engine_module
from tritonllm.engine.output import IncrementalText


@pytest.mark.parametrize("where, call", [("launch", 1), ("launch", 2), ("launch", 4), ("resolve", 1), ("resolve", 3),
                                         ("schedule", 1), ("schedule", 3), ("schedule", 7)])
def test_ctrl_c_during_generate(llm, expected, monkeypatch, where, call):
    """KeyboardInterrupt inside a step: while a decode step is scheduled (some rows given their slot,
    some not), while the step is launched (the previous one in flight), or while its tokens are
    brought in (some appended, some not)."""
    target = {"launch": (llm.runner, "launch"), "resolve": (llm.block_manager, "register_computed_blocks"),
              "schedule": (llm.block_manager, "can_append")}[where]
    original, calls, fired = getattr(*target), [], []

    def interrupted(*args):
        if where != "resolve" or resolving():  # a prefill's blocks are also registered at its launch
            calls.append(1)
        if len(calls) == call and not fired:
            fired.append(1)
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(*target, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert_serving(llm, expected)


def test_a_request_interrupted_mid_step_is_recomputed(llm, expected, monkeypatch):
    """A failed step loses what was in flight: live requests (here a stream's) resume from their
    known tokens and still give HF's tokens."""
    stream = llm.stream(PROMPTS[:2], PARAMS)
    got = {0: [], 1: []}
    event = next(stream)
    got[event.index] += event.new_token_ids
    original = llm.runner.launch
    monkeypatch.setattr(llm.runner, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        llm.step()
    monkeypatch.setattr(llm.runner, "launch", original)
    for event in stream:
        got[event.index] += event.new_token_ids
    assert [got[0], got[1]] == expected[:2]
    assert_clean(llm)


def test_a_failed_step_keeps_the_abort_it_had_to_report(llm, expected, monkeypatch):
    ids = [llm.add_request(p, PARAMS, stream=False) for p in PROMPTS[:2]]
    llm.step()
    llm.abort(ids[0])
    monkeypatch.setattr(llm.runner, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        llm.step()
    monkeypatch.undo()
    finals = {out.request_id: out.output for out in run_to_end_outputs(llm) if out.finished}
    assert finals[ids[0]].finish_reason == "abort" and finals[ids[1]].token_ids == expected[1]
    assert_clean(llm)


def test_a_failed_step_keeps_the_outputs_it_made_before_failing(llm, expected, monkeypatch):
    """A step fails while bringing in its tokens, after it finished one request: that request's final
    output comes from the next step (a loop waiting for it would otherwise wait forever)."""
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.add_request(PROMPTS[1], short)  # the longer context: its row comes first in a decode step
    second = llm.add_request(PROMPTS[0], PARAMS)
    seqs = [llm._requests[i].samples[0].seq for i in (first, second)]
    original, fired = llm.block_manager.register_computed_blocks, []

    def fail_after_the_first_finished(seq):
        if seq is seqs[1] and seqs[0].is_finished and not fired:
            fired.append(1)
            raise RuntimeError("injected")
        return original(seq)

    monkeypatch.setattr(llm.block_manager, "register_computed_blocks", fail_after_the_first_finished)
    outputs = []
    with pytest.raises(RuntimeError, match="injected"):
        while llm.has_unfinished():
            outputs += llm.step()
    monkeypatch.undo()
    outputs += run_to_end_outputs(llm)
    tokens = {i: sum((out.new_token_ids for out in outputs if out.request_id == i), []) for i in (first, second)}
    finals = {out.request_id: out.output for out in outputs if out.finished}
    assert tokens == {first: expected[1][:2], second: expected[0]}
    assert finals[first].finish_reason == "length" and finals[first].token_ids == expected[1][:2]
    assert_clean(llm)


@pytest.mark.parametrize("where", ["text", "output"])
def test_ctrl_c_while_a_token_finishes_its_sample(llm, expected, monkeypatch, where):
    """Interrupted while its last token's text is decoded or its final output is made, a sample
    loses nothing: the token is taken again after the recompute (not one more sampled past
    max_tokens), and the stream that follows it still ends."""
    stream = llm.stream(PROMPTS[:2], PARAMS)
    got = {0: [], 1: []}
    event = next(stream)
    got[event.index] += event.new_token_ids
    target = (IncrementalText, "update") if where == "text" else (engine_module, "step_output")
    original, fired = getattr(*target), []

    def interrupted(*args, **kwargs):
        final = kwargs.get("final", False) if where == "text" else args[2]
        if final and not fired:
            fired.append(1)
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(*target, interrupted)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(40):
            llm.step()  # the outputs go to the stream
    monkeypatch.undo()
    step_and_route, steps = llm._step_and_route, []

    def counted():
        steps.append(1)
        assert len(steps) < 40, "the stream waits for an output that never comes"
        step_and_route()

    monkeypatch.setattr(llm, "_step_and_route", counted)
    finals = {}
    for event in stream:
        got[event.index] += event.new_token_ids
        if event.finished:
            finals[event.index] = event.output
    assert [got[0], got[1]] == expected[:2]
    assert [finals[i].token_ids for i in (0, 1)] == expected[:2]
    assert all(finals[i].finish_reason == "length" for i in (0, 1))
    assert_clean(llm)


@pytest.mark.parametrize("where", ["schedule", "resolve"])
def test_a_stream_collected_inside_a_step(llm, expected, monkeypatch, where):
    """A stream dropped in a reference cycle is closed (and its request aborted) whenever the garbage
    collector runs, here in the middle of a step's scheduling or of bringing in its tokens: the
    abort waits for the step's end, so the rows the step walks stay consistent."""
    def drop_a_started_stream():
        cycle = {"stream": llm.stream(PROMPTS[:1], PARAMS)}
        cycle["self"] = cycle
        next(cycle["stream"])
        return weakref.ref(cycle["stream"])

    target = (llm.block_manager, "can_append") if where == "schedule" else (llm.block_manager, "register_computed_blocks")
    original, collected = getattr(*target), []

    def collect_then_call(*args):
        if not collected and (where == "schedule" or resolving()):
            collected.append(gc.collect())
        return original(*args)

    gc.disable()
    try:
        dropped = drop_a_started_stream()
        monkeypatch.setattr(*target, collect_then_call)
        assert [o.token_ids for o in llm.generate(PROMPTS[1:], PARAMS, use_tqdm=False)] == expected[1:]
    finally:
        gc.enable()
    monkeypatch.undo()
    assert collected and dropped() is None
    assert_clean(llm)
    assert_serving(llm, expected)


def test_a_stream_collected_while_another_loop_lets_go(llm, expected, monkeypatch):
    """Outside a step, one stream is closed, and another, dropped in a reference cycle, is collected
    while the first one's abort makes its final output. The second abort waits for the first to end:
    run inside it, its output was dropped and then written back with the first one's, so the next
    step() reported a request whose loop had ended."""
    original, collected = engine_module.step_output, []

    def collect_then_call(*args):
        if not collected:
            collected.append(gc.collect())
        return original(*args)

    gc.disable()
    try:
        closed = llm.stream(PROMPTS[:1], PARAMS)
        next(closed)
        cycle = {"stream": llm.stream(PROMPTS[1:2], PARAMS)}
        cycle["self"] = cycle
        next(cycle["stream"])
        dropped = weakref.ref(cycle["stream"])
        del cycle
        monkeypatch.setattr(engine_module, "step_output", collect_then_call)
        closed.close()
    finally:
        gc.enable()
    monkeypatch.undo()
    assert collected and dropped() is None
    assert llm.step() == []
    assert_clean(llm)
    assert_serving(llm, expected)
