"""The engine with an FP8 KV cache: sized for its bytes, close to HF, the bundled model still right."""
import pytest
import torch
from tiny_qwen3 import greedy_agreement, hf_greedy

from tritonllm import BUNDLED_MODEL, LLM, SamplingParams
from tritonllm.config import EngineConfig
from tritonllm.engine.scheduler import ScheduledBatch
from tritonllm.engine.step_inputs import build_step_inputs
from tritonllm.kernels import qk_norm_rotary
from tritonllm.layers.attention import kv_bytes_per_token
from tritonllm.tiny_tasks import EVAL_SEED, problems

PROMPTS = [list(range(3 * i + 1, 3 * i + 4 + 5 * i)) for i in range(12)]  # 4 to 59 tokens


def test_unknown_kv_cache_dtype_is_an_error(tiny_qwen3):
    for value in ("int8", "fp8_e5m2", "FP8"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype={value!r} is invalid: .*one of auto, fp8, fp8_e4m3"):
            LLM(str(tiny_qwen3), kv_cache_dtype=value)


def test_vllm_name_fp8_e4m3_is_the_fp8_cache():
    config = EngineConfig.from_options(BUNDLED_MODEL, kv_cache_dtype="fp8_e4m3")
    assert config.kv_cache_dtype == "fp8_e4m3" and config.cache_dtype == torch.float8_e4m3fn


def test_fp8_on_a_gpu_without_e4m3_is_a_clear_error(monkeypatch):
    # A GPU before Ada (here an sm_80 one, faked) has no e4m3 in Triton: an error naming the option,
    # not a compile failure deep in the first kernel. The torch reference kernels take fp8 anywhere.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    for value in ("fp8", "fp8_e4m3"):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype='{value}' is invalid: .*capability 8\.0.*'{value}' needs 8\.9"):
            EngineConfig.from_options(BUNDLED_MODEL, device="cuda", kv_cache_dtype=value)
    assert EngineConfig.from_options(BUNDLED_MODEL, device="cuda", kv_cache_dtype="fp8",
                                     kernels="reference").kv_cache_dtype == "fp8"
    assert EngineConfig.from_options(BUNDLED_MODEL, device="cuda").kv_cache_dtype == "auto"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert EngineConfig.from_options(BUNDLED_MODEL, device="cuda", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


def test_an_fp8_token_takes_half_the_bytes_plus_its_scales(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), num_kv_blocks=8, kv_cache_dtype="fp8")
    model = llm.runner.model
    # 2 layers x (K and V) x 2 KV heads x (32 values + a float32 scale)
    assert kv_bytes_per_token(model, torch.float8_e4m3fn) == 2 * 2 * 2 * (32 + 4)
    assert kv_bytes_per_token(model, torch.bfloat16) == 2 * 2 * 2 * 32 * 2
    attention = next(m for m in model.modules() if hasattr(m, "k_scale"))
    assert attention.k_cache.dtype == torch.float8_e4m3fn and attention.k_scale.shape == (8, 16, 2)
    # Head-major scales (kernels/fp8.empty_kv_scales): a head's 16 scales of a block are adjacent.
    assert attention.k_scale.stride() == attention.v_scale.stride() == (32, 1, 16)
    llm.close()


def test_fp8_greedy_tokens_mostly_equal_hf(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), max_num_seqs=8, num_kv_blocks=64, kv_cache_dtype="fp8")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    expected = [hf_greedy(tiny_qwen3, p, 4) for p in PROMPTS]
    tokens = [o.token_ids for o in outputs]
    first, second = greedy_agreement(tokens, expected)
    # The second token is the first decode step over the e4m3 cache (tiny_qwen3.greedy_agreement).
    assert first >= 0.75 * len(PROMPTS) and second >= 0.75 * first, list(zip(tokens, expected))
    assert llm.block_manager.num_free_blocks == 64
    llm.close()


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="TP=2 on GPUs needs two of them; on CPU it runs under gloo")
def test_fp8_tensor_parallel_2_equals_1(tiny_qwen3):
    # Each rank quantizes, stores and copies out its own KV heads' blocks.
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = {}
    for tp in (1, 2):
        with LLM(str(tiny_qwen3), max_num_seqs=8, num_kv_blocks=64, kv_cache_dtype="fp8",
                 tensor_parallel_size=tp) as llm:
            outputs[tp] = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert outputs[2] == outputs[1]


