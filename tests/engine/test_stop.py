"""How requests finish, on text: stop strings cut from the text (never shown by a stream first),
min_tokens, EOS and stop tokens on the last allowed token."""
import dataclasses
import json
import random
import shutil

import pytest

from tritonllm import BUNDLED_MODEL, LLM, SamplingParams
from tritonllm.engine.output import IncrementalText

PROMPT = "the quick brown"
N = 16


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=32) as engine:
        yield engine


@pytest.fixture(scope="module")
def full(llm):
    """The greedy completion without stops: its tokens, its text and where each token's text ends."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)[0]
    ends = [len(llm.tokenizer.decode(out.token_ids[:i + 1], skip_special_tokens=True)) for i in range(N)]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) and len(out.text) > 12
    return out.token_ids, out.text, ends


def streamed(llm, params):
    deltas, tokens, final = [], [], None
    for event in llm.stream([PROMPT], params):
        deltas.append(event.text_delta)
        tokens += event.new_token_ids
        final = event.output
    return deltas, tokens, final


def check_stop(llm, full, stop, min_tokens=0, include=False):
    tokens, text, ends = full
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=stop, min_tokens=min_tokens,
                            include_stop_str_in_output=include)
    # Stop strings count where they end past the text of the first min_tokens tokens.
    start = ends[min_tokens - 1] if min_tokens else 0
    # The stop that ends first counts, as a stream of one character a token would find it.
    hits = sorted((i + len(s), i, s) for s in stop for i in [text.find(s, max(0, start - len(s) + 1))] if i >= 0)
    end, cut, first = hits[0] if hits else (None, None, None)
    deltas, got_tokens, final = streamed(llm, params)
    assert "".join(deltas) == final.text  # nothing shown that the stop later removed
    for i in range(len(deltas)):
        assert text.startswith("".join(deltas[:i + 1]))
    if cut is None:
        assert final.text == text and final.finish_reason == "length" and got_tokens == tokens
        assert final.stop_reason is None
    else:
        assert final.stop_reason == first  # vLLM's stop_reason
        assert final.text == text[:end if include else cut] and final.finish_reason == "stop"
        last = next(i for i, token_end in enumerate(ends) if token_end >= end)
        assert got_tokens == tokens[:max(last + 1, min_tokens)]  # through the token that completed the stop
    generated = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert (generated.text, generated.token_ids, generated.finish_reason) == (final.text, final.token_ids, final.finish_reason)
    assert llm.block_manager.num_free_blocks == 32


@pytest.mark.parametrize("length", [1, 2, 3, 4])
def test_stop_strings_of_each_length(llm, full, length):
    text = full[1]
    check_stop(llm, full, [text[6:6 + length]])


def test_stop_split_across_tokens(llm, full):
    _, text, ends = full
    boundary = ends[clean_boundaries(text, ends)[1]]
    check_stop(llm, full, [text[boundary - 1:boundary + 1]])


def test_stops_sharing_a_prefix_and_one_never_seen(llm, full):
    text = full[1]
    check_stop(llm, full, [text[8:12], text[8:10], "\x00never"])
    check_stop(llm, full, ["\x00never"])


@pytest.mark.parametrize("length", [1, 3])
def test_stop_string_kept_with_include_stop_str_in_output(llm, full, length):
    tokens, text, ends = full
    boundary = ends[clean_boundaries(text, ends)[1]]
    check_stop(llm, full, [text[boundary - 1:boundary - 1 + length], "\x00never"], include=True)
    check_stop(llm, full, [text[8:12], text[8:10]], include=True)  # the first to end is kept whole
    check_stop(llm, full, [text[7:12], text[8:10]])  # starts later, ends first: it counts


def test_the_stop_that_ends_first_counts_however_the_text_is_split():
    """Stops "quick" and "ui" both complete inside one token " quick": "ui" ends first, as it does
    when the same text comes a character a token."""
    for pieces in (["the", " quick"], list("the quick")):
        for include, want in ((False, "the q"), (True, "the qui")):
            text = IncrementalText(PieceTokenizer(pieces), ["quick", "ui"], 0, include_stop=include)
            found = next(found for n in range(1, len(pieces) + 1) if (found := text.update(list(range(n)))))
            assert (found, text.text) == ("ui", want)


def clean_boundaries(text, ends):
    """Token indices i whose text ends on a whole character, with whole characters around the end
    (the random model also samples bytes of partial UTF-8 characters)."""
    return [i for i, end in enumerate(ends[:-1]) if 0 < end < len(text) and "\ufffd" not in text[max(0, end - 2):end + 2]]


@pytest.mark.parametrize("which", [0, 2])
def test_stop_strings_wait_for_min_tokens(llm, full, which):
    _, text, ends = full
    i = clean_boundaries(text, ends)[which]
    check_stop(llm, full, [text[ends[i] - 1:ends[i] + 1]], min_tokens=i + 1)  # straddles the min_tokens text
    check_stop(llm, full, [text[max(0, ends[i] - 2):ends[i]]], min_tokens=i + 1)  # ends inside it: ignored there


def test_eos_or_stop_token_as_the_last_allowed_token_is_a_stop(llm, full):
    tokens = full[0]
    k = next(i for i in range(1, N) if tokens[i] not in tokens[:i])  # its first appearance is the last token
    last = SamplingParams(temperature=0, max_tokens=k + 1, stop_token_ids=[tokens[k]])
    before = llm.tokenizer.decode(tokens[:k], skip_special_tokens=True).rstrip("\ufffd")
    assert llm.tokenizer.decode(tokens[:k + 1], skip_special_tokens=True) != before  # the stop token has text
    for out in (llm.generate([PROMPT], last, use_tqdm=False)[0], streamed(llm, last)[2]):
        # As in vLLM: the stop token ends token_ids, its text is left out, stop_reason names it.
        assert out.token_ids == tokens[:k + 1] and out.finish_reason == "stop"
        assert out.text == before and out.stop_reason == tokens[k]
    deltas, _, _ = streamed(llm, last)
    assert "".join(deltas) == before
    kept = dataclasses.replace(last, include_stop_str_in_output=True)  # vLLM's flag keeps the stop token's text
    for out in (llm.generate([PROMPT], kept, use_tqdm=False)[0], streamed(llm, kept)[2]):
        assert out.text == llm.tokenizer.decode(tokens[:k + 1], skip_special_tokens=True).rstrip("\ufffd")
    assert "".join(streamed(llm, kept)[0]) == out.text
    saved = llm.eos_id, llm.eos_ids
    try:
        llm.eos_ids = {llm.eos_id, tokens[k]}  # an extra EOS id (generation_config's): vLLM names it in stop_reason
        extra = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=k + 1), use_tqdm=False)[0]
        llm.eos_id, llm.eos_ids = tokens[k], {tokens[k]}
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=k + 1), use_tqdm=False)[0]
        within_min = SamplingParams(temperature=0, max_tokens=k + 1, min_tokens=k + 1)
        eos_within_min = llm.generate([PROMPT], within_min, use_tqdm=False)[0]
        # vLLM masks EOS within min_tokens with ignore_eos too; past them EOS is drawn and does not stop.
        ignored_within_min = llm.generate([PROMPT], dataclasses.replace(within_min, ignore_eos=True), use_tqdm=False)[0]
        ignored = llm.generate([PROMPT], dataclasses.replace(last, stop_token_ids=[], max_tokens=k + 2, ignore_eos=True),
                               use_tqdm=False)[0]
    finally:
        llm.eos_id, llm.eos_ids = saved
    assert extra.token_ids == tokens[:k + 1] and extra.finish_reason == "stop" and extra.stop_reason == tokens[k]
    assert out.token_ids == tokens[:k + 1] and out.finish_reason == "stop"
    assert out.text == before and out.stop_reason is None  # EOS: no stop_reason, and no text either
    # Within min_tokens EOS is not drawn (vLLM's rule): the greedy choice there is the next best token.
    assert eos_within_min.finish_reason == "length" and eos_within_min.token_ids[:k] == tokens[:k]
    assert eos_within_min.token_ids[k] != tokens[k]
    assert ignored_within_min.token_ids == eos_within_min.token_ids
    assert ignored.token_ids[:k + 1] == tokens[:k + 1] and ignored.finish_reason == "length"
    stop_within_min = llm.generate([PROMPT], dataclasses.replace(within_min, stop_token_ids=[tokens[k]], ignore_eos=True),
                                   use_tqdm=False)[0]
    assert stop_within_min.token_ids == eos_within_min.token_ids


@pytest.mark.parametrize("abort_after", [1, 3, 5])
def test_an_abort_hands_out_the_text_a_stop_string_held_back(llm, full, abort_after):
    """A stream aborted while its text ends in what could start a stop string: the final delta
    brings that tail, so the deltas still add up to the final text."""
    tokens, text, ends = full
    stop = text[ends[abort_after - 1] - 1] + "\u2603"  # the text's last character so far, then one it never makes
    request = llm.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=[stop]))
    deltas, got, final = [], [], None
    while final is None:
        for out in llm.step():
            deltas.append(out.text_delta)
            got += out.new_token_ids
            final = out.output
        if len(got) == abort_after and final is None:
            assert "".join(deltas) == text[:ends[abort_after - 1] - 1]  # the last character is held back
            llm.abort(request)
    assert final.finish_reason == "abort" and final.token_ids == got == tokens[:abort_after]
    assert "".join(deltas) == final.text == text[:ends[abort_after - 1]]
    assert llm.block_manager.num_free_blocks == 32


@pytest.mark.parametrize("stream, stop", [(True, None), (False, ["zzz"]), (False, None)])
def test_an_abort_keeps_the_characters_its_tokens_completed(llm, monkeypatch, stream, stop):
    """Each token decodes to "a" and the first byte of a two-byte character, as a byte-level BPE's
    tokens can cut characters: aborted, a request's text is the decode of its tokens less the open
    character, however it was made (streamed, or with stop strings, its text was empty)."""
    straddling, real = llm.tokenizer.convert_tokens_to_ids("a"), llm.tokenizer.decode

    def decode(ids, skip_special_tokens=True):
        return b"".join(b"a\xc3" if i == straddling else real([i], skip_special_tokens=skip_special_tokens).encode()
                        for i in ids).decode("utf-8", "replace")

    monkeypatch.setattr(llm.tokenizer, "decode", decode)
    params = SamplingParams(temperature=0, max_tokens=N, allowed_token_ids=[straddling], stop=stop)
    request = llm.add_request(PROMPT, params, stream=stream)
    deltas, steps, final = [], 0, None
    while final is None:
        for out in llm.step():
            deltas.append(out.text_delta)
            final = out.output
        steps += 1
        if steps == 3 and final is None:  # a request not streamed has no output before its last
            llm.abort(request)
    count = len(final.token_ids)
    assert final.finish_reason == "abort" and 2 <= count < N
    assert final.text == "a\ufffd" * (count - 1) + "a"
    assert "".join(deltas) == (final.text if stream else "")
    assert llm.block_manager.num_free_blocks == 32


class CharTokenizer:
    """One character per token; ids -1, -2 are the two bytes of "\u00e9" (a lone -1 decodes to U+FFFD);
    id 0 is a special token, "<0>"."""

    def decode(self, ids, skip_special_tokens=True):
        chars = []
        for i in ids:
            if i == 0:
                chars += [] if skip_special_tokens else ["<0>"]
            elif i == -2 and chars and chars[-1] == "\ufffd":
                chars[-1] = "\u00e9"
            else:
                chars.append("\ufffd" if i < 0 else chr(i))
        return "".join(chars)


class PieceTokenizer:
    """Token i is the i-th of a fixed list of text pieces."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def test_incremental_text_holds_back_a_possible_stop_and_partial_characters():
    text = IncrementalText(CharTokenizer(), ["gd", "xyz", "\u00e9!"], 0)
    ids, shown = [], []
    for token in [ord(c) for c in "egxyg"] + [-1, -2, ord("!")]:
        ids.append(token)
        found = text.update(ids)
        shown.append(text.delta(found is not None))
    # "g" could start "gd", "x" and "xy" "xyz"; the lone first byte waits; "\u00e9" could start "\u00e9!", which then stops.
    assert shown == ["e", "", "g", "", "xy", "", "g", ""]
    assert found == "\u00e9!" and text.text == "egxyg" == "".join(shown)


