"""What a request may be: prompt types, parameters checked when added, vocab-sized options."""
import shutil

import numpy as np
import pytest
import torch
from tiny_qwen3 import hf_greedy

from tritonllm import BUNDLED_MODEL, LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=16) as engine:
        yield engine


@pytest.mark.parametrize("prompts", [None, 123, [None], [1.5], [[1, None]], [[1, True]], [[1, torch.tensor(True)]], {"a": 1},
                                     torch.tensor(5), np.array(5), [b"hello"], [{5: "a", 6: "b"}], [{5, 6}],
                                     {"prompt": [5, 6]}, {"prompt": "a", "prompt_token_ids": [5]},
                                     {"prompt_token_ids": "hello"}, {"prompt_token_ids": {"prompt": "hello"}}])
def test_prompts_of_the_wrong_type_are_type_errors(llm, prompts):
    with pytest.raises(TypeError, match="prompt"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.has_unfinished()


def test_a_bad_stream_raises_at_the_call(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.stream([[5] * 100_000], SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="prompt"):
        llm.stream([[5, None]])
    assert not llm.has_unfinished()


def test_a_completion_ends_at_max_model_len(tiny_qwen3):
    """vLLM's LLM: max_tokens past max_model_len is capped there (finish "length"), a prompt of
    max_model_len tokens still gets one token (its K/V is never computed), a longer one is refused;
    truncate_prompt_tokens=-1 keeps the last max_model_len tokens. The server's form refuses."""
    prompt = list(range(3, 13))  # 10 tokens
    greedy = SamplingParams(temperature=0, max_tokens=50, min_tokens=40, ignore_eos=True)
    with LLM(str(tiny_qwen3), max_num_seqs=2, max_model_len=16) as small:
        capped = small.generate([prompt], greedy, use_tqdm=False)[0]
        assert capped.token_ids == hf_greedy(tiny_qwen3, prompt, 6) and capped.finish_reason == "length"
        unbounded = SamplingParams(temperature=0, max_tokens=None, min_tokens=40, ignore_eos=True)  # capped alike
        assert small.generate([prompt], unbounded, use_tqdm=False)[0].token_ids == capped.token_ids
        with pytest.raises(ValueError, match=r"maximum context length is 16 tokens.*min_tokens \(40\) = 50 exceed it"):
            small.make_sequence(prompt, unbounded, strict_length=True)
        full = list(range(3, 19))  # 16 tokens
        assert small.generate([full], greedy, use_tqdm=False)[0].token_ids == hf_greedy(tiny_qwen3, full, 1)
        with pytest.raises(ValueError, match="maximum context length is 16 tokens.*the prompt has 17 tokens"):
            small.generate([full + [3]], greedy, use_tqdm=False)
        truncated = SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=-1)
        out = small.generate([[7] * 5 + full], truncated, use_tqdm=False)[0]
        assert out.prompt_token_ids == full and out.token_ids == hf_greedy(tiny_qwen3, full, 1)
        with pytest.raises(ValueError, match=r"maximum context length is 16 tokens.*max_tokens \(50\) = 60 exceed it"):
            small.make_sequence(prompt, greedy, strict_length=True)
        assert not small.has_unfinished() and small.block_manager.num_free_blocks == len(small.block_manager.blocks)


def test_prompts_of_one_token_each_and_vllm_prompt_dicts(llm):
    # A one-element tensor is not a token id: [[4], [5]] as a tensor or as tensors are two prompts.
    for prompts in (torch.tensor([[4], [5]]), [torch.tensor([4]), torch.tensor([5])], np.array([[4], [5]])):
        assert [o.prompt_token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == [[4], [5]]
    want = [o.token_ids for o in llm.generate([[5, 6, 7], "hi"], GREEDY, use_tqdm=False)]
    dicts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt": "hi"}]
    assert [o.token_ids for o in llm.generate(dicts, GREEDY, use_tqdm=False)] == want
    assert llm.generate(dicts[0], GREEDY, use_tqdm=False)[0].token_ids == want[0]


def test_numpy_and_torch_token_ids_are_prompts(llm):
    want = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
    for prompt in ([np.int64(5), np.int32(6), 7], np.array([5, 6, 7]), torch.tensor([5, 6, 7])):
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].token_ids == want
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == want
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_params_changed_after_construction_are_checked_when_added(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    params.temperature = float("inf")
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[5, 6]], params, use_tqdm=False)
    params.temperature, params.max_tokens = 0.0, 0
    with pytest.raises(ValueError, match="max_tokens"):
        llm.add_request([5, 6], params)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.add_request([5, 6], {"max_tokens": 4})
    assert not llm.has_unfinished()


