"""`tritonllm serve` driven by the official openai client: the answers equal the offline engine's."""
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from test_engine_worker import Pipe

from tritonllm import SamplingParams
from tritonllm.server.engine_process import EngineWorker
from tritonllm.server.fields import ApiError
from tritonllm.server.protocol import parse_chat, parse_completion
from tritonllm.tiny_tasks import problems

MODEL = "bundled"
SERVER_ARGS = ["--trust-request-chat-template"]  # some tests bring their own chat_template
AS_IDS = {"return_token_ids": True, "return_tokens_as_token_ids": True}


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_models_health_and_stats(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    stats = server.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] > 0
    assert stats["num_running_seqs"] == stats["num_waiting_seqs"] == 0
    status, text = server.request("GET", "/metrics")
    assert status == 200 and f"tritonllm_num_kv_blocks {stats['num_kv_blocks']}" in text
    assert "# TYPE tritonllm_num_kv_blocks gauge" in text and "# TYPE tritonllm_prompt_tokens_total counter" in text


def test_greedy_completion_equals_generate(server, client, llm):
    prompts = [prompt for prompt, _ in problems(4, seed=5)]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for prompt, out in zip(prompts[:2], expected):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        choice = response.choices[0]
        assert (choice.text, choice.finish_reason) == (out.text, out.finish_reason)
        assert response.usage.prompt_tokens == len(out.prompt_token_ids)
        assert response.usage.completion_tokens == len(out.token_ids)
        assert response.usage.total_tokens == len(out.prompt_token_ids) + len(out.token_ids)
    # A batch of token-id prompts: one choice per prompt, in order, with the token ids asked for.
    response = client.completions.create(model=MODEL, prompt=[out.prompt_token_ids for out in expected], max_tokens=8,
                                         temperature=0, extra_body={"return_token_ids": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [out.text for out in expected]
    assert [token_ids(c) for c in response.choices] == [out.token_ids for out in expected]
    # vLLM's prompt_token_ids beside them: on each completion choice (a stream's first chunk of it), at the
    # top of a chat response (its stream's first chunk of each choice).
    assert [c.model_extra["prompt_token_ids"] for c in response.choices] == [out.prompt_token_ids for out in expected]
    chunks = list(client.completions.create(model=MODEL, prompt=["1+1=", "rev ab="], max_tokens=3, temperature=0, n=2,
                                            stream=True, extra_body={"return_token_ids": True}))
    per_choice = {}  # each choice's chunks in order (the choices' chunks interleave as their steps run)
    for c in chunks:
        per_choice.setdefault(c.choices[0].index, []).append(c.choices[0].model_extra.get("prompt_token_ids"))
    assert all(all(ids is None for ids in later) for _, *later in per_choice.values())
    assert {index: ids[0] for index, ids in per_choice.items()} == {
        0: llm.encode("1+1="), 1: llm.encode("1+1="), 2: llm.encode("rev ab="), 3: llm.encode("rev ab=")}
    messages = [{"role": "user", "content": "rev ab"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, extra_body={"return_token_ids": True})
    status, counted = server.request("POST", "/tokenize", {"messages": messages})
    assert chat.model_extra["prompt_token_ids"] == counted["tokens"]
    chat_chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, n=2, stream=True,
                                                      extra_body={"return_token_ids": True}))
    assert [c.model_extra.get("prompt_token_ids") for c in chat_chunks[:3]] == [counted["tokens"]] * 2 + [None]
    assert response.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in expected)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_streamed_text_equals_non_streamed(client, sampling):
    request = dict(model=MODEL, prompt="rev hgfedc=", max_tokens=8, **sampling)
    whole = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_plain_and_streamed(client, llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+34"}]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text == "46"
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Without max_tokens the reply may run to the model's length (it stops at EOS first here).
    words = [{"role": "user", "content": "sort dcab"}]
    reply = client.chat.completions.create(model=MODEL, messages=words, temperature=0)
    assert reply.choices[0].message.content == llm.chat(words, SamplingParams(temperature=0, max_tokens=54), use_tqdm=False)[0].text


def test_n_samples(client, llm):
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=6, ignore_eos=True)
    expected = llm.generate(["3"], params, use_tqdm=False)
    request = dict(model=MODEL, prompt="3", n=3, temperature=1.0, seed=7, max_tokens=6, extra_body={"ignore_eos": True})
    response = client.completions.create(**request)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [out.text for out in expected]
    assert len({out.text for out in expected}) > 1  # three samples, not one thrice
    assert response.usage.completion_tokens == 18 and response.usage.prompt_tokens == 1
    texts = ["", "", ""]
    for chunk in client.completions.create(**request, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [out.text for out in expected]


def test_stop_strings_and_tokens(client, llm):
    request = dict(model=MODEL, prompt="rev abcd=", max_tokens=8, temperature=0)
    assert client.completions.create(**request).choices[0].text == "dcba"
    stopped = client.completions.create(**request, stop=["cb", "xyz"])
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == ("d", "stop")
    assert stopped.choices[0].model_extra["stop_reason"] == "cb"  # vLLM's field: what ended it
    # Streamed, the "c" that could start "cb" is held back until it is known not to be shown.
    deltas = [c.choices[0].text for c in client.completions.create(**request, stop="cb", stream=True)]
    assert "".join(deltas) == "d" and not any("c" in d for d in deltas)
    # A stop token (b = id 14) and the offline result for the same params.
    response = client.completions.create(**request, extra_body={"stop_token_ids": [14], "return_token_ids": True})
    out = llm.generate(["rev abcd="], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[14]), use_tqdm=False)[0]
    assert (response.choices[0].text, token_ids(response.choices[0])) == (out.text, out.token_ids)
    assert token_ids(response.choices[0])[-1] == 14 and response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == "dc" and response.choices[0].model_extra["stop_reason"] == 14  # b not in text
    # OpenAI's logit_bias: b (id 14) never drawn; then forced.
    assert client.completions.create(**request, logit_bias={"14": -100}).choices[0].text.startswith("dc")
    assert "b" not in client.completions.create(**request, logit_bias={"14": -100}).choices[0].text
    assert client.completions.create(**{**request, "max_tokens": 3}, logit_bias={"14": 100}).choices[0].text == "bbb"
    # vLLM's flags: the stop string or token kept in the text; the EOS's text shown too without skipping specials.
    kept = {"include_stop_str_in_output": True}
    assert client.completions.create(**request, stop="cb", extra_body=kept).choices[0].text == "dcb"
    assert "".join(c.choices[0].text for c in client.completions.create(**request, stop="cb", stream=True,
                                                                          extra_body=kept)) == "dcb"
    assert client.completions.create(**request, extra_body={"stop_token_ids": [14], **kept}).choices[0].text == "dcb"
    both = client.completions.create(**request, extra_body={"skip_special_tokens": False, **kept})
    assert both.choices[0].text == "dcba<|im_end|>" and both.choices[0].finish_reason == "stop"