def test_each_delta_holds_back_exactly_the_longest_tail_that_could_begin_a_stop():
    # The held tail is searched only past the text already handed out; against the whole text's
    # longest tail, on random texts over two letters, where partial stops come and go.
    rng = random.Random(0)
    pieces = ["a", "b", "ab", "ba", "bab", "aab"]
    for _ in range(200):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(2, 7))) for _ in range(rng.randint(1, 3))]
        text, ids, shown = IncrementalText(PieceTokenizer(pieces), stops, 0), [], ""
        for _ in range(rng.randint(1, 12)):
            ids.append(rng.randrange(len(pieces)))
            if text.update(ids) is not None:
                break
            shown += text.delta(False)
            held = max((k for k in range(1, len(text.text) + 1) for stop in stops
                        if len(stop) > k and stop.startswith(text.text[-k:])), default=0)
            assert shown == text.text[:len(text.text) - held], (stops, text.text)


def test_incremental_text_keeps_the_stop_string_and_special_tokens_when_asked():
    ids, shown = [], []
    text = IncrementalText(CharTokenizer(), ["gd"], 0, include_stop=True, skip_special_tokens=False,
                           silent_ids=frozenset({0}))  # not silent when special tokens are shown
    for token in [ord("e"), 0, ord("g"), ord("d"), ord("x")]:
        ids.append(token)
        found = text.update(ids)
        shown.append(text.delta(found is not None))
        if found:
            break
    # Nothing is held back when the stop string stays in the text; the special token shows.
    assert shown == ["e", "<0>", "g", "d"] and found == "gd" and text.text == "e<0>gd"
    plain = IncrementalText(CharTokenizer(), [], 0)
    plain.update([ord("e"), 0, ord("g")], final=True)
    assert plain.text == "eg"


