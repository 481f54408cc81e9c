"""`tritonllm serve --enable-auto-tool-choice --tool-call-parser hermes`: the tools reach the chat
template, and a reply's <tool_call> JSON becomes OpenAI's tool_calls. The split on every way a
reply can arrive in pieces; the responses and stream chunks the renderer makes of a reply with
calls; the server on a tiny random checkpoint (whose replies hold no calls) against the offline engine."""
import json

import pytest
from server_process import ServerProcess
from tiny_qwen3 import build_tokenizer

from tritonllm import SamplingParams
from tritonllm.server.fields import ApiError
from tritonllm.server.protocol import parse_chat
from tritonllm.server.render import Renderer
from tritonllm.server.reply import ToolCallSplitter

MODEL = "tiny"
ON_TINY = True
SERVER_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-request-chat-template"]
CALL_F = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
CALL_G = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
F = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "°C"}'}
G = {"name": "now", "arguments": "{}"}
# (reply, its content, its calls' functions): written out by hand.
CASES = [
    (f"Let me look.\n{CALL_F}\n{CALL_G}\n", "Let me look.", [F, G]),
    (CALL_F, "", [F]),
    ("no call here\n", "no call here\n", []),
    ('<tool_call>{"name": "now", "arguments": {}}', "", [G]),  # the last call may lack its closing tag
    ('A <tool_call>{"arguments": {}}</tool_call> B', 'A <tool_call>{"arguments": {}}</tool_call> B', []),
    ('<tool_call>{"name": "now", "arg', '<tool_call>{"name": "now", "arg', []),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>\n\nDone', "\n\nDone",
     [{"name": "f", "arguments": '{"a": 1}'}]),
    ("x <tool_cal", "x <tool_cal", []),
]


def split(pieces: list[str]) -> tuple[str, list[dict]]:
    splitter, content, calls = ToolCallSplitter(), "", []
    for i, piece in enumerate(pieces):
        text, new = splitter.feed(piece, i == len(pieces) - 1)
        content += text
        calls += new
    assert all(call["type"] == "function" and call["id"].startswith("chatcmpl-tool-") for call in calls)
    assert len({call["id"] for call in calls}) == len(calls)
    return content, [call["function"] for call in calls]


@pytest.mark.parametrize("reply, content, calls", CASES)
def test_the_split_is_the_same_however_the_reply_arrives(reply, content, calls):
    assert split([reply]) == (content, calls)
    assert split(list(reply) + [""]) == (content, calls)
    for cut in range(len(reply) + 1):
        assert split([reply[:cut], reply[cut:]]) == (content, calls)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# The tiny checkpoint's template, with the tools written out first.
