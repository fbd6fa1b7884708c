"""The benchmark workload: seeded random token-id prompts of random lengths.

Only the standard library's :class:`random.Random` is used, so the same ``(seed, count, lengths,
vocabulary)`` gives the same prompts on every platform and in every peer's environment."""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["make_prompts", "prompt_vocab_size"]


def make_prompts(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` prompts, each of a length drawn uniformly from ``[min_len, max_len]`` and made of
    token ids drawn uniformly from ``[0, vocab_size)``."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"prompt lengths [{min_len}, {max_len}] must satisfy 1 <= min <= max")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be >= 1")
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def prompt_vocab_size(model: str | None) -> int:
    """Token ids a prompt may use for ``model``: the tokenizer's regular vocabulary (no added or
    special tokens), else ``config.json``'s ``vocab_size``."""
    if model is None:
        raise ValueError("the workload needs --model DIR|NAME (for its vocabulary) or --vocab-size")
    tok_file = Path(model) / "tokenizer.json"
    if tok_file.is_file():
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(str(tok_file)).get_vocab_size(with_added_tokens=False)
        if size > 0:
            return int(size)
    config = Path(model) / "config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("vocab_size")
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell the vocabulary size of {model}: pass --vocab-size")
