import os
import sys
import warnings
from pathlib import Path

import corpus
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", message=".*bos_token_id.*")

REPO = Path(__file__).resolve().parents[1]
# The command line of this environment, whatever it is (a venv, conda, `pip install -e .`): its interpreter runs
# the module, so no scripts folder is assumed.
HF_REBASIN = [sys.executable, "-m", "hf_rebasin.cli"]
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
# Skips allowed under HF_REBASIN_STRICT_SKIPS=1 (what CI sets): only for hardware this machine lacks.
ALLOWED_SKIP_PREFIXES = ("needs a CUDA GPU",)


def pytest_sessionstart(session):
    """Under CI, prove that the package under test is this checkout's (not an installed copy elsewhere)."""
    if os.environ.get("HF_REBASIN_STRICT_SKIPS") == "1":
        import hf_rebasin
        where = Path(hf_rebasin.__file__).resolve()
        if REPO not in where.parents:
            raise pytest.UsageError(f"hf_rebasin was imported from {where}, not from the checkout under test {REPO}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under HF_REBASIN_STRICT_SKIPS=1 a skip is a failure (a missing fixture must not pass unnoticed),
    unless it is for hardware that is absent (ALLOWED_SKIP_PREFIXES)."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("HF_REBASIN_STRICT_SKIPS") != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    if not reason.removeprefix("Skipped: ").startswith(ALLOWED_SKIP_PREFIXES):
        report.outcome = "failed"
        report.longrepr = f"skipped under HF_REBASIN_STRICT_SKIPS=1 (not allowed): {reason}"


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    """Random images with labels, for the barrier of the tiny ViTs."""
    import numpy as np
    path = tmp_path_factory.mktemp("data") / "images.npz"
    gen = np.random.default_rng(0)
    np.savez(path, images=gen.standard_normal((48, 3, 16, 16)).astype(np.float32),
             labels=gen.integers(0, 10, 48))
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """Held-out text for the barrier: standard-library files the tiny models were not trained on."""
    path = tmp_path_factory.mktemp("data") / "heldout.txt"
    path.write_text(corpus.heldout_text(20000))
    return path


@pytest.fixture(scope="module")
def learned_pair(tiny_dirs, tmp_path_factory):
    """(A, B, folder with heldout.txt and train.txt): two tiny random GPT-NeoX models for short dual runs."""
    from hf_rebasin import tiny
    root = tmp_path_factory.mktemp("learned_pair")
    (root / "heldout.txt").write_text(corpus.heldout_text(12000))
    (root / "train.txt").write_text(corpus.train_text(12000))
    return tiny_dirs["gpt_neox"], tiny.make_tiny("gpt_neox", root / "b", seed=2), root


def short_dual(pair, out, *extra) -> int:
    """`hf-rebasin merge A B --method dual` for 4 steps on a learned_pair (exit code)."""
    from hf_rebasin.cli import main
    a, b, root = pair
    return main(["merge", str(a), str(b), "--method", "dual", "--data", str(root / "heldout.txt"), "--seq-len", "32",
                 "--max-eval-tokens", "2048", "--lambdas", "3", "--steps", "4", "--learn-batch-size", "8",
                 "--eval-every", "0", "--out", str(out), *extra])


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One tiny random checkpoint folder per supported variant (seed 1)."""
    from hf_rebasin import tiny
    root = tmp_path_factory.mktemp("tiny")
    return {kind: tiny.make_tiny(kind, root / kind, seed=1) for kind in tiny.kinds()}


def train_char_models(root: Path, kind: str, seeds) -> Path:
    """Tiny `kind` LMs trained from each seed on standard-library sources (char-level, 300 steps), saved
    as root/model-SEED, with root/train.txt (the text they saw) and root/test.txt (other files, held out)."""
    from hf_rebasin import tiny
    from hf_rebasin.sources.data import token_windows
    from hf_rebasin.training import save_lm, train_causal_lm
    (root / "train.txt").write_text(corpus.train_text())
    (root / "test.txt").write_text(corpus.heldout_text())
    tokenizer = tiny.tiny_tokenizer(97)
    windows = token_windows([corpus.train_text()], tokenizer, 32)
    for seed in seeds:
        model = train_causal_lm(tiny.adapter_of(kind).tiny_config(kind), windows, seed=seed, steps=300,
                                batch_size=16, lr=1e-2, progress=False)
        save_lm(model, tokenizer, root / f"model-{seed}")
    return root


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread (use with pytest.mark.usefixtures)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
