"""OpenAI responses and stream chunks made from the engine's outputs.

An output item is (key, choice, token_ids, text, logprobs, top_logprobs, final, prompt) as
engine_loop sends it; final is None or (finish_reason, cached_tokens, stop_reason), prompt None or the
prompt's scores. The items of one choice that arrive together are merged into one chunk, so a reader
that fell behind catches up in one write.
"""
import json
import time
import uuid

from tritonllm.server.protocol import GenerateRequest
from tritonllm.server.reply import ReplySplitter

FLOOR = -9999.0  # JSON has no -inf: a logprob below this is sent as this


class Piece:
    """The merged outputs of one choice: a stream chunk's worth, or the whole completion."""
    __slots__ = ("text", "token_ids", "logprobs", "top_logprobs", "finish_reason", "stop_reason", "cached_tokens",
                 "prompt")

    def __init__(self):
        self.text, self.token_ids, self.logprobs, self.top_logprobs = [], [], [], []
        self.finish_reason = self.stop_reason = self.prompt = None
        self.cached_tokens = 0


def merge(items: list[tuple]) -> dict[int, Piece]:
    pieces: dict[int, Piece] = {}
    for _, choice, token_ids, text, logprobs, top_logprobs, final, prompt in items:
        piece = pieces.get(choice)
        if piece is None:
            piece = pieces[choice] = Piece()
        piece.text.append(text)
        piece.token_ids += token_ids
        if logprobs:
            piece.logprobs += logprobs
        if top_logprobs:
            piece.top_logprobs += top_logprobs
        if final is not None:
            piece.finish_reason, piece.cached_tokens, piece.stop_reason = final
        if prompt is not None:
            piece.prompt = prompt
    return pieces


def _floor(logprob: float | None) -> float | None:
    return None if logprob is None else logprob if logprob > FLOOR else FLOOR  # NaN too


