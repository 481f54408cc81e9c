"""Qwen3's reasoning parser (vLLM's `--reasoning-parser qwen3`): the thinking of a chat reply, the
text between <think> and </think>, goes to the message's `reasoning` (vLLM's field), the rest to
its `content`.

A reply thinks when it opens with <think> (Qwen3's first releases) or when its prompt already did
(the templates of Qwen3-2507's thinking models and later put <think> after the assistant header).
A prompt that closes the thinking (enable_thinking=False leaves an empty <think></think> there) or
never opens it gives content only, as does a reply without the tags (instruct models). A reply that
ends before </think> is all reasoning.
"""
START, END = "<think>", "</think>"
PARSERS = ("qwen3",)


def _could_begin(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningSplitter:
    """One reply's text split as it arrives: feed() each piece, get its (reasoning, content). A tail
    that could still be the start of a tag waits for the next piece (or the last, `final`)."""

    def __init__(self, prompt: str):
        self.mode = "reasoning" if prompt.rstrip().endswith(START) else "start"
        self.pending = ""

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        text, self.pending = self.pending + piece, ""
        if self.mode == "start":
            if START.startswith(text) and not final:
                self.pending = text
                return "", ""
            self.mode = "reasoning" if text.startswith(START) else "content"
            text = text.removeprefix(START)
        if self.mode == "content":
            return "", text
        end = text.find(END)
        if end >= 0:
            self.mode = "content"
            return text[:end], text[end + len(END):]
        held = 0 if final else _could_begin(text, END)
        self.pending = text[len(text) - held:]
        return text[:len(text) - held], ""