# Renders the messages' contents one after another, and "=" for a generation prompt: the bundled
# model answers "12+34=" and "rev abcd=" (its own template takes the last user message alone).
CONCAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


@pytest.mark.parametrize("messages, options, reply", [
    ([{"role": "user", "content": "12+"}, {"role": "user", "content": "34"}], {}, "46"),
    ([{"role": "user", "content": "12+3"}, {"role": "user", "content": "4="}], {"add_generation_prompt": False}, "46"),
    ([{"role": "user", "content": "12+34="}], {"chat_template_kwargs": {"add_generation_prompt": False}}, "46"),
    ([{"role": "user", "content": "rev ab"}, {"role": "assistant", "content": "cd="}],
     {"add_generation_prompt": False, "continue_final_message": True}, "dcba"),
])
def test_chat_template_options(client, llm, messages, options, reply):
    # vLLM's chat options, offline and served: they used to be ignored (or a 400 for the kwargs).
    params = SamplingParams(temperature=0, max_tokens=8)
    assert llm.chat(messages, params, use_tqdm=False, chat_template=CONCAT, **options)[0].text == reply
    served = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                            extra_body={"chat_template": CONCAT, **options})
    assert served.choices[0].message.content == reply


def test_logprobs(client, llm):
    out = llm.generate(["25+17="], SamplingParams(temperature=0, max_tokens=6, top_logprobs=3), use_tqdm=False)[0]
    response = client.completions.create(model=MODEL, prompt="25+17=", max_tokens=6, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(out.token_ids) and "".join(logprobs.tokens).startswith(response.choices[0].text)
    assert logprobs.token_logprobs == pytest.approx(out.logprobs, abs=1e-4)
    for chosen, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and max(top, key=top.get) == chosen  # greedy: the likeliest
        assert top[chosen] == pytest.approx(logprob, abs=1e-4) and logprob <= 0
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    # Chat: logprobs with top_logprobs alternatives each.
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "rev abc"}], max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert "".join(entry.token for entry in content[:-1]) == reply.choices[0].message.content == "cba"
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob == entry.logprob  # one value for the sampled token
    # OpenAI's completions: each step's dict holds the sampled token too (up to logprobs + 1 entries),
    # also when it is not among the likeliest (a hot temperature) and when logprobs=0.
    for k in (0, 1):
        hot = client.completions.create(model=MODEL, prompt="rev abcd=", max_tokens=8, temperature=30, seed=1, n=3,
                                        logprobs=k)
        outside = 0
        for choice in hot.choices:
            lp = choice.logprobs
            for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
                assert top[chosen] == logprob and len(top) <= k + 1
                outside += len(top) == k + 1
        assert outside > 0
    # Chat's top_logprobs=0 asks for nothing: no need for logprobs=true.
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "rev abc"}], max_tokens=4,
                                           temperature=0, top_logprobs=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == "cba"