class Renderer:
    """Builds one request's response (or its stream's chunks) in the OpenAI format."""

    def __init__(self, request: GenerateRequest, model: str, tokenizer, token_cache: dict,
                 prompt_token_ids: list[list[int]] | None = None, reasoning: bool = False):
        self.request, self.chat = request, request.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.decoder = tokenizer  # for an echo's text
        self.tokenizer = tokenizer if not request.tokens_as_ids else None
        self.token_cache = token_cache  # token id -> its text, shared by the requests of one tokenizer
        self.offsets: dict[int, int] = {}  # completions logprobs: text_offset reached, per choice
        self.completion_tokens = self.cached_tokens = 0
        self.prompt_token_ids = prompt_token_ids or []  # each prompt's, as the engine encoded it
        # vLLM's, with return_token_ids: a completion choice's first chunk, a chat response or its first chunks.
        self.prompt_ids_sent: set[int] = set()  # completion choices that carried theirs
        self.echoed: set[int] = set()  # completion choices whose prompt went out
        self.choice_tokens: dict[int, int] = {}  # completion tokens sent, per choice
        # A chat choice's text split into its parts, per choice, where reasoning or tool calls are parsed.
        self.reasoning = reasoning and self.chat
        self.splitters: dict[int, ReplySplitter] | None = {} if self.reasoning or request.parse_tools else None
        head = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": model}
        self.chunk_head = "data: " + json.dumps(head, separators=(",", ":"))[:-1] + ',"choices":['

    # ---- pieces

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        text = self.token_cache.get(token_id)
        if text is None:
            text = self.token_cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def _completion_logprobs(self, choice: int, token_ids: list[int], logprobs: list, tops: list | None) -> dict:
        tokens = [self.token(t) for t in token_ids]
        offsets, offset = [], self.offsets.get(choice, 0)
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        self.offsets[choice] = offset
        # OpenAI's: each token's logprob and the `logprobs` likeliest others (up to logprobs + 1 a step);
        # an echoed prompt's first token has none.
        k = self.request.logprobs
        top = [None if lp is None else {self.token(t): _floor(lp)} |
               {self.token(a): _floor(v) for a, v in list(others.items())[:k] if a != t}
               for t, lp, others in zip(token_ids, logprobs, tops or [{}] * len(token_ids))]
        return {"tokens": tokens, "token_logprobs": [_floor(lp) for lp in logprobs], "top_logprobs": top,
                "text_offset": offsets}

    def _echo(self, index: int, piece: Piece) -> tuple[str, dict | None]:
        """A completion choice's prompt, once: its text (a token-id or truncated prompt decoded) and its logprobs."""
        self.echoed.add(index)
        p = index // self.request.params.n
        prompt, ids = self.request.prompts[p], self.prompt_token_ids[p]
        whole = isinstance(prompt, str) and self.request.params.truncate_prompt_tokens is None
        text = prompt if whole else self.decoder.decode(ids)
        if self.request.logprobs is None or piece.prompt is None:
            return text, None
        return text, self._completion_logprobs(index, ids, *piece.prompt[:2])

    def _vllm_prompt_logprobs(self, index: int, piece: Piece) -> list | None:
        """vLLM's prompt_logprobs: per prompt token, None first, then {id: {logprob, rank, decoded_token}}
        for it (first, ranked in the vocabulary) and the likeliest tokens."""
        if piece.prompt is None:
            return None
        ids, (logprobs, tops, ranks) = self.prompt_token_ids[index // self.request.params.n], piece.prompt
        out = [None]
        for token, logprob, rank, top in zip(ids[1:], logprobs[1:], ranks[1:], (tops or [None] * len(ids))[1:]):
            ranked = {token: (rank, logprob)}  # its own logprob
            ranked.update((t, (r, lp)) for r, (t, lp) in enumerate((top or {}).items(), 1) if t != token)
            out.append({t: {"logprob": _floor(lp), "rank": r, "decoded_token": self.token(t)}
                        for t, (r, lp) in ranked.items()})
        return out

    def _chat_logprobs(self, piece: Piece) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token(token_id)
            return {"token": text, "logprob": _floor(logprob), "bytes": list(text.encode())}

        content = []
        tops = piece.top_logprobs or [{}] * len(piece.token_ids)
        for token_id, logprob, alternatives in zip(piece.token_ids, piece.logprobs, tops):
            ranked = sorted(alternatives.items(), key=lambda kv: -kv[1])[:self.request.logprobs]
            # The sampled token among the alternatives carries its own logprob (the two may round apart).
            content.append({**entry(token_id, logprob), "top_logprobs": [entry(t, logprob if t == token_id else lp)
                                                                          for t, lp in ranked]})
        return {"content": content}

    def _choice(self, index: int, piece: Piece, whole: bool) -> dict:
        """A choice of a response (whole) or of a stream chunk."""
        if not self.request.generates:  # an echo alone: the token drawn is left out, max_tokens 0 ended it
            piece.text, piece.token_ids, piece.logprobs, piece.top_logprobs = [], [], [], []
            if piece.finish_reason == "stop":
                piece.finish_reason, piece.stop_reason = "length", None
        self.completion_tokens += len(piece.token_ids)
        self.choice_tokens[index] = self.choice_tokens.get(index, 0) + len(piece.token_ids)
        if index % self.request.params.n == 0:  # a prompt's first sample: the others hit its blocks
            self.cached_tokens += piece.cached_tokens
        text, logprobs = "", None
        if self.request.echo and index not in self.echoed:
            text, logprobs = self._echo(index, piece)
        text += "".join(piece.text)
        if self.request.logprobs is not None and self.chat:
            logprobs = self._chat_logprobs(piece)
        elif self.request.logprobs is not None:
            generated = self._completion_logprobs(index, piece.token_ids, piece.logprobs, piece.top_logprobs)
            logprobs = generated if logprobs is None else {key: logprobs[key] + generated[key] for key in generated}
        if not self.chat:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": piece.finish_reason}
        else:
            parts, finish = {"content": text}, piece.finish_reason
            if self.splitters is not None:
                splitter = self.splitters.setdefault(
                    index, ReplySplitter(self.request.prompts[0], self.reasoning, self.request.parse_tools,
                                         self.request.parallel_tool_calls))
                parts = splitter.feed(text, whole or finish is not None)
                if splitter.num_calls and finish is not None:  # vLLM's, whatever ended the reply
                    finish = "tool_calls"
            if whole:
                message = {"role": "assistant", "content": parts["content"]}
                if self.splitters is not None:  # vLLM's: null where empty; calls without their stream index
                    message = {"role": "assistant", "content": parts["content"] or None}
                    if "reasoning" in parts:
                        message["reasoning"] = parts["reasoning"] or None
                    if "tool_calls" in parts:
                        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"}
                                                 for call in parts["tool_calls"]]
                choice = {"index": index, "message": message}
            else:
                choice = {"index": index, "delta": {name: part for name, part in parts.items() if part}}
            choice.update(logprobs=logprobs, finish_reason=finish)
        choice["stop_reason"] = piece.stop_reason  # vLLM's: the stop token id or string that ended it
        if self.request.return_token_ids:
            choice["token_ids"] = piece.token_ids
        if whole and not self.chat and self.request.params.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(index, piece)
        if self.request.return_token_ids and not self.chat and index not in self.prompt_ids_sent:
            choice["prompt_token_ids"] = self.prompt_token_ids[index // self.request.params.n]
            self.prompt_ids_sent.add(index)
        return choice

    def usage(self, prompt_tokens: int) -> dict:
        """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served."""
        return {"prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    # ---- whole responses

    def response(self, items: list[tuple], prompt_tokens: int) -> dict:
        pieces = merge(items)
        choices = [self._choice(i, pieces.get(i) or Piece(), whole=True) for i in range(self.request.num_choices)]
        response = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": choices, "usage": self.usage(prompt_tokens)}
        if self.chat and self.request.return_token_ids:
            response["prompt_token_ids"] = self.prompt_token_ids[0]
        if self.chat and self.request.params.prompt_logprobs is not None:
            response["prompt_logprobs"] = self._vllm_prompt_logprobs(0, pieces.get(0) or Piece())
        return response

    # ---- streams (server-sent events)

    def _event(self, choice: dict, head: str | None = None) -> str:
        """A chunk of one choice; with continuous usage it carries that choice's prompt and completion so far."""
        tail = "]}\n\n"
        if self.request.continuous_usage:
            prompt = len(self.prompt_token_ids[choice["index"] // self.request.params.n])
            done = self.choice_tokens.get(choice["index"], 0)
            usage = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            tail = '],"usage":' + json.dumps(usage, separators=(",", ":")) + "}\n\n"
        return (head or self.chunk_head) + json.dumps(choice, separators=(",", ":")) + tail

    def stream_start(self) -> str:
        """Chat streams open with the assistant's role, one chunk per choice."""
        if not self.chat:
            return ""
        ids = self.prompt_token_ids[0] if self.request.return_token_ids else None
        extra = "" if ids is None else '"prompt_token_ids":' + json.dumps(ids) + ","
        head = self.chunk_head.replace('"choices":[', extra + '"choices":[')
        return "".join(self._event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}, head) for i in range(self.request.num_choices))

    def stream_chunks(self, items: list[tuple]) -> str:
        """One event per choice that has news: text, tokens or its finish."""
        events = []
        for index, piece in merge(items).items():
            if piece.token_ids or piece.finish_reason is not None or any(piece.text):
                events.append(self._event(self._choice(index, piece, whole=False)))
        return "".join(events)

    def stream_usage(self, prompt_tokens: int) -> str:
        head = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage(prompt_tokens)}
        return "data: " + json.dumps(head, separators=(",", ":")) + "\n\n"