def test_a_bad_request_in_a_batch_queues_none_of_it(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 6], [10**9]], GREEDY, use_tqdm=False)
    assert not llm.has_unfinished() and llm.scheduler.is_finished()


def test_a_top_k_past_the_vocabulary_is_off(llm):
    """A top_k beyond int32 must not wrap (2**32 + 1 would reach the kernel as 1, i.e. greedy)."""
    def draw(top_k):
        params = SamplingParams(temperature=1.5, top_k=top_k, max_tokens=12, seed=3, ignore_eos=True)
        return llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids

    off = draw(0)
    assert draw(2**32 + 1) == off == draw(llm.hf_config.vocab_size)
    assert draw(1) != off  # the seeded draw is not the greedy one, so the check above can fail


def test_unknown_characters_of_a_small_tokenizer_are_an_error():
    bundled = LLM(BUNDLED_MODEL)
    with pytest.raises(ValueError, match=r"does not know: '!HZ'.*abcdefghij"):
        bundled.generate(["Hi 12+34=Z!"], use_tqdm=False)
    with pytest.raises(ValueError, match="does not know"):
        bundled.chat([{"role": "user", "content": "What?"}])
    out = bundled.chat([{"role": "user", "content": "12+34"}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert out[0].text == "46"
    assert "".join(e.text_delta for e in bundled.chat([{"role": "user", "content": "rev abc"}],
                                                       SamplingParams(temperature=0, max_tokens=8), stream=True)) == "cba"
    for bad in (None, "12+34", {"role": "user", "content": "12+34"}, [[{"role": "user", "content": "1+1"}], "x"]):
        with pytest.raises(TypeError, match="messages must be a list"):
            bundled.chat(bad)
    bundled.close()


def test_stop_strings_need_a_tokenizer(tiny_qwen3, tmp_path):
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(tiny_qwen3 / name, tmp_path / name)
    with LLM(str(tmp_path), num_kv_blocks=4) as bare:
        assert bare.tokenizer is None
        with pytest.raises(ValueError, match=r"SamplingParams\.stop\b.*tokenizer"):
            bare.generate([[5, 6, 7]], SamplingParams(max_tokens=2, stop=["a"]), use_tqdm=False)
        with pytest.raises(ValueError, match="no tokenizer"):  # a template given does not make one
            bare.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template="{{ messages[0]['content'] }}")
        out = bare.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
        assert len(out.token_ids) == 4 and out.text is None


def test_a_request_fits_when_its_computed_tokens_fit(tiny_qwen3):
    """The last sampled token's K/V is never computed: prompt + max_tokens - 1 slots are enough, and
    decode takes a new block only past a full one, so two such requests in two blocks never preempt."""
    prompts = [list(range(1, 11)), list(range(20, 30))]  # 10 tokens: with 7 generated, 16 computed
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    with LLM(str(tiny_qwen3), max_num_seqs=2, num_kv_blocks=2) as small:
        assert [o.token_ids for o in small.generate(prompts, params, use_tqdm=False)] == \
            [hf_greedy(tiny_qwen3, p, 7) for p in prompts]
        assert small.scheduler.num_preemptions == 0
        small.add_request(prompts[0], SamplingParams(max_tokens=23))  # 32 computed: both blocks
        with pytest.raises(ValueError, match="can never fit"):
            small.add_request(prompts[0], SamplingParams(max_tokens=24))
        while small.has_unfinished():
            small.step()
        assert small.block_manager.num_free_blocks == 2
        # max_tokens=None (vLLM's): as many as the cache leaves, here those 23
        unbounded = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        out = small.generate([prompts[0]], unbounded, use_tqdm=False)[0]
        assert out.token_ids == hf_greedy(tiny_qwen3, prompts[0], 23) and out.finish_reason == "length"
        # SamplingParams.min_tokens: a server's 400 names the field from it
        with pytest.raises(ValueError, match=r"SamplingParams.min_tokens \(24\) can never fit the KV cache of 2 blocks"):
            small.generate([prompts[0]], SamplingParams(max_tokens=None, min_tokens=24), use_tqdm=False)
        # A prompt the cache cannot hold blames the prompt, whatever max_tokens (a server's 400 names the
        # field the message names: it named max_tokens, 16 by default, which no value could mend)
        for params in (unbounded, SamplingParams(max_tokens=1)):
            with pytest.raises(ValueError, match=r"^prompt \(33 tokens\) leaves no room") as refusal:
                small.generate([list(range(1, 34))], params, use_tqdm=False)
            assert "max_tokens" not in str(refusal.value)
        assert small.block_manager.num_free_blocks == 2 and not small.has_unfinished()


def test_sampling_params_per_prompt_are_checked(llm):
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams, got dict"):
        llm.generate([[5]], [{"max_tokens": 2}], use_tqdm=False)
    two = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert [len(o.token_ids) for o in llm.generate([[5], [6]], [GREEDY, two], use_tqdm=False)] == [4, 2]
    assert [len(o.token_ids) for o in llm.generate([[5], [6]], (two, GREEDY), use_tqdm=False)] == [2, 4]
    assert not llm.has_unfinished()


def test_logit_bias_moves_the_choice_and_leaves_logprobs_raw(llm):
    """OpenAI's logit_bias: added to the logits before sampling; the logprobs stay the model's."""
    asked = dict(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)
    plain = llm.generate([[5, 6, 7]], SamplingParams(**asked), use_tqdm=False)[0]
    top = plain.top_logprobs[0]
    first, second = sorted(top, key=top.get, reverse=True)
    gap = top[first] - top[second]  # the logits' gap
    for bias, chosen in (({first: -100}, second), ({second: gap + 0.05}, second), ({second: gap - 0.05}, first)):
        out = llm.generate([[5, 6, 7]], SamplingParams(**asked, logit_bias=bias), use_tqdm=False)[0]
        assert out.token_ids[0] == chosen and out.logprobs[0] == pytest.approx(top[chosen], abs=1e-5)
        assert out.top_logprobs[0] == pytest.approx(top, abs=1e-5)
    forced = SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True, logit_bias={9: 100})
    assert llm.generate([[5, 6, 7]], forced, use_tqdm=False)[0].token_ids == [9] * 4
    vocab = llm.hf_config.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias has token id {vocab}: must be in \[0, {vocab}\)"):
        llm.generate([[5]], SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    assert not llm.has_unfinished()


def test_truncate_prompt_tokens_keeps_the_last_k(llm, tiny_qwen3):
    prompt = list(range(30, 70))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=9),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-9:] and out.token_ids == hf_greedy(tiny_qwen3, prompt[-9:], 4)
    whole = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=-1),
                         use_tqdm=False)[0]
    assert whole.prompt_token_ids == prompt  # -1: up to max_model_len
    with pytest.raises(ValueError, match=r"leaves no room for a completion in the KV cache"):  # 512 tokens kept, 256 slots
        llm.add_request(list(range(1, 300)) * 2, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1))
    for value, error in ((0, ValueError), (-2, ValueError), ("3", TypeError)):
        with pytest.raises(error, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=value)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=513 is invalid: must be <= max_model_len \(512\)"):
        llm.add_request(prompt, SamplingParams(max_tokens=4, truncate_prompt_tokens=513))
    assert not llm.has_unfinished()