def penalized_choice_ok(ids: list[int], tops: list[dict], presence: float, frequency: float) -> None:
    """Greedy under OpenAI's penalties: each token is the argmax of logprob - presence * [count > 0] -
    frequency * count, counts over the completion so far (checked among the 20 alternatives given,
    which is where the maximum lies unless it fell below the 20th logprob)."""
    counts: dict[int, int] = {}
    for token, top in zip(ids, tops):
        top = {int(key.removeprefix("token_id:")): logprob for key, logprob in top.items()}
        scores = {t: lp - presence * (counts.get(t, 0) > 0) - frequency * counts.get(t, 0) for t, lp in top.items()}
        best = max(scores, key=scores.get)
        if scores[best] >= min(top.values()):
            assert token == best, (token, scores)
        counts[token] = counts.get(token, 0) + 1


def test_penalties(client, llm):
    request = dict(model=MODEL, prompt="3", max_tokens=12, temperature=0, logprobs=20,
                   extra_body={**AS_IDS, "ignore_eos": True})
    plain = client.completions.create(**request).choices[0]
    assert len(set(token_ids(plain))) <= 2  # not a problem it knows: it repeats itself
    outputs = {}
    for presence, frequency in ((0.0, 1.5), (1.5, 0.0), (-0.5, 0.8)):
        penalized = client.completions.create(**request, presence_penalty=presence, frequency_penalty=frequency).choices[0]
        penalized_choice_ok(token_ids(penalized), penalized.logprobs.top_logprobs, presence, frequency)
        outputs[presence, frequency] = token_ids(penalized)
    assert len({tuple(ids) for ids in outputs.values()} | {tuple(token_ids(plain))}) == 4
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=0.3)
    out = llm.generate(["3"], params, use_tqdm=False)[0]
    body = {**request["extra_body"], "repetition_penalty": 1.8}
    response = client.completions.create(**{**request, "extra_body": body}, frequency_penalty=0.3).choices[0]
    assert token_ids(response) == out.token_ids != token_ids(plain)


