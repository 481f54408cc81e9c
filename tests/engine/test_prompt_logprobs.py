"""vLLM's prompt_logprobs end to end on the tiny checkpoint, against HF transformers' float32 logits:
whole prompts and chunks, prefix hits, n samples, preemption, a failed step, an abort, a stream."""
import pytest
import torch
from serving import resolving

from tritonllm import LLM, SamplingParams

NUM_BLOCKS = 32
PROMPT = list(range(40, 75))  # 35 tokens: two full blocks of 16 and 3 more
OTHER = [5, 9, 200, 31, 31, 31, 7, 150, 2, 90, 91, 92, 93, 11, 12, 13, 14, 15, 16, 17, 18]  # 21 tokens


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(str(tiny_qwen3), max_num_seqs=8, num_kv_blocks=NUM_BLOCKS) as engine:
        yield engine


def hf_scores(hf, prompt: list[int], k: int) -> tuple[list, list, list]:
    """Each prompt token's logprob after the tokens before it, the k likeliest at each position, and
    each token's rank there (the tokens at least as likely, itself included), in float64."""
    with torch.no_grad():
        logprobs = hf(torch.tensor([prompt])).logits[0, :-1].double().log_softmax(-1)
    own = logprobs.gather(1, torch.tensor(prompt[1:])[:, None])
    values, ids = logprobs.topk(k) if k else (logprobs[:, :0], logprobs[:, :0].long())
    ranks = (logprobs >= own).sum(1).tolist()
    return own[:, 0].tolist(), [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())], ranks


def params(k: int = 0, **more) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 3, "ignore_eos": True, "prompt_logprobs": k, **more})


def assert_scores(out, hf, prompt: list[int], k: int) -> None:
    own, top, ranks = hf_scores(hf, prompt, k)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_ranks == [None] + ranks
    torch.testing.assert_close(torch.tensor(out.prompt_logprobs[1:]), torch.tensor(own), rtol=1e-4, atol=1e-4)
    if not k:
        assert out.prompt_top_logprobs is None
        return
    assert out.prompt_top_logprobs[0] is None and len(out.prompt_top_logprobs) == len(prompt)
    for i, (got, want) in enumerate(zip(out.prompt_top_logprobs[1:], top), start=1):
        assert list(got) == list(want)  # the same ids, likeliest first (the tiny model has no near ties)
        assert got.get(prompt[i], out.prompt_logprobs[i]) == out.prompt_logprobs[i]  # one token, one value
        torch.testing.assert_close(torch.tensor(list(got.values())), torch.tensor(list(want.values())), rtol=1e-4, atol=1e-4)


def run_to_end(engine, *requests) -> list:
    """Step until the engine has nothing left; the final output of each request (of one sample each)."""
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    finals = {o.request_id: o.output for o in outputs if o.finished}
    return [finals[r] for r in requests] if len(requests) > 1 else finals[requests[0]]


def assert_clean(llm, num_blocks=NUM_BLOCKS):
    assert not llm.has_unfinished() and llm.scheduler.is_finished()
    assert llm.block_manager.num_free_blocks == num_blocks


@pytest.mark.parametrize("k", [0, 1, 5])
def test_prompt_logprobs_equal_hf(llm, hf, k):
    out = llm.generate([PROMPT, OTHER], params(k), use_tqdm=False)
    assert_scores(out[0], hf, PROMPT, k)
    assert_scores(out[1], hf, OTHER, k)
    assert out[0].logprobs is None and out[0].num_cached_tokens == 0
    assert_clean(llm)


def test_without_prompt_logprobs_there_are_none(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None and out.prompt_top_logprobs is None


@pytest.mark.parametrize("budget", [7, 16, 17, 34])
def test_chunked_prefill_scores_every_position_once(tiny_qwen3, hf, budget):
    """Chunks of `budget` tokens, chunk boundaries on and off the block size and one short of the
    prompt's end; two requests share steps."""
    with LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=budget) as small:
        out = small.generate([PROMPT, OTHER], params(2), use_tqdm=False)
        assert_scores(out[0], hf, PROMPT, 2)
        assert_scores(out[1], hf, OTHER, 2)
        assert_clean(small)


def test_a_cached_prefix_is_scored_anyway_and_stays_cached(llm, hf):
    prompt = list(range(300, 333))  # a fresh prompt of 33 tokens
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    scored = llm.generate([prompt], params(3), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0  # every position's logits were computed
    assert_scores(scored, hf, prompt, 3)
    again = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == first.token_ids
    assert_clean(llm)


def test_n_samples_share_the_prompt_scores(llm, hf):
    before = llm.stats()["prefill_tokens_total"]
    outs = llm.generate([OTHER], params(2, n=3, temperature=1.0, seed=5), use_tqdm=False)
    assert len(outs) == 3
    for out in outs:
        assert_scores(out, hf, OTHER, 2)
    # The prompt is prefilled once; the other samples hit its full block and compute the rest.
    assert llm.stats()["prefill_tokens_total"] - before == len(OTHER) + 2 * (len(OTHER) - 16)
    assert_clean(llm)


def test_a_one_token_prompt_has_only_the_leading_none(llm):
    out = llm.generate([[42]], params(4), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None] and out.prompt_top_logprobs == [None]


def test_preempted_requests_keep_one_score_a_position(tiny_qwen3, hf):
    # Four 16-token prompts fill a block each; the first decode step, scheduled while the prefill's
    # scores are still in flight, needs a second block for each, and 6 blocks cannot give four:
    # sequences are preempted with their scores on the way, then prefilled again.
    with LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=6) as small:
        prompts = [list(range(20 * i + 1, 20 * i + 17)) for i in range(4)]
        ids = [small.add_request(p, params(1, max_tokens=12), stream=False) for p in prompts]
        small.step()  # the prefill launches
        small.step()  # the first decode step: preemptions while the prefill is unresolved
        assert small.scheduler.num_preemptions > 0
        outs = run_to_end(small, *ids)
        for out, prompt in zip(outs, prompts):
            assert_scores(out, hf, prompt, 1)
        assert_clean(small, 6)


