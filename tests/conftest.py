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