class CountingTokenizer(CharTokenizer):
    decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return super().decode(ids, skip_special_tokens)


def test_a_run_of_silent_tokens_is_decoded_with_the_next_other_token_only():
    """A stream of special tokens (EOS under ignore_eos, as a benchmark runs) is not decoded again at
    every token: the ids decoded grow with the tokens, not with their square (about 500k ids here
    before), and the text, the deltas and a stop string across the run are what they were."""
    tokenizer = CountingTokenizer()
    text = IncrementalText(tokenizer, ["gd"], 0, silent_ids=frozenset({0}))
    ids, shown = [], []
    for token in [ord("e")] + [0] * 500 + [ord("g")] + [0] * 500 + [ord("d"), ord("x")]:
        ids.append(token)
        found = text.update(ids)
        shown.append(text.delta(found is not None))
        if found:
            break
    assert found == "gd" and text.text == "e" == "".join(shown)
    assert tokenizer.decoded < 10 * len(ids)


def test_silent_ids_are_the_special_tokens_that_decode_to_nothing():
    with LLM(str(BUNDLED_MODEL), max_num_seqs=2, num_kv_blocks=16) as llm:
        assert llm.eos_id in llm.silent_ids
        assert all(llm.tokenizer.decode([i], skip_special_tokens=True) == "" for i in llm.silent_ids)
        assert not llm.silent_ids & set(llm.tokenizer.encode("rev abcd=", add_special_tokens=False))


