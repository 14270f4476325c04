"""The scenarios that tests/test_reliability.py interrupts, shared with benchmarks/ctrl_c_sweep.py: the sources
(two tiny GPT-NeoX models and held-out and training text), the environment of every run, a merge's arguments."""
from __future__ import annotations

import os
from pathlib import Path

import corpus

from hf_rebasin import tiny


def make_pair(root: Path) -> Path:
    """Two tiny GPT-NeoX models, held-out and training text under root: the sources every run reads."""
    tiny.make_tiny("gpt_neox", root / "model-a", seed=1)
    tiny.make_tiny("gpt_neox", root / "model-b", seed=2)
    (root / "heldout.txt").write_text(corpus.heldout_text(20000))
    (root / "train.txt").write_text(corpus.train_text(20000))
    return root


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_HOME=str(home),
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_TELEMETRY="1", TRANSFORMERS_VERBOSITY="error")
    return env


def merge_args(pair: Path, out: Path, method: str, *extra) -> list:
    return ["merge", pair / "model-a", pair / "model-b", "--method", method, "--out", out, "--data",
            pair / "heldout.txt", "--seq-len", "32", "--max-eval-tokens", "1024", "--lambdas", "5", *extra]
