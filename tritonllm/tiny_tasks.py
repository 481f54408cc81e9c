"""The checked task set of the bundled tiny model: adding two numbers below 100, reversing and sorting short words.

A problem is a prompt ("12+34=", "rev abc=", "sort dcab=") and its exact answer ("46", "cba",
"abcd"); the model ends an answer with its EOS token. The same generator makes the training data
(examples/train_tiny_model.py) and the evaluation set (`tritonllm generate` without prompts).
"""
import random
import string
from pathlib import Path

BUNDLED_MODEL = Path(__file__).parent / "bundled"  # the tiny model's checkpoint and tokenizer
LETTERS = "abcdefghij"
# Every character a prompt or answer may hold, in a fixed order: the tokenizer's vocabulary.
ALPHABET = string.digits + LETTERS + "+= rvsot"
EVAL_SEED = 1234


def problem(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"{a}+{b}=", str(a + b)
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
    if kind == 1:
        return f"rev {word}=", word[::-1]
    return f"sort {word}=", "".join(sorted(word))


def problems(count: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [problem(rng) for _ in range(count)]