WITH_TOOLS = ("{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}{% for m in messages %}<|im_start|>"
              "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def rendered(pieces: list[str], stream: bool, finish: str = "stop", **fields):
    """The renderer's response (or stream events) for a reply that arrives in these pieces."""
    request = parse_chat({"messages": MESSAGES, "tools": TOOLS, "stream": stream, **fields}, build_tokenizer(),
                         auto_tools=True)
    renderer = Renderer(request, MODEL, build_tokenizer(), {}, [[1, 2, 3]])
    items = [(0, 0, [7], piece, None, None, (finish, 0, None) if i == len(pieces) - 1 else None, None)
             for i, piece in enumerate(pieces)]
    if not stream:
        return renderer.response(items, 3)
    events = "".join(renderer.stream_chunks([item]) for item in items)
    return [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: ")]


def test_a_reply_with_calls_as_a_response_and_as_a_stream():
    reply = f"Let me look.\n{CALL_F}\n{CALL_G}\n"
    (choice,) = rendered([reply], stream=False)["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == "Let me look."
    assert [call["function"] for call in message["tool_calls"]] == [F, G]
    assert all(set(call) == {"id", "type", "function"} for call in message["tool_calls"])
    deltas = [event["choices"][0] for event in rendered([reply[:20], reply[20:70], reply[70:]], stream=True)]
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert [(call["index"], call["function"]) for call in calls] == [(0, F), (1, G)]
    assert "".join(d["delta"].get("content", "") for d in deltas) == "Let me look."
    assert [d["finish_reason"] for d in deltas] == [None, None, "tool_calls"]


def test_parallel_tool_calls_false_keeps_the_first_call():
    # Both calls came back, and any value of the field was accepted.
    reply = f"Let me look.\n{CALL_F}\n{CALL_G}\n"
    (choice,) = rendered([reply], stream=False, parallel_tool_calls=False)["choices"]
    assert [call["function"] for call in choice["message"]["tool_calls"]] == [F]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    events = rendered([reply[:20], reply[20:70], reply[70:]], stream=True, parallel_tool_calls=False)
    calls = [call for event in events for call in event["choices"][0]["delta"].get("tool_calls", [])]
    assert [(call["index"], call["function"]) for call in calls] == [(0, F)]
    assert [call["function"] for call in rendered([reply], stream=False, parallel_tool_calls=True)["choices"][0]
            ["message"]["tool_calls"]] == [F, G]
    with pytest.raises(ApiError) as refused:
        rendered([reply], stream=False, parallel_tool_calls="no")
    assert refused.value.param == "parallel_tool_calls"


def test_a_reply_without_calls_keeps_its_finish_reason():
    (choice,) = rendered(["just text"], stream=False, finish="length")["choices"]
    assert choice["message"] == {"role": "assistant", "content": "just text", "tool_calls": []}
    assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_the_tools_reach_the_template(server, client, tiny_llm, tool_choice):
    body = {"messages": MESSAGES, "tools": TOOLS, "chat_template": WITH_TOOLS}
    status, counted = server.request("POST", "/tokenize", body)
    want = f"<tools>{json.dumps(TOOLS)}</tools>\n" + "<|im_start|>user\nthe quick brown fox<|im_end|>\n<|im_start|>assistant\n"
    assert status == 200 and counted["tokens"] == tiny_llm.encode(want, add_special_tokens=False)
    kwargs = {"messages": MESSAGES, "chat_template": WITH_TOOLS, "chat_template_kwargs": {"tools": TOOLS}}
    assert server.request("POST", "/tokenize", kwargs) == (200, counted)  # vLLM's: the kwargs may carry them
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = tiny_llm.chat(MESSAGES, params, use_tqdm=False, chat_template=WITH_TOOLS, tools=TOOLS)[0]
    assert out.prompt_token_ids == counted["tokens"] and "<tool_call>" not in out.text
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                              max_tokens=10, temperature=0, extra_body={"chat_template": WITH_TOOLS,
                                                                                        "ignore_eos": True})
    choice = response.choices[0]
    assert response.usage.prompt_tokens == len(counted["tokens"]) and choice.message.content == out.text
    assert choice.finish_reason == "length" and not choice.message.tool_calls


# How Qwen3's templates write a past call's arguments (tojson), and Qwen3-Coder's (|items).
HISTORY = ("{%- for m in messages %}{{ m.role }}:{{ m.content }}{%- for call in m.tool_calls or [] %}"
           "[{{ call.function.name }} {{ call.function.arguments | tojson }} {% for k, v in call.function.arguments"
           " | items %}{{ k }}={{ v }}{% endfor %}]{%- endfor %};{% endfor %}")


def test_history_with_calls_and_their_results_renders(server, tiny_llm):
    # OpenAI's clients send a past call's arguments as a JSON string: the templates got the string (a
    # "" wrote "arguments": } and |items refused it) where vLLM's get the object.
    def history(*arguments):
        calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": a}}
                 for i, a in enumerate(arguments)]
        return [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]

    status, counted = server.request("POST", "/tokenize", {"messages": history('{"city":"Paris"}', "", None),
                                                            "chat_template": HISTORY})
    want = 'user:the quick brown fox;assistant:[f {"city": "Paris"} city=Paris][f {} ][f {} ];tool:sunny;'
    assert status == 200 and counted["tokens"] == tiny_llm.encode(want, add_special_tokens=False)
    status, answer = server.request("POST", "/tokenize", {"messages": history('{"city": '), "chat_template": HISTORY})
    assert status == 400 and answer["error"]["param"] == "messages[1].tool_calls[0].function.arguments", answer
    status, counted = server.request("POST", "/tokenize", {"messages": history('{"city": "Paris"}'), "tools": TOOLS})
    assert status == 200 and counted["count"] > 0


def test_auto_tool_choice_needs_a_parser(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)did not start.*--enable-auto-tool-choice needs --tool-call-parser"):
        ServerProcess(["--enable-auto-tool-choice"], tmp_path / "log.txt")