def test_usage_counts_the_prompt_tokens_the_prefix_cache_served(client, llm):
    """OpenAI's usage.prompt_tokens_details.cached_tokens, as the offline engine counts them; the
    other samples of a prompt (which hit its blocks) are not counted again."""
    prompt = "rev " + "hgfedcba" * 5 + "="
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, n=3)
    offline = [llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0] for _ in range(2)]
    assert first.usage.prompt_tokens_details.cached_tokens == offline[0].num_cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == offline[1].num_cached_tokens >= 32
    chat = [{"role": "user", "content": prompt[:-1]}]
    usages = [client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2).usage for _ in range(2)]
    assert usages[1].prompt_tokens_details.cached_tokens >= 32 and usages[1].prompt_tokens == usages[0].prompt_tokens


def test_add_special_tokens_reaches_the_encoder(llm, monkeypatch):
    """vLLM's add_special_tokens: a completion's text prompt gets the tokenizer's special tokens (a
    BOS, for tokenizers that add one) unless false; a chat's rendered text gets them only if true."""
    cases = [(parse_completion({"prompt": "1+1="}, True), True),
             (parse_completion({"prompt": "1+1=", "add_special_tokens": False}, True), False),
             (parse_chat({"messages": [{"role": "user", "content": "1+1"}]}, llm.tokenizer), False),
             (parse_chat({"messages": [{"role": "user", "content": "1+1"}], "add_special_tokens": True}, llm.tokenizer),
              True)]
    seen, encode = [], llm.encode
    monkeypatch.setattr(llm, "encode", lambda prompt, add_special_tokens=True: isinstance(prompt, str)
                        and seen.append(add_special_tokens) or encode(prompt, add_special_tokens))
    worker = EngineWorker(llm, Pipe(), max_waiting=16)
    for key, (request, _) in enumerate(cases):
        worker.add(key, request.prompts, request.params, request.add_special_tokens, False)
        worker.abort(key)
    assert seen == [want for _, want in cases]
    with pytest.raises(ApiError) as raised:
        parse_completion({"prompt": "1+1=", "add_special_tokens": 1}, True)
    assert raised.value.status == 400 and raised.value.param == "add_special_tokens"


@pytest.mark.parametrize("field, value", [("logits_processors", ["module:Processor"]), ("bad_words", ["x"]),
                                          ("response_format", {"type": "json_object"}), ("use_beam_search", True),
                                          ("include_reasoning", False)])
def test_a_field_that_would_change_the_output_is_refused_by_name(field, value):
    # vLLM refuses logits_processors unless its server allows them; this one ignored them.
    with pytest.raises(ApiError) as raised:
        parse_completion({"prompt": "1+1=", field: value}, True)
    assert raised.value.status == 400 and raised.value.param == field
    assert parse_completion({"prompt": "1+1=", field: None}, True).prompts  # the neutral value passes


def test_tokenize_and_detokenize(server, client, llm):
    """vLLM's /tokenize and /detokenize: the ids the generation routes use, and back."""
    status, answer = server.request("POST", "/tokenize", {"model": MODEL, "prompt": "rev abcd="})
    ids = llm.tokenizer.encode("rev abcd=")
    assert status == 200 and answer == {"count": len(ids), "max_model_len": client.models.retrieve(MODEL).model_extra[
        "max_model_len"], "tokens": ids, "token_strs": None}
    completion = client.completions.create(model=MODEL, prompt="rev abcd=", max_tokens=1)
    assert completion.usage.prompt_tokens == answer["count"]
    messages = [{"role": "user", "content": "rev abcd"}]
    status, chat = server.request("POST", "/tokenize", {"messages": messages, "return_token_strs": True})
    want = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)
    assert status == 200 and chat["tokens"] == want and chat["token_strs"] == llm.tokenizer.convert_ids_to_tokens(want)
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens == len(want)
    assert server.request("POST", "/detokenize", {"tokens": ids}) == (200, {"prompt": "rev abcd="})
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/tokenize", {"prompt": "hello"}, "prompt"),  # "l": as /v1/completions refuses it
                              ("/tokenize", {"messages": [{"role": "user", "content": "hello"}]}, "messages"),
                              ("/tokenize", {"messages": messages, "tools": [{"type": "function"}]}, "tools"),
                              ("/detokenize", {"tokens": [len(llm.tokenizer)]}, "tokens"),
                              ("/tokenize", {"messages": []}, "messages")):
        status, answer = server.request("POST", path, body)
        assert status == 400 and answer["error"]["param"] == param, answer
    assert server.request("POST", "/tokenize", {"model": "gpt-4", "prompt": "hi"})[0] == 404


