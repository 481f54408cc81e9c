"""OpenAI's echo on /v1/completions (the scoring call of evaluation harnesses: echo, logprobs,
max_tokens 0) and vLLM's prompt_logprobs on both routes, against the offline engine's prompt_logprobs;
vLLM's allowed_token_ids, truncate_prompt_tokens and continuous_usage_stats."""
import pytest
from test_openai_api import MODEL
from test_openai_errors import error_of

from tritonllm import SamplingParams

PROMPT = "rev abcdef="


def offline(llm, prompt, k: int, max_tokens: int = 4):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k),
                        use_tqdm=False)[0]


def text_of(llm, token_id: int) -> str:
    return llm.tokenizer.decode([token_id])


@pytest.mark.parametrize("k", [0, 2])
def test_echo_with_logprobs_scores_the_prompt_then_the_completion(client, llm, k):
    out = offline(llm, PROMPT, k)
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                       logprobs=k).choices[0]
    assert choice.text == PROMPT + out.text
    lp, ids = choice.logprobs, out.prompt_token_ids + out.token_ids
    assert lp.tokens == [text_of(llm, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(out.prompt_logprobs[1:] + out.logprobs, abs=1e-4)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
    prompt_tops = out.prompt_top_logprobs or [None] + [{}] * (len(out.prompt_token_ids) - 1)
    for token, logprob, top, want in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:],
                                         prompt_tops[1:] + (out.top_logprobs or [{}] * len(out.token_ids))):
        assert top[token] == logprob and k <= len(top) <= k + 1  # the token itself and the k likeliest
        assert {text_of(llm, t) for t in want} <= set(top)
    # vLLM's prompt_logprobs beside them: {id: {logprob, rank, decoded_token}} a position, None first.
    scores = choice.model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(out.prompt_token_ids)
    for token, logprob, rank, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], out.prompt_ranks[1:],
                                           scores[1:]):
        assert list(entry)[0] == str(token) and entry[str(token)]["rank"] == rank >= 1
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert entry[str(token)]["decoded_token"] == text_of(llm, token)
        assert sorted({e["rank"] for e in entry.values()} - {rank}) == [r for r in range(1, k + 1) if r != rank]
        assert len(entry) == k + (rank > k)


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, llm):
    """The loglikelihood call of lm-evaluation-harness: the continuation's logprobs, and whether it is greedy."""
    context, continuation = "rev abc=", "cba"
    out = offline(llm, context + continuation, 1, max_tokens=1)
    response = client.completions.create(model=MODEL, prompt=context + continuation, max_tokens=0, temperature=0,
                                         echo=True, logprobs=1)
    choice = response.choices[0]
    assert choice.text == context + continuation and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(out.prompt_token_ids)
    lp = choice.logprobs
    assert lp.tokens == [text_of(llm, t) for t in out.prompt_token_ids]
    assert lp.token_logprobs[1:] == pytest.approx(out.prompt_logprobs[1:], abs=1e-4)
    greedy = [max(top.items(), key=lambda kv: kv[1])[0] == token for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:])]
    want = [max(top, key=top.get) == t for t, top in zip(out.prompt_token_ids[1:], out.prompt_top_logprobs[1:])]
    assert greedy == want


def test_echo_of_token_ids_and_of_n_samples(client, llm):
    ids = llm.encode(PROMPT)
    response = client.completions.create(model=MODEL, prompt=[ids, ids[:4]], max_tokens=2, temperature=0, echo=True, n=2)
    texts = [c.text for c in response.choices]
    assert [t[:len(PROMPT)] for t in texts[:2]] == [PROMPT] * 2
    assert [t.startswith(llm.tokenizer.decode(ids[:4])) for t in texts[2:]] == [True, True]
    assert all(c.logprobs is None for c in response.choices) and "prompt_logprobs" not in response.choices[0].model_extra


