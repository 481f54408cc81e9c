"""CUDA graphs for short prefill steps: which graph a step replays, and (on a GPU) that replays
compute what eager steps do: HF's greedy tokens with padded tokens and sequences, prefix hits,
chunks, and MoE layers."""
import random
from types import SimpleNamespace

import pytest
import torch
from graph_stand_in import count_replays, stand_in
from tiny_qwen3 import build_tiny_qwen3, build_tiny_qwen3_moe, hf_greedy

from tritonllm import LLM, SamplingParams
from tritonllm.engine.graphs import PrefillGraphs, prefill_graph_key, prefill_graph_keys

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_graph_keys_follow_the_step_limits():
    keys = prefill_graph_keys(16384, 256)
    assert keys[0] == (2048, 8) and keys[-1] == (16, 1) and len(keys) == 32
    assert sorted(keys, reverse=True) == keys
    assert prefill_graph_keys(100, 2) == [(64, 2), (64, 1), (32, 2), (32, 1), (16, 2), (16, 1)]
    assert prefill_graph_keys(16, 1) == [(16, 1)]
    assert prefill_graph_keys(15, 4) == []  # a step limit below the smallest graph: none


@pytest.mark.parametrize("tokens, seqs, key", [
    (1, 1, (16, 1)), (16, 1, (16, 1)), (17, 1, (32, 1)), (17, 3, (32, 4)), (512, 8, (512, 8)),
    (513, 1, (1024, 1)), (2048, 8, (2048, 8)), (2049, 1, None), (40, 9, None), (9, 8, (16, 8)),
])
def test_a_step_replays_the_smallest_graph_that_holds_it(tokens, seqs, key):
    assert prefill_graph_key(prefill_graph_keys(16384, 256), tokens, seqs) == key


def test_decode_long_and_copied_steps_stay_eager():
    graphs = SimpleNamespace(keys=prefill_graph_keys(16384, 256), graphs={"any": None})
    step = dict(is_prefill=True, positions=torch.zeros(20), seq_lens=torch.zeros(2), gather_blocks=None)
    assert PrefillGraphs.key(graphs, SimpleNamespace(**step)) == (32, 2)
    assert PrefillGraphs.key(graphs, SimpleNamespace(**{**step, "is_prefill": False})) is None
    assert PrefillGraphs.key(graphs, SimpleNamespace(**{**step, "positions": torch.zeros(3000)})) is None
    assert PrefillGraphs.key(graphs, SimpleNamespace(**{**step, "gather_blocks": torch.zeros(3)})) is None
    assert PrefillGraphs.key(SimpleNamespace(keys=graphs.keys, graphs={}), SimpleNamespace(**step)) is None


def test_steps_under_the_smallest_graph_capture_none():
    """max_num_batched_tokens below 16: no graph, empty buffers, every step eager."""
    graphs = PrefillGraphs(None, 12, 4, 3, 64, 32, torch.float32, torch.device("cpu"))
    assert graphs.keys == [] and graphs.capture(None, lambda keys, desc: keys) is None and not graphs.graphs
    step = SimpleNamespace(is_prefill=True, positions=torch.zeros(5), seq_lens=torch.zeros(1), gather_blocks=None)
    assert graphs.key(step) is None


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_padded_buffers_compute_what_eager_steps_do(fixture, request):
    """The replay path's padding, on the CPU too: prefill steps run the forward on the graphs' buffers,
    padded to their bucket (tokens of no sequence, slot -1; sequences with no new tokens), through the
    real kernels. Greedy tokens equal HF's float32 ones, with a prefix hit and two sequences padded to
    four, and later decode steps read the K/V those steps stored."""
    path = request.getfixturevalue(fixture)
    rng = random.Random(2)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (7, 21)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(path, max_num_seqs=4, max_num_batched_tokens=64, enforce_eager=True) as llm:
        runner = llm.runner
        graphs = PrefillGraphs(runner._forward, 64, 4, runner.max_blocks_per_seq, llm.config.max_model_len,
                               llm.hf_config.hidden_size, llm.config.dtype, runner.device)
        runner.prefill_graphs = stand_in(graphs)
        replayed = count_replays(llm)
        together = [out.token_ids for out in llm.generate(prompts + [prompts[1] + [5, 6]], params, use_tqdm=False)]
        hit = llm.generate([prompts[1] + [9]], params, use_tqdm=False)[0]
        assert replayed == [(64, 4), (16, 1)] and hit.num_cached_tokens == 16
    assert together == [hf_greedy(path, p, 4) for p in prompts + [prompts[1] + [5, 6]]]
    assert hit.token_ids == hf_greedy(path, prompts[1] + [9], 4)