def test_eos_ids_are_the_tokenizers_and_the_configs(tiny_qwen3, tmp_path):
    """A fine-tune that changed only its tokenizer's EOS stops there too (vLLM's model EOS is the
    tokenizer's); the config's and generation_config's stay stops."""
    path = tmp_path / "model"
    shutil.copytree(tiny_qwen3, path)
    config = json.loads((path / "config.json").read_text())
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "generation_config.json").unlink()
    with LLM(str(tiny_qwen3), num_kv_blocks=8) as llm:
        im_end, endoftext = (llm.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
        assert (llm.eos_id, llm.eos_ids) == (im_end, {im_end, endoftext})
        assert config["eos_token_id"] == im_end and tokenizer_config["eos_token"] == "<|im_end|>"
    (path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "<|endoftext|>"}))
    with LLM(str(path), num_kv_blocks=8) as llm:
        assert (llm.eos_id, llm.eos_ids) == (endoftext, {endoftext, im_end})
    for name in ("tokenizer.json", "tokenizer_config.json"):  # no tokenizer: every EOS id is named, as in vLLM
        (path / name).unlink()
    with LLM(str(path), num_kv_blocks=8) as llm:
        assert (llm.tokenizer, llm.eos_id, llm.eos_ids) == (None, None, {im_end})


def test_eos_ids_outside_the_vocabulary_are_ignored(tiny_qwen3, tmp_path, capsys):
    """A config naming EOS ids past the vocabulary (transformers only warns): they can never be
    sampled, so they end nothing; min_tokens, which bans the EOS ids, used to index past the logits."""
    path = tmp_path / "model"
    shutil.copytree(tiny_qwen3, path)
    config = json.loads((path / "config.json").read_text())
    vocab, im_end = config["vocab_size"], config["eos_token_id"]
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": [im_end, vocab + 7, -1]}))
    (path / "generation_config.json").unlink()
    with LLM(str(path), num_kv_blocks=8) as llm:
        assert f"EOS token ids [-1, {vocab + 7}]" in capsys.readouterr().err
        assert im_end in llm.eos_ids and all(0 <= i < vocab for i in llm.eos_ids)
        params = SamplingParams(temperature=0, max_tokens=4, min_tokens=3, logit_bias={im_end: 100})
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
        assert len(out.token_ids) == 4 and out.token_ids[3] == im_end and out.finish_reason == "stop"


def test_special_tokens_and_the_eos_text_as_asked():
    """The bundled model ends an answer with its EOS, <|im_end|>, a special token: vLLM shows its text
    only with skip_special_tokens=False and include_stop_str_in_output=True."""
    with LLM(str(BUNDLED_MODEL), max_num_seqs=2, num_kv_blocks=16) as llm:
        for skip, include, want in [(True, False, "dcba"), (False, False, "dcba"), (True, True, "dcba"),
                                    (False, True, "dcba<|im_end|>")]:
            params = SamplingParams(temperature=0, max_tokens=8, skip_special_tokens=skip, include_stop_str_in_output=include)
            out = llm.generate(["rev abcd="], params, use_tqdm=False)[0]
            deltas = [event.text_delta for event in llm.stream(["rev abcd="], params)]
            assert out.token_ids[-1] in llm.eos_ids and out.finish_reason == "stop" and out.stop_reason is None
            assert out.text == "".join(deltas) == want
