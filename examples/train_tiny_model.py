"""Train the bundled tiny Qwen3 (tritonllm/bundled/) on the checked task set, from a fixed seed, on a CPU.

    python examples/train_tiny_model.py [--steps 2500] [--out tritonllm/bundled]

A character-level tokenizer over tritonllm.tiny_tasks.ALPHABET, a 4-layer Qwen3 (hidden 128, GQA
4/2 heads, head_dim 32), teacher forcing with the loss on the answer and its EOS only; HF greedy
accuracy on the evaluation set is printed at the end; the model is saved only if it reaches 90%
(--min-accuracy), with the shipped chat template (the last user message as the plain problem).
"""
import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast
from transformers.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

from tritonllm.tiny_tasks import ALPHABET, BUNDLED_MODEL, EVAL_SEED, problem, problems

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The character-level tokenizer splits role markers into characters the model never saw: the
# template gives it the problem alone. Read before --out (the bundled folder by default) is written.
CHAT_TEMPLATE = (BUNDLED_MODEL / "chat_template.jinja").read_text()


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL + list(ALPHABET) + ["\n"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.add_special_tokens(SPECIAL)  # as Qwen3's: decoding with skip_special_tokens drops all three
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def batch(rng, tokenizer, size, eos):
    """Token ids [size, L] right-padded, and labels with -100 outside the answers."""
    rows, labels = [], []
    for _ in range(size):
        prompt, answer = problem(rng)
        p, a = tokenizer.encode(prompt), tokenizer.encode(answer) + [eos]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return ids, target


@torch.no_grad()
def accuracy(model, tokenizer, eos, count=300) -> float:
    correct = 0
    for prompt, answer in problems(count, EVAL_SEED):
        ids = torch.tensor([tokenizer.encode(prompt)])
        for _ in range(8):
            next_id = model(ids).logits[0, -1].argmax()
            if next_id == eos:
                break
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        correct += tokenizer.decode(ids[0, len(tokenizer.encode(prompt)):]) == answer
    return correct / count


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "tritonllm" / "bundled")
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="save only a model this accurate (default 0.9)")
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = lambda step: min(1.0, step / 100) * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    start = time.time()
    for step in range(args.steps):
        ids, target = batch(rng, tokenizer, args.batch_size, eos)
        loss = model(ids, labels=target).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - start:.0f}s", flush=True)
    model.eval()
    score = accuracy(model, tokenizer, eos)
    print(f"greedy accuracy on the evaluation set: {score:.1%}")
    if score < args.min_accuracy:
        raise SystemExit(f"below --min-accuracy {args.min_accuracy:.0%}: {args.out} left as it was")
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(eos_token_id=[eos], pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    (args.out / "training.json").write_text(json.dumps({"steps": args.steps, "batch_size": args.batch_size,
                                                        "seed": 0, "eval_accuracy": score}, indent=1) + "\n")


if __name__ == "__main__":
    main()
