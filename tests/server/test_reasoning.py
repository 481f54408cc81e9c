"""`tritonllm serve --reasoning-parser qwen3`: a chat reply's thinking in the message's `reasoning`,
the rest in `content`. The split itself on every way a reply can arrive in pieces; the server on a
tiny random checkpoint (its byte-level tokenizer writes the tags) against the offline engine."""
import pytest
from server_process import ServerProcess

from tritonllm import SamplingParams
from tritonllm.server.reply import ReasoningSplitter

MODEL = "tiny"
ON_TINY = True
SERVER_ARGS = ["--reasoning-parser", "qwen3", "--trust-request-chat-template"]
HEADER = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
# (prompt, reply, its reasoning, its content): written out by hand.
CASES = [
    (HEADER, "<think>\nplan it\n</think>\n\nthe answer", "\nplan it\n", "\n\nthe answer"),
    (HEADER + "<think>\n", "plan it</think>the answer", "plan it", "the answer"),
    (HEADER + "<think>\n\n</think>\n\n", "the answer </think> too", "", "the answer </think> too"),
    (HEADER, "the answer", "", "the answer"),
    (HEADER, "<think>cut short", "cut short", ""),
    (HEADER, "<thinking is fun>", "", "<thinking is fun>"),
    (HEADER, "<think>a</thi", "a</thi", ""),
    (HEADER, "<think>", "", ""),
    (HEADER + "<think>", "", "", ""),
]


def split(prompt: str, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(prompt)
    parts = [splitter.feed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("prompt, reply, reasoning, content", CASES)
def test_the_split_is_the_same_however_the_reply_arrives(prompt, reply, reasoning, content):
    assert split(prompt, [reply]) == (reasoning, content)
    assert split(prompt, list(reply) + [""]) == (reasoning, content)  # a character a piece, then the end
    for cut in range(len(reply) + 1):
        assert split(prompt, [reply[:cut], reply[cut:]]) == (reasoning, content)


# The tiny checkpoint's template, with a thinking turn opened after the assistant header and the
# history's reasoning_content written out.
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.reasoning_content %}<think>"
            "{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def reply(tiny_llm, **options) -> str:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = tiny_llm.chat(MESSAGES, params, use_tqdm=False, **options)[0].text
    assert "</think>" not in text  # the random model's reply holds no tag: all of it goes to one side
    return text


def test_a_reply_in_a_thinking_turn_is_reasoning(client, tiny_llm):
    text = reply(tiny_llm, chat_template=THINKING)
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={
        "chat_template": THINKING, "ignore_eos": True})
    message = client.chat.completions.create(**request).choices[0].message
    assert (message.model_extra["reasoning"], message.content) == (text, None)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**request, stream=True) if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == text
    assert not any(d.content for d in deltas)


@pytest.mark.parametrize("options", [{}, {"continue_final_message": True, "add_generation_prompt": False}])
def test_a_reply_outside_one_is_content(client, tiny_llm, options):
    messages = MESSAGES + ([{"role": "assistant", "content": "<think>\nplan\n</think>\n\n"}] if options else [])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = tiny_llm.chat(messages, params, use_tqdm=False, **options)[0].text
    message = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True, **options}).choices[0].message
    assert (message.content, message.model_extra["reasoning"]) == (text, None)


def test_the_history_reasoning_reaches_the_template(server, tiny_llm):
    history = [*MESSAGES, {"role": "assistant", "content": "dog", "reasoning": "lazy"},
               {"role": "user", "content": "fox"}]
    status, body = server.request("POST", "/tokenize", {"messages": history, "chat_template": THINKING})
    want = ("<|im_start|>user\nthe quick brown fox<|im_end|>\n<|im_start|>assistant\n<think>lazy</think>dog<|im_end|>\n"
            "<|im_start|>user\nfox<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert status == 200 and body["tokens"] == tiny_llm.encode(want, add_special_tokens=False)


def test_an_unknown_parser_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)did not start.*invalid choice: 'deepseek'"):
        ServerProcess(["--reasoning-parser", "deepseek"], tmp_path / "log.txt")
