"""What an FP8 KV cache does to the next-token distribution, for several scale schemes.

    python bench/kv_quality.py [--model qwen3-0.6b] [--prompts 64] [--prefill 512] [--kernels reference]

Each prompt (random tokens) is prefilled into a cache of the model's dtype, then one more token is
decoded with the cache as stored by each scheme; the decode logits are compared with those of the
model-dtype cache: mean KL(model dtype || scheme) and top-1 agreement. Schemes:
- engine fp8: the engine's own path (kv_cache_dtype="fp8"): K/V quantized when stored, with a
  float32 scale per (token, KV head), and read back as fp8 by prefill and decode alike;
- per-row: the bf16 cache quantized afterwards with the same per-(token, head) scales;
- per-tensor: one static scale per layer and K or V (amax of the whole cache / 448);
- scale 1: no scaling at all (values past 448 saturate).
"""
import argparse
import random

import torch

from tritonllm import LLM, SamplingParams
from tritonllm.config import DTYPES, KERNEL_BACKENDS
from tritonllm.engine.scheduler import ScheduledBatch
from tritonllm.engine.step_inputs import build_step_inputs
from tritonllm.kernels import reference
from tritonllm.layers.attention import Attention

E4M3_MAX = 448.0


def prefill_then_decode(llm, prompts, after_prefill=None) -> torch.Tensor:
    """Decode logits [B, V] (float32) of the token after each prompt's last one, its K/V read from the
    cache; `after_prefill()` may swap the caches between the prefill and the decode and return a
    function that swaps them back."""
    seqs = [llm.make_sequence(p, SamplingParams(max_tokens=1)) for p in prompts]
    for seq in seqs:
        llm.block_manager.allocate(seq)
    lengths = [len(seq) - 1 for seq in seqs]
    llm.runner.execute(build_step_inputs(ScheduledBatch(seqs, lengths, True, [False] * len(seqs)), {}, llm.block_manager.block_size))
    for seq, n in zip(seqs, lengths):
        seq.num_computed_tokens = n
    restore = after_prefill() if after_prefill is not None else None
    decode = ScheduledBatch(seqs, [1] * len(seqs), False, [True] * len(seqs))
    logits = llm.runner.execute(build_step_inputs(decode, {}, llm.block_manager.block_size))[0].float()
    if restore is not None:
        restore()
    for seq in seqs:
        llm.block_manager.deallocate(seq)
    return logits


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as e4m3 under given scales, one per row of the last dim (saturated to +-448)."""
    return (x.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def requantize(llm, scheme: str):
    """Swap every layer's bf16 caches for fp8 caches and scales quantized under `scheme`."""
    names = ("k_cache", "k_scale", "v_cache", "v_scale")

    def rewrite():
        layers = [m for m in llm.runner.model.modules() if isinstance(m, Attention)]
        saved = [[getattr(layer, name) for name in names] for layer in layers]
        for layer in layers:
            caches = {}
            for name in ("k", "v"):
                cache = getattr(layer, f"{name}_cache")
                if scheme == "per-row":  # the engine's rule
                    caches[name] = reference.quantize_e4m3(cache)
                    continue
                if scheme == "per-tensor":
                    scale = torch.full(cache.shape[:3], max(cache.float().abs().max().item(), 1e-30) / E4M3_MAX, device=cache.device)
                else:
                    scale = torch.ones(cache.shape[:3], device=cache.device)
                caches[name] = (quantize(cache, scale), scale)
            (layer.k_cache, layer.k_scale), (layer.v_cache, layer.v_scale) = caches["k"], caches["v"]

        def restore():
            for layer, tensors in zip(layers, saved):
                for name, tensor in zip(names, tensors):
                    setattr(layer, name, tensor)
        return restore
    return rewrite


def compare(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    p_log, q_log = reference.log_softmax(-1), logits.log_softmax(-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return float(kl.mean()), float((reference.argmax(-1) == logits.argmax(-1)).float().mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b", help="preset name (random weights) or checkpoint folder")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens before the decoded one")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--kernels", choices=KERNEL_BACKENDS, default="triton", help="reference: quick on a CPU")
    parser.add_argument("--dtype", choices=list(DTYPES), help="the model's (default: the checkpoint's; float32 on a CPU)")
    args = parser.parse_args()
    rng = random.Random(0)
    options = dict(max_model_len=args.prefill + 16, max_num_seqs=args.batch, enforce_eager=True, gpu_memory_utilization=0.5,
                   kernels=args.kernels, dtype=args.dtype)
    auto = LLM(args.model, **options)
    vocab = auto.hf_config.vocab_size
    prompts = [[rng.randrange(min(vocab, 10000)) for _ in range(args.prefill + 1)] for _ in range(args.prompts)]
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    reference = torch.cat([prefill_then_decode(auto, b) for b in batches])
    rows = {}
    for scheme in ("per-row", "per-tensor", "scale 1"):
        rows[scheme] = compare(reference, torch.cat([prefill_then_decode(auto, b, requantize(auto, scheme)) for b in batches]))
    auto.close()
    fp8 = LLM(args.model, kv_cache_dtype="fp8", **options)
    rows["engine fp8"] = compare(reference, torch.cat([prefill_then_decode(fp8, b) for b in batches]))
    fp8.close()
    print(f"{args.model} ({auto.config.dtype}, {args.kernels} kernels): {args.prompts} prompts of {args.prefill} tokens, "
          "then one decoded token; against the model-dtype cache")
    print("\n| scheme | mean KL | top-1 agreement |\n|---|---|---|")
    for scheme, (kl, top1) in rows.items():
        print(f"| {scheme} | {kl:.3g} | {top1:.1%} |")


if __name__ == "__main__":
    main()