def test_the_bundled_model_keeps_its_accuracy_with_fp8():
    tasks = problems(40, EVAL_SEED)
    llm = LLM(BUNDLED_MODEL, kv_cache_dtype="fp8")
    outputs = llm.generate([p for p, _ in tasks], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert sum(o.text == answer for o, (_, answer) in zip(outputs, tasks)) >= 0.9 * len(tasks)
    llm.close()


def test_fp8_prefill_on_block_copies_equals_reading_the_cache(tiny_qwen3):
    # The engine runs prefill over an fp8 cache on copies of the step's blocks (gather_kv_blocks):
    # each step's logits equal those of the same step read straight from the cache, for whole
    # prompts and for second chunks over a cached context.
    llm = LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=32, kv_cache_dtype="fp8")
    block_size, limit = llm.block_manager.block_size, llm.config.prefill_gather_blocks
    assert limit > 0
    seqs = [llm.make_sequence(list(range(start, start + n)), SamplingParams(max_tokens=1))
            for start, n in ((1, 40), (50, 23), (80, 3))]
    for seq in seqs:
        llm.block_manager.allocate(seq)
    for step in ([21, 17, 3], [19, 6]):  # the two longer prompts in two chunks, the short one at once
        batch = ScheduledBatch(seqs[:len(step)], step, True, [True] * len(step))
        direct = build_step_inputs(batch, {}, block_size)
        copied = build_step_inputs(batch, {}, block_size, limit)
        assert direct.gather_blocks is None and copied.gather_blocks is not None
        expected = llm.runner.execute(direct)[0]
        torch.testing.assert_close(llm.runner.execute(copied)[0], expected, rtol=1e-4, atol=1e-4)
        for seq, n in zip(batch.seqs, step):
            seq.num_computed_tokens += n
    for seq in seqs:
        llm.block_manager.deallocate(seq)
    assert llm.block_manager.num_free_blocks == 32
    llm.close()


def test_fp8_through_prefix_hits_chunks_and_preemption(tiny_qwen3):
    # Four prompts over a 32-token prefix a finished request left in the cache (two blocks of 16),
    # in 24-token steps (chunks), in 8 blocks where they need 2 + 4 x 2: prefix hits gathered into
    # the prefill copies, chunks over cached blocks, preemptions. The tokens equal those of a run
    # with room for everything, and every block comes back.
    prefix = list(range(200, 232))
    prompts = [prefix + list(range(10 * i + 1, 10 * i + 11)) for i in range(4)]  # 42 tokens: 54 with the output
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=64, kv_cache_dtype="fp8") as roomy:
        want = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=8, max_num_batched_tokens=24, kv_cache_dtype="fp8")
    tight.generate([prefix + [7]], SamplingParams(max_tokens=1), use_tqdm=False)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == want
    assert sum(o.num_cached_tokens for o in outputs) >= 32 and tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 8
    tight.close()


@pytest.mark.parametrize("block_size", [16, 32])
def test_fp8_prefill_programs_of_several_tokens(tiny_qwen3, monkeypatch, block_size):
    # Prefill-sized steps store K/V 4 tokens a program, and at blocks of 32 or more keys V from
    # programs of 32 tokens and a KV head (kernels/qk_norm_rotary.py). Forced onto a tiny model's
    # steps: prompts that fill whole and partial blocks after a 32-token prefix hit, in chunks of 56
    # tokens that start off every alignment. The cache, and so every token, equals that of one token
    # a program, and every block comes back.
    prefix = list(range(300, 332))
    prompts = [prefix + list(range(12 * i + 1, 12 * i + 1 + n)) for i, n in enumerate((48, 5, 30, 17))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for tokens_per_program in (1, 4):
        monkeypatch.setattr(qk_norm_rotary._TUNING, "default", lambda *bucket, t=tokens_per_program: {
            "TOKENS": t, "num_warps": 1, "num_stages": 1, "DIRECT_STORES": True})
        with LLM(str(tiny_qwen3), max_num_seqs=4, num_kv_blocks=24, kv_block_size=block_size,
                 max_num_batched_tokens=56, kv_cache_dtype="fp8") as llm:
            llm.generate([prefix + [7]], SamplingParams(max_tokens=1), use_tqdm=False)
            done = llm.generate(prompts, params, use_tqdm=False)
            outputs[tokens_per_program] = [o.token_ids for o in done]
            assert sum(o.num_cached_tokens for o in done) >= 32
            assert llm.block_manager.num_free_blocks == 24
    assert outputs[4] == outputs[1]


def test_fp8_kernels_equal_the_reference_backend(tiny_qwen3):
    # The torch references quantize K/V the same way (kernels/reference.py): through chunked
    # prefill (32-token steps) and decode over the e4m3 cache, the Triton kernels give the same
    # tokens and log-probabilities. Agreement with HF (above) only bounds how far fp8 may drift. The
    # tolerance: a K or V element a float32 ulp from an e4m3 rounding boundary may take the other
    # code, which moves a logprob by up to a few 1e-3; the fp8 cache's own error here is 0.08-0.23.
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
    outputs = {}
    for kernels in ("triton", "reference"):
        with LLM(str(tiny_qwen3), max_num_seqs=8, num_kv_blocks=64, max_num_batched_tokens=32, kv_cache_dtype="fp8",
                 kernels=kernels) as llm:
            outputs[kernels] = llm.generate(PROMPTS, params, use_tqdm=False)
    for ours, want in zip(outputs["triton"], outputs["reference"]):
        assert ours.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(ours.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-2)
