"""Bad requests to `tritonllm serve`, through the official openai client and raw HTTP: a 400 that
names the request's field (OpenAI's `param`), whether the server's parser or the engine process
finds it; an unknown model, route or method; JSON that cannot be read; fields that change nothing."""
import http.client
import json

import openai
import pytest
from test_openai_api import MODEL


def error_of(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as raised:
        call()
    return raised.value


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"stop": 5}, "stop"), ({"seed": "x"}, "seed"), ({"suffix": "x"}, "suffix"),
    ({"max_tokens": 100}, "max_tokens"), ({"prompt": "hello?"}, "prompt"), ({"prompt": []}, "prompt"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"stream": True, "temperature": -1}, "temperature"),
    ({"extra_body": {"include_stop_str_in_output": 1}}, "include_stop_str_in_output"),
    ({"logit_bias": {"b": 1}}, "logit_bias"), ({"logit_bias": {"14": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"best_of": True}, "best_of")])  # true == 1, the neutral value, but not an integer
def test_bad_completion_fields_are_400_naming_the_field(client, fields, param):
    request = {"model": MODEL, "prompt": "1+1=", "max_tokens": 2, **fields}
    error = error_of(lambda: client.completions.create(**request))
    assert error.status_code == 400 and error.param == param and error.type == "invalid_request_error"
    assert param.split("_")[0] in error.message


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"), ({"messages": [{"content": "hi"}]}, "messages[0]"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),  # "auto" without a parser
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"), ({"extra_body": {"echo": 0}}, "echo"),
    ({"extra_body": {"include_reasoning": 1}}, "include_reasoning")])
def test_bad_chat_fields_are_400_naming_the_field(client, fields, param):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "1+1"}], **fields}
    error = error_of(lambda: client.chat.completions.create(**request))
    assert error.status_code == 400 and error.param == param


def test_a_requests_own_chat_template_is_refused_without_trust(server):
    # A template is code the server runs (a nested loop of a request's held every request for minutes):
    # vLLM's --trust-request-chat-template, which this server was not started with.
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "1+1"}]
    for path, fields, param in (("/v1/chat/completions", {"chat_template": template}, "chat_template"),
                                ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": template}},
                                 "chat_template_kwargs"),
                                ("/tokenize", {"chat_template": template}, "chat_template")):
        status, answer = server.request("POST", path, {"model": MODEL, "messages": messages, "max_tokens": 1, **fields})
        assert status == 400 and answer["error"]["param"] == param, answer
        assert "--trust-request-chat-template" in answer["error"]["message"]
    status, answer = server.request("POST", "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                                      "chat_template_kwargs": {}, "max_tokens": 1})
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"


def test_chat_options_that_cannot_be_served_are_400(client):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "1+1"}], max_tokens=2)
    error = error_of(lambda: client.chat.completions.create(**request, extra_body={"continue_final_message": True}))
    assert error.status_code == 400 and error.param == "continue_final_message"


@pytest.mark.parametrize("path, fields, param", [
    # Found by the engine process: named as the request named them, not as the engine does.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1" * 60}], "max_completion_tokens": 10},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "rev abcd"}], "min_tokens": 62}, "min_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "hi"}], "max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1" * 70}]}, "messages"),  # no max_tokens
    ("/v1/completions", {"prompt": "1" * 60, "max_tokens": 10}, "max_tokens"),
    ("/v1/completions", {"prompt": ["1+1="] * 33, "n": 128, "max_tokens": 1}, "n"),  # more than --max-waiting: never
    ("/v1/completions", {"prompt": ["1+1="] * 4097, "max_tokens": 1}, "prompt"),  # n is 1: the prompts are too many
])
def test_errors_the_engine_finds_name_the_requests_field(server, path, fields, param):
    status, answer = server.request("POST", path, {"model": MODEL, **fields})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert param in answer["error"]["message"] or param == "messages"  # a chat's prompt is what its messages render


def test_a_prompt_too_long_is_openais_context_length_error(server):
    # Clients tell it from other errors by its code and words; it blamed max_tokens (16 by default), which no
    # value could mend.
    status, answer = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": "1" * 70})
    error = answer["error"]
    assert status == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "prompt"), answer
    assert error["message"].startswith("This model's maximum context length is 64 tokens")


def test_a_wrong_method_and_a_cross_origin_request(server):
    # The 405 was typed a server error and lost its Allow header; a browser's preflight got 405 (vLLM allows any origin).
    def send(method, path, headers):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        connection.request(method, path, headers=headers)
        response = connection.getresponse()
        return response, response.read()

    response, body = send("GET", "/v1/completions", {})
    assert response.status == 405 and json.loads(body)["error"]["type"] == "invalid_request_error"
    assert response.getheader("Allow") == "POST"
    response, _ = send("OPTIONS", "/v1/chat/completions", {"Origin": "http://example.com",
                                                          "Access-Control-Request-Method": "POST"})
    assert response.status == 200 and response.getheader("Access-Control-Allow-Origin") in ("*", "http://example.com")


def test_other_errors_and_unknown_fields(server, client):
    error = error_of(lambda: client.completions.create(model="gpt-4", prompt="1+1=", max_tokens=2))
    assert (error.status_code, error.code, error.param) == (404, "model_not_found", "model")
    # Deeper than the parser's recursion, an integer past Python's 4300 digits: still just bad JSON.
    for body in (b"{not json", b"[1, 2]", b"", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                 b'{"prompt": "1+1=", "seed": ' + b"9" * 5000 + b"}"):
        status, answer = server.request("POST", "/v1/completions", body)
        assert status == 400 and answer["error"]["code"] == "invalid_json" and answer["error"]["type"] == "invalid_request_error"
    # A lone UTF-16 surrogate parses but cannot be encoded: named in a 404's message or tokenized, it was a 500.
    for path, body in (("/v1/completions", b'{"prompt": "1+1=", "model": "\\ud800"}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "1"}], "model": "\\udfff"}'),
                       ("/tokenize", b'{"prompt": "\\ud800"}')):
        status, answer = server.request("POST", path, body)
        assert status == 400 and answer["error"]["code"] == "invalid_json", (path, answer)
    status, answer = server.request("GET", "/v1/nothing")
    assert status == 404 and set(answer["error"]) == {"message", "type", "param", "code"}
    assert server.request("GET", "/v1/completions")[0] == 405
    # Fields that change nothing, known to OpenAI or not, are accepted.
    response = client.completions.create(model=MODEL, prompt="1+1=", max_tokens=2, temperature=0, user="me",
                                         extra_body={"metadata": {"a": "b"}, "store": False, "a_future_field": 1})
    assert response.choices[0].text == "2"