def test_echo_in_a_stream_leads_each_choice_once(client, llm):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**request).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**request, stream=True)]
    assert "".join(c.text for c in chunks) == whole.text and chunks[0].text.startswith(PROMPT)
    assert sum((c.logprobs.tokens for c in chunks), []) == whole.logprobs.tokens
    assert sum((c.logprobs.token_logprobs for c in chunks), []) == whole.logprobs.token_logprobs
    assert sum((c.logprobs.text_offset for c in chunks), []) == whole.logprobs.text_offset
    only = [c.choices[0] for c in client.completions.create(**{**request, "max_tokens": 0}, stream=True)]
    assert "".join(c.text for c in only) == PROMPT and only[-1].finish_reason == "length"


def test_prompt_logprobs_of_a_chat(client, llm, server):
    messages = [{"role": "user", "content": "rev abc"}]
    status, counted = server.request("POST", "/tokenize", {"messages": messages})
    out = offline(llm, counted["tokens"], 3, max_tokens=2)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 3})
    scores = reply.model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(counted["tokens"])
    for token, logprob, top, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], out.prompt_top_logprobs[1:],
                                          scores[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
        assert [entry[str(t)]["rank"] for t in top] == [1, 2, 3]  # top: the likeliest first
        assert sorted(int(t) for t, e in entry.items() if e["rank"] <= 3) == sorted(top)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in plain.model_extra and plain.choices[0].message.content == reply.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, extra_body={"prompt_logprobs": 0}))  # vLLM's: 0 passes
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content


def test_allowed_token_ids(client, llm):
    allowed = llm.encode("bdf")
    params = SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=allowed)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                       extra_body={"allowed_token_ids": allowed, "return_token_ids": True}).choices[0]
    assert choice.model_extra["token_ids"] == out.token_ids and set(out.token_ids) <= set(allowed)
    assert choice.text == out.text


def test_truncate_prompt_tokens(client, llm):
    ids = llm.encode(PROMPT)
    out = llm.generate([ids[-4:]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                         extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    choice = response.choices[0]
    assert choice.model_extra["prompt_token_ids"] == ids[-4:] and response.usage.prompt_tokens == 4
    assert choice.text == llm.tokenizer.decode(ids[-4:]) + out.text


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats(client, chat):
    """vLLM's: every chunk carries its choice's usage so far; the last chunk the request's."""
    def chunks(**options):
        request = dict(model=MODEL, max_tokens=5, temperature=0, n=2, stream=True, stream_options=options,
                       extra_body={"return_token_ids": True})
        if chat:
            return list(client.chat.completions.create(messages=[{"role": "user", "content": "rev abc"}], **request))
        return list(client.completions.create(prompt=PROMPT, **request))

    events = chunks(include_usage=True, continuous_usage_stats=True)
    total = events[-1].usage
    assert events[-1].choices == [] and total.completion_tokens > 0
    sent = {0: 0, 1: 0}
    for event in events[:-1]:
        (choice,) = event.choices
        sent[choice.index] += len(choice.model_extra.get("token_ids") or [])
        assert (event.usage.prompt_tokens, event.usage.completion_tokens) == (total.prompt_tokens, sent[choice.index])
        assert event.usage.total_tokens == total.prompt_tokens + sent[choice.index]
    assert sum(sent.values()) == total.completion_tokens
    assert all(event.usage is None for event in chunks(continuous_usage_stats=True))  # only with include_usage


@pytest.mark.parametrize("route, fields, param", [
    ("completions", {"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ("completions", {"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ("completions", {"extra_body": {"truncate_prompt_tokens": 65}}, "truncate_prompt_tokens"),  # past max_model_len
    ("completions", {"extra_body": {"allowed_token_ids": [10**6]}}, "allowed_token_ids"),
    ("completions", {"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ("completions", {"extra_body": {"prompt_logprobs": "2"}}, "prompt_logprobs"),
    ("completions", {"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ("completions", {"echo": "yes"}, "echo"), ("completions", {"echo": True, "max_tokens": -1}, "max_tokens"),
    ("chat", {"extra_body": {"echo": True}}, "echo"),
    ("chat", {"stream": True, "extra_body": {"prompt_logprobs": 2}}, "prompt_logprobs")])
def test_bad_fields_are_400_naming_the_field(client, route, fields, param):
    if route == "chat":
        call = lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **fields)
    else:
        call = lambda: client.completions.create(model=MODEL, prompt=PROMPT, **{"max_tokens": 2, **fields})
    error = error_of(call)
    assert error.status_code == 400 and error.param == param
