"""n samples per prompt, presence / frequency / repetition penalties and top logprobs, end to end
on the tiny checkpoint, against HF transformers' logits and penalties applied by hand."""
import pytest
import torch
from tiny_qwen3 import hf_greedy

from tritonllm import LLM, SamplingParams
from tritonllm.engine.penalties import add_logit_bias
from tritonllm.engine.sequence import Sequence, SequenceStatus
from tritonllm.kernels import reference

NUM_BLOCKS = 32
PROMPT = list(range(40, 75))  # 35 tokens: two full blocks of 16 and 3 more
SHORT = [7, 8, 9, 7, 8, 9, 7]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(str(tiny_qwen3), max_num_seqs=8, num_kv_blocks=NUM_BLOCKS) as engine:
        yield engine


def greedy(**params):
    return SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": 6, **params})


def assert_clean(llm):
    assert not llm.has_unfinished() and llm.scheduler.is_finished()
    assert llm.block_manager.num_free_blocks == NUM_BLOCKS


def hf_penalized(hf, prompt, n, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """Greedy tokens with the logit bias, then the penalties, applied by hand to HF's logits
    (float64), and each chosen token's raw logprob."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            biased = logits.clone()
            for token, value in (bias or {}).items():
                biased[token] += value
            counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long), minlength=len(logits))
            seen = (counts > 0) | torch.isin(torch.arange(len(logits)), torch.tensor(prompt))
            x = torch.where(seen, torch.where(biased > 0, biased / repetition, biased * repetition), biased)
            x = x - frequency * counts - presence * (counts > 0)
            ids.append(int(x.argmax()))
            logprobs.append(float(logits.log_softmax(-1)[ids[-1]]))
    return ids[len(prompt):], logprobs


def test_n_greedy_samples_equal_n_1_and_the_prompt_is_prefilled_once(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), max_num_seqs=8, num_kv_blocks=NUM_BLOCKS)
    want = hf_greedy(tiny_qwen3, PROMPT, 6)
    before = llm.stats()
    outputs = llm.generate([PROMPT], greedy(n=3), use_tqdm=False)
    after = llm.stats()
    assert [o.token_ids for o in outputs] == [want] * 3 and [o.index for o in outputs] == [0, 1, 2]
    # Sample 0 computes the prompt; the others hit its two full blocks and compute the last 3 tokens.
    assert [o.num_cached_tokens for o in outputs] == [0, 32, 32]
    assert after["prefill_tokens_total"] - before["prefill_tokens_total"] == 35 + 2 * 3
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == 35
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 18
    assert after["num_free_kv_blocks"] == after["num_kv_blocks"] == NUM_BLOCKS and after["num_running_seqs"] == 0
    assert llm.generate([PROMPT], greedy(), use_tqdm=False)[0].token_ids == want
    llm.close()


def test_n_seeded_samples_differ_are_reproducible_and_prompt_major(llm):
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=11, n=3, ignore_eos=True)
    first = llm.generate([PROMPT, SHORT], params, use_tqdm=False)
    assert [o.index for o in first] == [0, 1, 2] * 2
    assert [o.prompt_token_ids for o in first] == [PROMPT] * 3 + [SHORT] * 3
    for outputs in (first[:3], first[3:]):
        assert len({tuple(o.token_ids) for o in outputs}) == 3
    assert [o.token_ids for o in llm.generate([PROMPT, SHORT], params, use_tqdm=False)] == [o.token_ids for o in first]
    one = SamplingParams(temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    assert llm.generate([SHORT], one, use_tqdm=False)[0].token_ids == first[3].token_ids  # sample 0 keeps the seed
    # Per-prompt params with different n: still flat and prompt-major.
    mixed = llm.generate([SHORT, PROMPT], [greedy(n=2), greedy()], use_tqdm=False)
    assert [(o.prompt_token_ids, o.index) for o in mixed] == [(SHORT, 0), (SHORT, 1), (PROMPT, 0)]
    assert_clean(llm)


def test_stream_of_n_samples(llm):
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=3, n=2, ignore_eos=True, logprobs=True)
    tokens, logprobs, finals = {}, {}, {}
    for event in llm.stream([SHORT, PROMPT], params):
        tokens.setdefault(event.index, []).extend(event.new_token_ids)
        logprobs.setdefault(event.index, []).extend(event.new_logprobs)
        assert len(event.new_logprobs) == len(event.new_token_ids)
        if event.finished:
            finals[event.index] = event.output
    generated = llm.generate([SHORT, PROMPT], params, use_tqdm=False)
    assert sorted(tokens) == [0, 1, 2, 3]
    assert [tokens[i] for i in range(4)] == [o.token_ids for o in generated] == [finals[i].token_ids for i in range(4)]
    assert [logprobs[i] for i in range(4)] == [finals[i].logprobs for i in range(4)]
    assert [finals[i].index for i in range(4)] == [0, 1, 0, 1]
    assert_clean(llm)


def test_each_sample_stops_on_its_own(llm):
    """A stop token ends each sample where it draws it past min_tokens, the others go on: the stopped
    samples are cuts of the same seeded samples without the stop (a seeded draw depends only on the
    tokens left in the race, so a sample that drew the stop within min_tokens goes another way)."""
    params = dict(temperature=1.0, max_tokens=10, seed=5, n=4, ignore_eos=True)
    full = [o.token_ids for o in llm.generate([SHORT], SamplingParams(**params), use_tqdm=False)]
    stop = full[1][3]
    outputs = llm.generate([SHORT], SamplingParams(**params, stop_token_ids=[stop], min_tokens=2), use_tqdm=False)
    for tokens, out in zip(full, outputs):
        if stop in tokens[:2]:
            assert stop not in out.token_ids[:2]
            continue
        cut = next((j for j in range(2, len(tokens)) if tokens[j] == stop), None)
        assert out.token_ids == tokens[:cut + 1 if cut is not None else None]
        assert out.finish_reason == ("length" if cut is None else "stop")
    assert outputs[1].finish_reason == "stop"
    assert_clean(llm)


@pytest.mark.parametrize("steps", [0, 1, 2, 4])
def test_abort_of_an_n_request_aborts_every_sample_and_frees_all_blocks(llm, steps):
    # Step 1 prefills sample 0, step 2 the other two (from the cache); tokens follow a step later.
    request = llm.add_request(PROMPT, greedy(n=3, max_tokens=20))
    seen = []
    for _ in range(steps):
        seen += llm.step()
    running = llm.stats()["num_running_seqs"] + llm.stats()["num_waiting_seqs"]
    assert running == 3
    llm.abort(request)
    seen += llm.step()
    assert not llm.has_unfinished()
    finals = [o for o in seen if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert all(o.request_id == request and o.output.finish_reason == "abort" and o.output.index == o.index for o in finals)
    assert llm.step() == []
    assert_clean(llm)
    assert llm.stats()["num_waiting_seqs"] == 0


def test_samples_share_the_prompt_blocks_in_a_tight_cache(tiny_qwen3):
    """5 blocks hold one sample's 3 but not two samples' 6: sample 1 hits the 2 full prompt blocks
    sample 0 holds and takes one more, so the two decode together instead of one after the other."""
    prompt = list(range(40, 80))  # 40 tokens; with 8 new ones a sample fills 3 blocks of 16
    small = LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=5)
    request = small.add_request(prompt, greedy(n=2, max_tokens=8))
    first_token, finished, outputs, step = {}, {}, {}, 0
    while small.has_unfinished():
        step += 1
        for out in small.step():
            assert out.request_id == request
            if out.new_token_ids:
                first_token.setdefault(out.index, step)
            if out.finished:
                finished[out.index], outputs[out.index] = step, out.output
    assert first_token[1] < finished[0]
    assert [outputs[i].num_cached_tokens for i in (0, 1)] == [0, 32]
    assert [outputs[i].token_ids for i in (0, 1)] == [hf_greedy(tiny_qwen3, prompt, 8)] * 2
    assert small.block_manager.num_free_blocks == 5 and small.scheduler.num_preemptions == 0
    small.close()


def test_n_samples_under_preemption(tiny_qwen3):
    # A 14-token prompt takes a block of 16; at its 17th token each sample needs a second one, and
    # 4 blocks do not give three samples two each.
    prompt = list(range(1, 15))
    small = LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=4)
    want = hf_greedy(tiny_qwen3, prompt, 10)
    outputs = small.generate([prompt], greedy(n=3, max_tokens=10), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [want] * 3
    assert small.scheduler.num_preemptions > 0 and small.block_manager.num_free_blocks == 4
    small.close()


def test_presence_and_frequency_penalties(llm, hf):
    plain = llm.generate([SHORT], greedy(max_tokens=12), use_tqdm=False)[0].token_ids
    assert len(set(plain)) < len(plain)  # greedy repeats itself here, so the penalties show
    plain_long, changed = hf_greedy(llm.config.model, PROMPT, 12), []
    for presence, frequency in [(0.0, 2.0), (2.0, 0.0), (1.5, 0.5), (-1.0, -0.5)]:
        params = greedy(max_tokens=12, presence_penalty=presence, frequency_penalty=frequency, logprobs=True)
        # Beside requests without penalties (rows left as they are) and samples of one request.
        outputs = llm.generate([SHORT, SHORT, PROMPT], [params, greedy(max_tokens=12), greedy(n=2, max_tokens=12)],
                               use_tqdm=False)
        want, raw_logprobs = hf_penalized(hf, SHORT, 12, presence, frequency)
        assert outputs[0].token_ids == want, (presence, frequency)
        assert outputs[0].logprobs == pytest.approx(raw_logprobs, abs=1e-4)  # of the raw distribution
        assert outputs[1].token_ids == plain
        assert outputs[2].token_ids == outputs[3].token_ids == plain_long
        changed.append(want != plain)
    assert changed[:3] == [True] * 3
    assert_clean(llm)


def test_logit_bias_comes_before_the_penalties(llm, hf):
    plain = llm.generate([SHORT], greedy(max_tokens=8), use_tqdm=False)[0].token_ids
    bias = {plain[0]: -1.5, plain[1]: 2.0, 3: 0.75}
    params = greedy(max_tokens=8, logit_bias=bias, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=True)
    outputs = llm.generate([SHORT, SHORT], [params, greedy(n=2, max_tokens=8)], use_tqdm=False)
    want, raw_logprobs = hf_penalized(hf, SHORT, 8, frequency=0.5, repetition=1.3, bias=bias)
    assert want != hf_penalized(hf, SHORT, 8, frequency=0.5, repetition=1.3)[0]  # the bias changes them
    assert outputs[0].token_ids == want and outputs[0].logprobs == pytest.approx(raw_logprobs, abs=1e-4)
    assert outputs[1].token_ids == outputs[2].token_ids == plain  # rows without a bias as they were
    assert_clean(llm)


def test_logit_bias_is_added_in_float32():
    """bf16 logits 17.0 are 0.125 apart: a bias of 0.05 must still break their tie."""
    class Seq:
        def __init__(self, bias):
            self.params, self.logit_bias_tensors = SamplingParams(logit_bias=bias), None
    logits = torch.full((3, 10), 17.0, dtype=torch.bfloat16)
    seqs = [Seq({6: 0.05, 2: -0.5}), Seq(None), Seq({0: 100})]
    out = add_logit_bias(logits, seqs, lambda t: t)
    want = torch.full((3, 10), 17.0)
    want[0, 6], want[0, 2], want[2, 0] = 17.05, 16.5, 117.0
    assert out.dtype == torch.float32 and torch.equal(out, want) and bool((logits == 17.0).all())
    assert add_logit_bias(logits, [Seq(None)], lambda t: t) is None
    logits = torch.zeros(1, 4)  # float32 logits are copied too: the raw ones give the logprobs
    assert add_logit_bias(logits, [Seq({1: 2.0})], lambda t: t).tolist() == [[0, 2, 0, 0]] and not logits.any()


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_repetition_penalty_with_n_and_preemption(tiny_qwen3, hf, kernels):
    # Two blocks of 16 for three samples of a 14-token prompt: the samples are preempted and
    # recomputed, and get their penalty rows back filled from their tokens.
    prompt = list(range(1, 15))
    small = LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=4, kernels=kernels)
    filled, fill = [], small.runner.penalties._assign
    small.runner.penalties._assign = lambda seqs: filled.extend(len(s.completion_token_ids) for s in seqs) or fill(seqs)
    for repetition, frequency in [(1.8, 0.0), (0.6, 0.0), (1.3, 1.0)]:
        params = greedy(n=3, max_tokens=10, repetition_penalty=repetition, frequency_penalty=frequency)
        outputs = small.generate([prompt], params, use_tqdm=False)
        want = hf_penalized(hf, prompt, 10, frequency=frequency, repetition=repetition)[0]
        assert [o.token_ids for o in outputs] == [want] * 3, repetition
    assert small.scheduler.num_preemptions > 0 and small.block_manager.num_free_blocks == 4
    assert max(filled) > 0  # a preempted sample's row was filled again from the tokens it had generated
    assert small.runner.penalties.owner  # the last request's rows: let go at the next step ...
    small.generate([prompt], greedy(max_tokens=2), use_tqdm=False)
    assert not small.runner.penalties.owner  # ... with or without penalties (finished sequences were kept)
    small.close()


def test_top_logprobs(llm, hf):
    params = greedy(top_logprobs=5, max_tokens=4)
    events = list(llm.stream([PROMPT], params))
    out = events[-1].output
    assert out.logprobs is not None and len(out.top_logprobs) == len(out.token_ids) == 4
    with torch.no_grad():
        logp = hf(torch.tensor([PROMPT + out.token_ids])).logits[0].log_softmax(-1)
    for i, (token, top) in enumerate(zip(out.token_ids, out.top_logprobs)):
        want = logp[len(PROMPT) - 1 + i].topk(5)
        assert list(top) == want.indices.tolist() and list(top)[0] == token  # greedy: the chosen token first
        assert list(top.values()) == pytest.approx(want.values.tolist(), abs=1e-4)
        assert top[token] == out.logprobs[i]  # one token, one value (two kernels sum the row in their own orders)
    assert sum((e.new_top_logprobs for e in events), []) == out.top_logprobs
    assert sum((e.new_logprobs for e in events), []) == out.logprobs
    plain = llm.generate([PROMPT], greedy(max_tokens=4), use_tqdm=False)[0]
    assert plain.token_ids == out.token_ids and plain.logprobs is None and plain.top_logprobs is None
    assert plain.cumulative_logprob is None
    assert_clean(llm)


def test_logprobs_given_as_k_then_turned_off(llm):
    params = greedy(logprobs=3, max_tokens=2)
    on = llm.generate([SHORT], params, use_tqdm=False)[0]
    assert len(on.logprobs) == 2 and [len(top) for top in on.top_logprobs] == [3, 3]
    params.logprobs = False
    off = llm.generate([SHORT], params, use_tqdm=False)[0]
    assert off.logprobs is None and off.top_logprobs is None and off.token_ids == on.token_ids
    assert_clean(llm)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 129), ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0), ("repetition_penalty", 1e39), ("repetition_penalty", 1e-39), ("top_logprobs", 21),
    ("top_logprobs", -1),
])
def test_invalid_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_wrong_types_are_type_errors(llm):
    with pytest.raises(TypeError, match="n must be an int"):
        SamplingParams(n=2.0)
    with pytest.raises(TypeError, match=r"logprobs must be a bool, None, or an int k in \[0, 20\]; got float 3.0"):
        SamplingParams(logprobs=3.0)
    params = greedy()
    params.top_logprobs = 30
    with pytest.raises(ValueError, match="top_logprobs"):
        llm.generate([SHORT], params, use_tqdm=False)
    assert not llm.has_unfinished()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode CUDA graphs need a GPU")
def test_decode_graphs_sample_as_the_eager_engine(tiny_qwen3, llm):
    """Decode steps replay CUDA graphs, three rows in a bucket of four (a padding row). Seeded rows
    with different parameters each, plain or with a penalty or logprobs, draw the same tokens as an
    engine without graphs: the graphs' inputs and outputs reach the right rows."""
    prompts = [PROMPT, SHORT, PROMPT[5:25]]
    plain = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=s, max_tokens=10, ignore_eos=True)
             for t, k, p, m, s in ((0.7, 0, 0.9, 0.0, 11), (1.3, 20, 1.0, 0.02, 12), (1.0, 5, 0.6, 0.1, 13))]
    mixed = [plain[0], SamplingParams(temperature=1.1, presence_penalty=0.5, seed=14, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0.9, logprobs=True, seed=15, max_tokens=10, ignore_eos=True)]
    graphed = [[out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)] for params in (plain, mixed)]
    assert_clean(llm)
    with LLM(str(tiny_qwen3), max_num_seqs=8, num_kv_blocks=NUM_BLOCKS, enforce_eager=True) as eager:
        expected = [[out.token_ids for out in eager.generate(prompts, params, use_tqdm=False)] for params in (plain, mixed)]
    assert graphed == expected
    assert len({tuple(t) for t in expected[0]}) == 3  # the rows differ: a row given another's inputs would show