def test_concurrent_streams_equal_their_offline_results(client, llm):
    prompts = [prompt for prompt, _ in problems(16, seed=9)]
    params = [SamplingParams(temperature=0, max_tokens=6) if i % 2 else SamplingParams(temperature=0.9, seed=i, max_tokens=6)
              for i in range(16)]
    expected = [out.text for out in llm.generate(prompts, params, use_tqdm=False)]

    def stream(i: int) -> str:
        p = params[i]
        chunks = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6, temperature=p.temperature,
                                           seed=p.seed, stream=True)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(stream, range(16))) == expected


def test_max_completion_tokens_is_a_chat_field(llm):
    # A completion obeyed it (over max_tokens); a chat left the max_tokens beside it unchecked.
    assert parse_completion({"prompt": "1+1=", "max_tokens": 5, "max_completion_tokens": 1}, True).params.max_tokens == 5
    chat = {"messages": [{"role": "user", "content": "1+1"}], "max_completion_tokens": 3}
    assert parse_chat({**chat, "max_tokens": 7}, llm.tokenizer).params.max_tokens == 3  # vLLM's: it wins
    for value in ("x", -5):
        with pytest.raises(ApiError) as refused:
            parse_chat({**chat, "max_tokens": value}, llm.tokenizer)
        assert refused.value.param == "max_tokens"


def test_a_bad_stream_option_is_named_as_the_body_nests_it():
    with pytest.raises(ApiError) as refused:
        parse_completion({"prompt": "1+1=", "stream": True, "stream_options": {"include_usage": "yes"}}, True)
    assert refused.value.param == "stream_options.include_usage"
    for options in ({}, {"include_usage": False}):  # {} passed while {"include_usage": false} was refused
        with pytest.raises(ApiError) as refused:
            parse_completion({"prompt": "1+1=", "stream_options": options}, True)
        assert refused.value.param == "stream_options"


def test_documents_and_reasoning_effort_reach_the_template(llm):
    # Both were accepted and dropped; vLLM's chat route gives them to the template.
    template = ("{{ documents | map(attribute='title') | join(',') }}|{{ reasoning_effort }}|"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    body = {"messages": [{"role": "user", "content": "1+1"}], "chat_template": template,
            "documents": [{"title": "a"}, {"title": "b"}], "reasoning_effort": "low"}
    assert parse_chat(body, llm.tokenizer, trust_template=True).prompts == ["a,b|low|1+1"]
    for field, value in (("documents", ["a"]), ("reasoning_effort", 3)):
        with pytest.raises(ApiError) as refused:
            parse_chat({**body, field: value}, llm.tokenizer, trust_template=True)
        assert refused.value.param == field


@pytest.mark.parametrize("field, value", [("user", 5), ("metadata", "x"), ("service_tier", 1), ("store", "no")])
def test_fields_that_change_nothing_still_have_their_types(field, value):
    # Any value passed; OpenAI's API refuses these.
    with pytest.raises(ApiError) as refused:
        parse_completion({"prompt": "1+1=", field: value}, True)
    assert refused.value.param == field
    assert parse_completion({"prompt": "1+1=", "user": "me", "metadata": {"a": "b"}, "service_tier": "auto",
                             "store": False}, True).prompts == ["1+1="]
