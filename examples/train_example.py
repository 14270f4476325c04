"""Train the bundled example pair: two tiny Pythia-style models on Python's own standard library.

    .venv/bin/python examples/train_example.py            # about 2 x 4 minutes on 2 CPU cores

writes hf_rebasin/assets/example-pair/ (package data: it ships in the wheel, for `hf-rebasin demo`):

    heldout.txt       held-out stdlib source (every 20th selected file), the data to measure barriers on
    model-a/          GPTNeoXForCausalLM trained from seed 0 (+ its byte-level BPE tokenizer)
    model-b/          the same architecture and data, seed 1
    README.md         what this is, and the measured held-out losses

Then, for example:  hf-rebasin demo   (or hf-rebasin run example-stdlib)

The corpus is the .py sources of the running interpreter's standard library
(sysconfig.get_paths()["stdlib"]), tests and site-packages excluded, files sorted by path and
every 2nd one kept; of those, every 20th is held out and the rest is training text. The
tokenizer (vocab 1024, `<|endoftext|>` as end of text) is trained on the training text only.
Everything is deterministic for a given Python installation: the same interpreter and torch
thread count give the same files, tokenizer and (bitwise) the same weights. The source text is
CPython's, under the PSF License.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hf_rebasin.sources.data import token_windows  # noqa: E402
from hf_rebasin.training import (  # noqa: E402
    EOS,
    causal_lm_loss,
    save_lm,
    stdlib_files,
    stdlib_texts,
    train_bpe_tokenizer,
    train_causal_lm,
)

OUT = REPO / "hf_rebasin" / "assets" / "example-pair"
VOCAB_SIZE = 1024
SEQ_LEN = 128
KEEP_EVERY = 2          # of the eligible stdlib files, keep every 2nd (a few MB of code)
HOLD_OUT_EVERY = 20     # of the kept files, every 20th is held out
SEEDS = {"model-a": 0, "model-b": 1}
TRAINING = dict(steps=800, batch_size=32, lr=3e-3, warmup=40, weight_decay=0.1)
MODEL = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
             rotary_pct=0.25, use_parallel_residual=True, max_position_embeddings=256,
             tie_word_embeddings=False)


def build_corpus() -> tuple[list[str], list[str]]:
    """(training texts, held-out texts), one text per source file."""
    kept = stdlib_files()[::KEEP_EVERY]
    train = [p for index, p in enumerate(kept) if index % HOLD_OUT_EVERY != HOLD_OUT_EVERY // 2]
    heldout = [p for index, p in enumerate(kept) if index % HOLD_OUT_EVERY == HOLD_OUT_EVERY // 2]
    return stdlib_texts(train), stdlib_texts(heldout)


def model_config(tokenizer):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **MODEL)


def write_text_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


def readme(losses: dict[str, float], heldout_tokens: int, train_tokens: int, vocab: int) -> str:
    rows = "\n".join(f"| `{name}` | {SEEDS[name]} | {loss:.3f} | {math.exp(loss):.2f} |"
                     for name, loss in losses.items())
    return f"""# stdlib-pair: two tiny GPT-NeoX models trained from different seeds

Produced by `python examples/train_example.py` (deterministic; see its docstring).
Python {sys.version.split()[0]}, torch {torch.__version__}.

* Architecture: `GPTNeoXForCausalLM` (Pythia-style: parallel residual, rotary on 25% of each head),
  hidden {MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, {MODEL['num_attention_heads']} heads,
  MLP {MODEL['intermediate_size']}, untied embeddings, fp32 safetensors.
* Tokenizer: byte-level BPE, vocab {vocab}, `{EOS}` between documents; trained on the training text.
* Data: CPython standard-library sources (PSF License); {train_tokens:,} training tokens,
  steps {TRAINING['steps']} x batch {TRAINING['batch_size']} x {SEQ_LEN} tokens, AdamW lr {TRAINING['lr']}
  (warmup + cosine). Both models see the same data; the seed sets initialisation and data order.
* `heldout.txt`: held-out files (never seen in training), {heldout_tokens:,} tokens in {SEQ_LEN}-token windows.

| model | seed | held-out loss (nats/token) | perplexity |
|---|---|---|---|
{rows}

ln(vocab) = {math.log(vocab):.3f} is the loss of a uniform guess.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT.relative_to(REPO)})")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)

    train_texts, heldout_texts = build_corpus()
    print(f"corpus: {len(train_texts)} training files ({sum(map(len, train_texts)):,} chars), "
          f"{len(heldout_texts)} held-out files ({sum(map(len, heldout_texts)):,} chars) from the standard library")
    tokenizer = train_bpe_tokenizer(train_texts, VOCAB_SIZE, MODEL["max_position_embeddings"])
    train = token_windows(train_texts, tokenizer, SEQ_LEN)
    heldout_text = EOS.join(heldout_texts)  # one document; the tokenizer reads EOS back as the eos id
    heldout = token_windows([heldout_text], tokenizer, SEQ_LEN)
    print(f"tokenizer: vocab {len(tokenizer)}; {train.numel():,} training tokens, {heldout.numel():,} held-out tokens")

    args.out.mkdir(parents=True, exist_ok=True)
    losses, seconds = {}, {}
    for name, seed in SEEDS.items():
        start = time.perf_counter()
        model = train_causal_lm(model_config(tokenizer), train, seed=seed, progress=not args.no_progress,
                                **TRAINING)
        seconds[name] = time.perf_counter() - start
        losses[name] = causal_lm_loss(model, heldout)
        save_lm(model, tokenizer, args.out / name)
        print(f"{name} (seed {seed}): held-out loss {losses[name]:.3f} nats/token "
              f"(ln vocab {math.log(len(tokenizer)):.3f}), trained in {seconds[name]:.0f} s")

    write_text_atomically(args.out / "heldout.txt", heldout_text)
    write_text_atomically(args.out / "README.md", readme(losses, heldout.numel(), train.numel(), len(tokenizer)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