@pytest.mark.parametrize("filters", [{"top_k": 3}, {"top_p": 0.3}, {"min_p": 0.2}, {"top_k": 5, "top_p": 0.5, "min_p": 0.1}])
def test_every_drawn_token_is_one_the_filters_allow(llm, hf, filters):
    """The engine hands each request's filters to the sampler: every token of seeded samples at a high
    temperature lies in the set kernels.reference.sampling_probs allows on HF's logits for its prefix,
    where the same samples without the filters leave it."""
    def allowed_misses(outputs, params):
        misses = 0
        for out in outputs:
            ids = torch.tensor([PROMPT + out.token_ids])
            with torch.no_grad():
                logits = hf(ids).logits[0, len(PROMPT) - 1:-1]
            rows = len(out.token_ids)
            probs = reference.sampling_probs(logits, torch.full((rows,), params.temperature),
                                             torch.full((rows,), params.top_k), torch.full((rows,), params.top_p),
                                             torch.full((rows,), params.min_p))
            misses += int((probs[torch.arange(rows), torch.tensor(out.token_ids)] == 0).sum())
        return misses

    base = dict(temperature=2.0, max_tokens=12, seed=11, n=4, ignore_eos=True)
    filtered = SamplingParams(**base, **filters)
    assert allowed_misses(llm.generate([PROMPT], filtered, use_tqdm=False), filtered) == 0
    unfiltered = llm.generate([PROMPT], SamplingParams(**base), use_tqdm=False)
    assert allowed_misses(unfiltered, filtered) > 0  # so the check above can fail
    assert_clean(llm)


@pytest.mark.parametrize("penalty, chosen", [(0.1, 1), (0.2, 0)])
def test_penalties_are_applied_in_float32(llm, penalty, chosen):
    """vLLM penalizes float32 logits: in bf16 a presence penalty of 0.1 at a logit of 20 rounds
    away (20 - 0.1 is 19.875 in bf16), and greedy picks the wrong token of a near tie; 0.2 must
    change the choice (19.8 < 19.875), so the penalty is applied at all."""
    seq = Sequence([5, 6, 7], SamplingParams(temperature=0, presence_penalty=penalty), block_size=16)
    seq.token_ids.append(1)  # token 1 generated once
    seq.status = SequenceStatus.RUNNING
    logits = torch.full((1, llm.hf_config.vocab_size), -10.0, dtype=torch.bfloat16)
    logits[0, 0], logits[0, 1] = 19.875, 20.0
    ids = llm.runner.sample(logits.to(llm.runner.device), [seq], [0], []).result()[0]
    seq.status = SequenceStatus.FINISHED  # its penalty row is free for the next test
    assert ids == [chosen]