@gpu_only
def test_greedy_through_prefill_graphs_equals_hf(tmp_path):
    """One prompt, three prompts in one step (a padding sequence and padding tokens), a prompt whose
    prefix is cached (its step attends to keys it did not compute) and one prefilled in 24-token chunks
    all replay graphs, and their float32 greedy tokens equal HF's. Over an fp8 cache such steps read the
    cache in place and replay graphs too; the first greedy token is HF's for 3 of the 4 prompts or more
    (e4m3 K/V move near-ties; a broken replay would agree by chance only)."""
    path = build_tiny_qwen3(tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (5, 19, 33, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(path), max_num_seqs=4, max_num_batched_tokens=256) as llm:
        replayed = count_replays(llm)
        alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].token_ids
        together = [out.token_ids for out in llm.generate(prompts[1:], params, use_tqdm=False)]
        hit = llm.generate([prompts[3] + [7, 8, 9]], params, use_tqdm=False)[0]
        assert replayed == [(16, 1), (128, 4), (16, 1)] and hit.num_cached_tokens == 32
    with LLM(str(path), max_num_seqs=4, max_num_batched_tokens=32) as chunked:
        replayed = count_replays(chunked)
        long = chunked.generate([prompts[3] * 2], params, use_tqdm=False)[0].token_ids
        assert replayed == [(32, 1), (32, 1), (16, 1)]  # 80 tokens: chunks of 32, 32 and 16
    with LLM(str(path), max_num_seqs=4, kv_cache_dtype="fp8") as fp8:
        replayed = count_replays(fp8)
        firsts = [out.token_ids[0] for out in fp8.generate(prompts, params, use_tqdm=False)]
        assert replayed == [(128, 4)]  # 5 + 19 + 33 + 40 tokens in one step
    assert sum(a == hf_greedy(path, p, 1)[0] for a, p in zip(firsts, prompts)) >= 3
    assert alone == hf_greedy(path, prompts[0], 6)
    assert together == [hf_greedy(path, p, 6) for p in prompts[1:]]
    assert hit.token_ids == hf_greedy(path, prompts[3] + [7, 8, 9], 6)
    assert long == hf_greedy(path, prompts[3] * 2, 6)


@gpu_only
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_prefill_graphs_sample_as_the_eager_engine(tmp_path, model):
    """Seeded bf16 samples through the graphs draw what an engine without graphs draws, with dense
    and with MoE layers (whose expert grouping sees the padding tokens too)."""
    build = build_tiny_qwen3 if model == "dense" else build_tiny_qwen3_moe
    path = build(tmp_path, dtype=torch.bfloat16)
    rng = random.Random(1)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (3, 30, 61)]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True)
    runs = []
    for eager in (False, True):
        with LLM(str(path), max_num_seqs=4, enforce_eager=eager) as llm:
            runs.append([out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)])
            if not eager:
                assert any(isinstance(g, torch.cuda.CUDAGraph) for g in llm.runner.prefill_graphs.graphs.values())
    assert runs[0] == runs[1]


@gpu_only
def test_bf16_prefill_graphs_over_an_fp8_cache_agree_with_eager_copies(tmp_path):
    """A bf16 model over an fp8 cache: graph steps read the e4m3 cache in place (the portable kernel's
    e4m3 configs at bf16 q, by query bucket 32, 512 and 1024), eager steps run on bf16 copies of the
    blocks. Both read the same e4m3 values, so their first greedy tokens agree but for near-ties."""
    path = build_tiny_qwen3(tmp_path, dtype=torch.bfloat16, max_position_embeddings=2048)
    rng = random.Random(2)
    prompts = [[rng.randrange(250) for _ in range(n)] for n in (20, 300, 1100)]
    prompts.append(prompts[2][:1000] + [5, 6, 7])  # a prefix hit: 992 cached tokens, 11 new
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    firsts = []
    for eager in (False, True):
        with LLM(str(path), max_num_seqs=4, max_model_len=2048, max_num_batched_tokens=2048, kv_cache_dtype="fp8",
                 enforce_eager=eager) as llm:
            replayed = [] if eager else count_replays(llm)
            firsts.append([llm.generate([p], params, use_tqdm=False)[0].token_ids[0] for p in prompts])
            assert replayed == ([] if eager else [(32, 1), (512, 1), (2048, 1), (16, 1)])
    assert sum(a == b for a, b in zip(*firsts)) >= 3
