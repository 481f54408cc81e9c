"""vLLM's allowed_token_ids end to end on the tiny checkpoint, against HF transformers' float32 logits:
greedy and sampled draws, beside logit_bias and rows without a set, and the values refused."""
import pytest
import torch

from tritonllm import LLM, SamplingParams

NUM_BLOCKS = 32
PROMPT = list(range(40, 75))
ALLOWED = [5, 17, 200, 381]


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    with LLM(str(tiny_qwen3), max_num_seqs=8, num_kv_blocks=NUM_BLOCKS) as engine:
        yield engine


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].double()


def hf_restricted_greedy(hf, prompt, allowed, n, bias=None):
    """Greedy tokens among `allowed` (logits plus `bias`), and each one's raw logprob."""
    ids, logprobs = list(prompt), []
    for _ in range(n):
        logits = hf_logits(hf, ids)
        biased = logits.clone()
        for token, value in (bias or {}).items():
            biased[token] += value
        ids.append(max(allowed, key=lambda t: biased[t]))
        logprobs.append(float(logits.log_softmax(-1)[ids[-1]]))
    return ids[len(prompt):], logprobs


def test_greedy_draws_the_likeliest_allowed_token_and_other_rows_are_untouched(llm, hf):
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    restricted = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=ALLOWED, logprobs=True)
    want, raw = hf_restricted_greedy(hf, PROMPT, ALLOWED, 6)
    outputs = llm.generate([PROMPT, PROMPT[3:30]], [restricted, plain], use_tqdm=False)
    assert outputs[0].token_ids == want and outputs[0].logprobs == pytest.approx(raw, abs=1e-4)
    free = llm.generate([PROMPT, PROMPT[3:30]], plain, use_tqdm=False)
    assert outputs[1].token_ids == free[1].token_ids and free[0].token_ids != want  # so the set matters
    assert llm.block_manager.num_free_blocks == NUM_BLOCKS


def test_logit_bias_moves_the_choice_within_the_set(llm, hf):
    bias = {ALLOWED[0]: 30.0, 3: 100.0}  # token 3 is not allowed: its bias must not let it in
    want, _ = hf_restricted_greedy(hf, PROMPT, ALLOWED, 4, bias)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, allowed_token_ids=ALLOWED,
                                                logit_bias=bias), use_tqdm=False)[0]
    assert out.token_ids == want and 3 not in out.token_ids


def test_draws_follow_the_distribution_renormalized_over_the_set(llm, hf):
    """First tokens of 256 seeded samples at temperature 1.5 against softmax(logits / 1.5) over the
    set: each count within 4.5 standard deviations of its expectation."""
    allowed = [9, 40, 41, 80, 300]
    outs = [out for seed in (1, 2) for out in llm.generate(
        [PROMPT], SamplingParams(temperature=1.5, max_tokens=1, ignore_eos=True, allowed_token_ids=allowed, n=128,
                                 seed=seed), use_tqdm=False)]
    counts = torch.bincount(torch.tensor([out.token_ids[0] for out in outs]), minlength=384).double()
    assert counts[allowed].sum() == len(outs)
    probs = (hf_logits(hf, PROMPT)[allowed] / 1.5).softmax(-1)
    expected = len(outs) * probs
    assert probs.min() > 0.005 and probs.max() < 0.9  # a set where sampling is not greedy
    assert torch.all((counts[allowed] - expected).abs() <= 4.5 * (expected * (1 - probs)).sqrt() + 1)


@pytest.mark.parametrize("value, error", [([], ValueError), ([3, -1], ValueError), (["a"], TypeError), (5, TypeError)])
def test_bad_sets_name_the_field(value, error):
    with pytest.raises(error, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=value)


def test_sets_the_model_cannot_serve_are_refused_when_added(llm):
    with pytest.raises(ValueError, match=r"allowed_token_ids has token id 384: must be in \[0, 383\)"):
        llm.add_request(PROMPT, SamplingParams(allowed_token_ids=[1, 384]))
    eos = sorted(llm.eos_ids)
    with pytest.raises(ValueError, match="allowed_token_ids.*min_tokens=2"):
        llm.add_request(PROMPT, SamplingParams(allowed_token_ids=eos + [7], stop_token_ids=[7], min_tokens=2))
    # min_tokens bans the stop ids by index: one past the vocabulary would fail the step of every request
    with pytest.raises(ValueError, match=r"stop_token_ids has token id 383: must be in \[0, 383\)"):
        llm.add_request(PROMPT, SamplingParams(stop_token_ids=[5, 383], min_tokens=2))
    with pytest.raises(ValueError, match="stop_token_ids and EOS cover.*min_tokens=1"):
        llm.add_request(PROMPT, SamplingParams(stop_token_ids=list(range(383)), min_tokens=1))
    out = llm.generate([PROMPT], SamplingParams(allowed_token_ids=eos, max_tokens=3), use_tqdm=False)[0]
    assert out.token_ids[0] in eos and out.finish_reason == "stop"
    assert not llm.has_unfinished() and llm.block_manager.num_free_blocks == NUM_BLOCKS
