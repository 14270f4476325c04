import os
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore", message=".*bos_token_id.*")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One tiny random checkpoint folder per supported variant (seed 1)."""
    from hf_rebasin import tiny
    root = tmp_path_factory.mktemp("tiny")
    return {kind: tiny.make_tiny(kind, root / kind, seed=1) for kind in tiny.KINDS}


def train_char_models(root: Path, kind: str, seeds) -> Path:
    """Tiny `kind` LMs trained from each seed on Tiny Shakespeare (char-level, 300 steps), saved as
    root/model-SEED, with root/train.txt (the text they saw) and root/test.txt (held out)."""
    import transformers
    from hf_rebasin import tiny
    from hf_rebasin.data import token_windows
    from hf_rebasin.training import save_lm, train_causal_lm
    text = (SHARED_DATA / "tinyshakespeare.txt").read_text()
    (root / "train.txt").write_text(text[:200_000])
    (root / "test.txt").write_text(text[-40_000:])
    tokenizer = tiny.tiny_tokenizer(97)
    windows = token_windows([text[:200_000]], tokenizer, 32)
    config_class, kwargs = tiny.LM_CONFIGS[kind]
    for seed in seeds:
        model = train_causal_lm(getattr(transformers, config_class)(**kwargs), windows, seed=seed, steps=300,
                                batch_size=16, lr=1e-2, progress=False)
        save_lm(model, tokenizer, root / f"model-{seed}")
    return root
