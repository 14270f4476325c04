"""Real text for the tests that every machine has: CPython's standard-library sources (PSF License).

Nothing here reads outside the repository and the running interpreter: a clone with nothing beside it
runs every test.  Training and held-out text come from disjoint files; the BPE tokenizer is trained at
test time on the training files only."""
from __future__ import annotations

from functools import cache

from hf_rebasin.training import EOS, stdlib_files, stdlib_texts, train_bpe_tokenizer


@cache
def _texts(offset: int) -> tuple[str, ...]:
    return tuple(stdlib_texts(stdlib_files()[offset::7]))


@cache
def train_text(chars: int = 200_000) -> str:
    """At least `chars` characters of whole training files (every 7th file, from the first)."""
    return _join(_texts(0), chars)


@cache
def heldout_text(chars: int = 40_000) -> str:
    """At least `chars` characters of other files (every 7th, from the fourth): never in train_text."""
    return _join(_texts(3), chars)


def _join(texts: tuple[str, ...], chars: int) -> str:
    out, total = [], 0
    for text in texts:
        out.append(text)
        total += len(text)
        if total >= chars:
            return "\n".join(out)[:chars]
    raise RuntimeError(f"the standard library gave only {total} characters")


@cache
def bpe_tokenizer(vocab_size: int = 512):
    """A byte-level BPE (GPT-2 style, `<|endoftext|>` as EOS) trained on 400 kB of training files."""
    return train_bpe_tokenizer([train_text(400_000)], vocab_size, model_max_length=1 << 20)


__all__ = ["EOS", "bpe_tokenizer", "heldout_text", "train_text"]