def test_a_failed_step_scores_again_what_it_lost(tiny_qwen3, hf, monkeypatch):
    with LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=8) as small:
        request = small.add_request(PROMPT, params(2), stream=False)
        small.step()
        small.step()  # two chunks launched, the first resolved
        original = small.runner.launch
        monkeypatch.setattr(small.runner, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
        with pytest.raises(RuntimeError, match="injected"):
            small.step()
        monkeypatch.setattr(small.runner, "launch", original)
        assert_scores(run_to_end(small, request), hf, PROMPT, 2)
        assert_clean(small)


def test_a_step_that_fails_after_its_scores_arrived_keeps_them_once(llm, hf, monkeypatch):
    """The failure comes while the first token is resolved, after the prompt's scores were added."""
    original, calls = llm.block_manager.register_computed_blocks, []

    def fail_once(seq):
        if resolving() and not calls:  # not the registration at the prefill's launch
            calls.append(seq)
            raise RuntimeError("injected")
        return original(seq)

    request = llm.add_request(OTHER, params(2), stream=False)
    monkeypatch.setattr(llm.block_manager, "register_computed_blocks", fail_once)
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(50):  # the failure comes within a few steps
            llm.step()
    monkeypatch.undo()
    assert_scores(run_to_end(llm, request), hf, OTHER, 2)
    assert_clean(llm)


@pytest.mark.parametrize("steps", [0, 1, 2, 4])
def test_an_abort_mid_prompt_reports_none_and_leaks_nothing(tiny_qwen3, hf, steps):
    with LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=8) as small:
        request = small.add_request(PROMPT, params(1), stream=False)
        for _ in range(steps):
            small.step()
        small.abort(request)
        (out,) = [o.output for o in small.step() if o.request_id == request]
        assert out.finish_reason == "abort" and out.prompt_logprobs is None
        assert_clean(small)
        assert_scores(small.generate([OTHER], params(1), use_tqdm=False)[0], hf, OTHER, 1)


def test_a_stream_carries_them_in_each_samples_first_output(llm, hf):
    request = llm.add_request(PROMPT, params(2, max_tokens=4, n=2, temperature=1.0, seed=3))
    outputs = []
    while llm.has_unfinished():
        outputs += [o for o in llm.step() if o.request_id == request]
    for index in (0, 1):
        mine = [o for o in outputs if o.index == index]
        assert len(mine) == 4
        assert_scores(mine[0], hf, PROMPT, 2)
        assert all(o.prompt_logprobs is None and o.prompt_top_logprobs is None for o in mine[1:])
        assert_scores(mine[-1].output, hf, PROMPT, 2)
    stream = llm.stream([OTHER], params(1, max_tokens=2))  # LLM.stream's outputs carry them too
    assert_scores(next(stream), hf, OTHER, 1)
    stream.close()  # abandoned: aborted, reported by the next step
    while llm.has_unfinished():
        llm.step()
    assert_clean(llm)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="TP=2 on GPUs needs two of them; on CPU it runs under gloo")
def test_tensor_parallel_2_scores_as_hf(tiny_qwen3, hf):
    """Ranks > 0 run the LM head's gather over the scored positions with rank 0, chunk by chunk."""
    with LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=16,
             tensor_parallel_size=2) as tp:
        out = tp.generate([PROMPT, OTHER], params(2), use_tqdm=False)
    assert_scores(out[0], hf, PROMPT, 2)
    assert_scores(out[1], hf, OTHER, 2)


@pytest.mark.parametrize("value, error", [(-1, ValueError), (21, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_bad_values_name_the_field(value, error):
    with pytest.raises(error, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_tied_logits_rank_as_vllm_v1():
    # vLLM v1 counts the logits at or above the token's own: a token tied with others ranks after them.
    class Head:
        def compute_logits(self, hidden):
            return hidden

    from tritonllm.engine.prompt_logprobs import score_positions
    from tritonllm.layers.ops import backend
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]] * 4)
    ranks, logprobs, _ = score_positions(Head(), backend("reference"), logits, torch.arange(4), torch.tensor([0, 3, 1, 4]), 0)
    assert ranks.tolist() == [1, 4, 4, 5]
    assert torch.allclose(logprobs, logits.log_softmax(-1)[0, [0, 3, 1, 4]])
