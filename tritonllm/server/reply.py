"""A chat reply's text split as it arrives into vLLM's parts: reasoning, content and tool calls.

Reasoning (`--reasoning-parser qwen3`): the text between <think> and </think> goes to the message's
`reasoning` (vLLM's field). A reply thinks when it opens with <think> (Qwen3's first releases) or
when its prompt already did (the templates of Qwen3-2507's thinking models and later put <think>
after the assistant header). A prompt that closes the thinking (enable_thinking=False leaves an
empty <think></think> there) or never opens it gives content only, as does a reply without the tags
(instruct models). A reply that ends before </think> is all reasoning.

Tool calls (`--tool-call-parser hermes`, the format of Qwen3's template): each call is a JSON object
{"name", "arguments"} between <tool_call> and </tool_call> (the last one may lack its closing tag),
and becomes one of OpenAI's tool_calls, sent whole once it is complete. A body that is not such an
object stays in the content, tags and all; once a call has been seen, whitespace between calls is
dropped.

Each part waits on a tail that could still begin its tag, so a reply split into any pieces gives
the parts of the whole reply.
"""
import json
import uuid

from tritonllm.engine.output import tail_that_could_begin

THINK, END_THINK = "<think>", "</think>"
CALL, END_CALL = "<tool_call>", "</tool_call>"
REASONING_PARSERS = ("qwen3",)
TOOL_CALL_PARSERS = ("hermes",)


def _held(text: str, tag: str, final: bool) -> tuple[str, str]:
    """text split into (what can go out now, the tail that waits for the next piece)."""
    held = 0 if final else tail_that_could_begin(text, [tag])
    return text[:len(text) - held], text[len(text) - held:]


class ReasoningSplitter:
    """feed() each piece of a reply, get its (reasoning, content)."""

    def __init__(self, prompt: str):
        self.mode = "reasoning" if prompt.rstrip().endswith(THINK) else "start"
        self.pending = ""

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        text, self.pending = self.pending + piece, ""
        if self.mode == "start":
            if THINK.startswith(text) and not final:
                self.pending = text
                return "", ""
            self.mode = "reasoning" if text.startswith(THINK) else "content"
            text = text.removeprefix(THINK)
        if self.mode == "content":
            return "", text
        end = text.find(END_THINK)
        if end >= 0:
            self.mode = "content"
            return text[:end], text[end + len(END_THINK):]
        out, self.pending = _held(text, END_THINK, final)
        return out, ""


def _tool_call(body: str) -> dict | None:
    """OpenAI's tool call for one call's JSON body, or None if the body is not a call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": call["name"], "arguments": arguments}}


class ToolCallSplitter:
    """feed() each piece of a reply's content, get (its content, the tool calls it completed).
    Whitespace before a call is dropped with it (kept if the call turns out not to be one)."""

    def __init__(self):
        self.pending = ""  # waits for the next piece: a tail that could begin <tool_call>, trailing whitespace, a call
        self.gap = ""  # the whitespace before the open call
        self.inside = self.seen_call = False

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict]]:
        text, self.pending = self.pending + piece, ""
        content, calls = [], []

        def add(segment: str) -> None:  # whitespace between and after calls is dropped
            if segment.strip() or not self.seen_call:
                content.append(segment)

        while text or (final and self.inside):
            if not self.inside:
                start = text.find(CALL)
                if start < 0:
                    out, self.pending = _held(text, CALL, final)
                    if not final:
                        kept = out.rstrip()
                        out, self.pending = kept, out[len(kept):] + self.pending
                    add(out)
                    break
                kept = text[:start].rstrip()
                add(kept)
                self.gap, text, self.inside = text[len(kept):start], text[start + len(CALL):], True
                continue
            end = text.find(END_CALL)
            if end < 0 and not final:
                self.pending = text
                break
            body, text = (text[:end], text[end + len(END_CALL):]) if end >= 0 else (text, "")
            self.inside = False
            call = _tool_call(body)
            if call is None:
                content.append(self.gap + CALL + body + (END_CALL if end >= 0 else ""))
            else:
                calls.append(call)
                self.seen_call = True
        return "".join(content), calls


class ReplySplitter:
    """One chat choice's parts as its pieces arrive: {"content", and where parsed "reasoning" and
    "tool_calls" (each with its index among the choice's calls, as a stream delta has it)}; with
    parallel_calls false, the first call only (OpenAI's parallel_tool_calls; vLLM keeps the first)."""

    def __init__(self, prompt: str, reasoning: bool, tools: bool, parallel_calls: bool = True):
        self.reasoning = ReasoningSplitter(prompt) if reasoning else None
        self.tools = ToolCallSplitter() if tools else None
        self.parallel_calls = parallel_calls
        self.num_calls = 0

    def feed(self, piece: str, final: bool) -> dict:
        parts = {"content": piece}
        if self.reasoning is not None:
            parts["reasoning"], parts["content"] = self.reasoning.feed(piece, final)
        if self.tools is not None:
            parts["content"], calls = self.tools.feed(parts["content"], final)
            parts["tool_calls"] = [{"index": self.num_calls + i, **call} for i, call in enumerate(calls)
                                   if self.parallel_calls or self.num_calls + i == 0]
            self.num_calls += len(calls)
        return parts
