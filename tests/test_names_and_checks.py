"""Names and config-level checks (issue 48, points 7-9): a misspelt folder or an unreachable Hub is one line at
once; every model's tokenizer is checked; refusals that need no weights come before torch is imported; the
help texts say what is true."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import HF_REBASIN

from hf_rebasin.assets import example_pair
from hf_rebasin.errors import DataError, IncompatibleModelsError, ModelLoadError
from hf_rebasin.sources import hub_access
from hf_rebasin.sources.backends import looks_like_path, read_config_json
from hf_rebasin.sources.data_specs import check_hub_dataset

PAIR = example_pair()
DATA = ["--data", str(PAIR / "heldout.txt"), "--seq-len", "128", "--max-eval-tokens", "1024", "--lambdas", "3"]
FAST_S = 5.0  # before: 24 s of retries (names) or 5-6 s of imports (configs); the figures are in BENCHMARKS.md


def closed_port() -> int:
    with socket.socket() as sock:  # a port nobody listens on: refused at once, as when offline
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def offline_env(tmp_path):
    """The environment of a command whose Hub cannot be reached, with an empty cache."""
    env = {k: v for k, v in os.environ.items() if k not in hub_access.OFFLINE_VARIABLES}
    return {**env, "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HOME": str(tmp_path / "hf-home"),
            "HF_HUB_CACHE": str(tmp_path / "hf-home" / "hub")}


def run_cli(args, env=None, cwd=None) -> tuple[int, list[str], float]:
    start = time.perf_counter()
    proc = subprocess.run([*HF_REBASIN, *map(str, args)], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stderr.strip().splitlines(), time.perf_counter() - start


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, Path]:
    """Copies of the example pair's model B with one thing wrong each, and an empty data file."""
    root = tmp_path_factory.mktemp("broken")
    made = {}
    for name in ("bad-tokenizer", "other-tokenizer", "bad-weights", "other-class"):
        made[name] = Path(shutil.copytree(PAIR / "model-b", root / name))
    (made["bad-tokenizer"] / "tokenizer.json").write_text('{"broken": ')
    tok = json.loads((PAIR / "model-b" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = list(vocab)[1:3]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (made["other-tokenizer"] / "tokenizer.json").write_text(json.dumps(tok))
    (made["bad-weights"] / "model.safetensors").write_bytes(b"\xff" * 64)
    config = json.loads((made["other-class"] / "config.json").read_text())
    (made["other-class"] / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"],
                                                                 "model_type": "llama"}))
    made["empty"] = root / "empty.txt"
    made["empty"].write_text("  \n")
    return made


# --- names ----------------------------------------------------------------------------------------------------

def test_a_misspelt_name_with_the_hub_unreachable_is_one_line_at_once(offline_env, tmp_path):
    """Repro 7: `merge model-a B` (no folder model-a here) spent 24 s retrying the Hub and printed 11 lines."""
    code, err, seconds = run_cli(["merge", "model-a", PAIR / "model-b", *DATA, "--out", "x"], offline_env, tmp_path)
    assert code == 2 and len(err) == 1, err
    assert "model-a" in err[0] and "HF_HUB_OFFLINE" in err[0] and "cannot be reached" in err[0]
    assert err[0].endswith(f"(did you mean {PAIR / 'model-a'}?)"), err  # the folder beside model B
    assert seconds < FAST_S, seconds
    offline = {**offline_env, "HF_HUB_OFFLINE": "1"}
    code, err, seconds = run_cli(["merge", "model-a", PAIR / "model-b", *DATA, "--out", "x"], offline, tmp_path)
    assert code == 2 and len(err) == 1 and "model-a" in err[0] and "HF_HUB_OFFLINE=1" in err[0], err
    assert seconds < FAST_S and not (tmp_path / "x").exists()


def test_the_default_data_with_the_hub_unreachable_is_one_line_at_once(offline_env, tmp_path):
    code, err, seconds = run_cli(["barrier", PAIR / "model-a", PAIR / "model-b", "--lambdas", "3"], offline_env,
                                 tmp_path)
    assert code == 2 and len(err) == 1, err
    assert "wikitext" in err[0] and "default" in err[0] and "cannot be reached" in err[0]
    assert seconds < FAST_S, seconds


def test_what_looks_like_a_path_is_never_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for path in ("./model-a", "../model-a", "/no/such", "~/no-such", "runs/merged", "model-a/", "a/b/c", "a\\b"):
        assert looks_like_path(path), path
        with pytest.raises(ModelLoadError, match="no such model folder"):
            read_config_json(path)
    for hub_id in ("gpt2", "EleutherAI/pythia-70m"):  # legacy bare names and owner/name, with no such local owner
        assert not looks_like_path(hub_id), hub_id


def test_the_hub_cache_answers_when_the_hub_cannot(tmp_path, monkeypatch):
    """Unreachable, a cached config is read from the cache (and a dataset in the cache is not refused)."""
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    for name in hub_access.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ModelLoadError, match="owner/tiny.*cannot be reached"):
        read_config_json("owner/tiny")
    with pytest.raises(DataError, match="some/corpus"):
        check_hub_dataset("some/corpus:default:test")
    snapshot = hub / "models--owner--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (hub / "models--owner--tiny" / "refs").mkdir()
    (hub / "models--owner--tiny" / "refs" / "main").write_text("0" * 40)
    shutil.copy(PAIR / "model-a" / "config.json", snapshot / "config.json")
    assert read_config_json("owner/tiny")["architectures"] == ["GPTNeoXForCausalLM"]
    (hub / "datasets--some--corpus" / "snapshots" / ("1" * 40)).mkdir(parents=True)
    check_hub_dataset("some/corpus:default:test")
    check_hub_dataset("json:local.jsonl")  # a packaged local loader is never a Hub look-up


def test_cache_only_restores_the_environment(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    for name in hub_access.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with hub_access.cache_only():
        assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in os.environ and "HF_DATASETS_OFFLINE" not in os.environ


# --- config-level refusals, before torch ------------------------------------------------------------------------

REFUSALS = {  # case: (arguments after `barrier A`, what the line says)
    "corrupt tokenizer.json in B": (["bad-tokenizer", *DATA], "tokenizer.json is not valid JSON"),
    "tokenizers that differ": (["other-tokenizer", *DATA], "2 with different ids"),
    "another class": (["other-class", *DATA], "different architectures"),
    "corrupt safetensors header": (["bad-weights", *DATA], "not a valid safetensors file"),
    "empty data": ([PAIR / "model-b", *DATA[2:], "--data", "empty"], "contains no text"),
}


def test_config_level_refusals_come_before_torch(broken, tmp_path):
    """Repro 8 (a corrupt tokenizer in model B passed) and 9 (these refusals imported torch and transformers):
    each is exit 2 with its one line, and the process never imported torch."""
    script = ("import sys\nfrom hf_rebasin.cli import main\ncode = main(sys.argv[1:])\n"
              "print('imported:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))\nsys.exit(code)\n")
    for case, (rest, says) in REFUSALS.items():
        args = [broken.get(a, a) if isinstance(a, str) else a for a in rest]
        proc = subprocess.run([sys.executable, "-c", script, "barrier", PAIR / "model-a", *map(str, args)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and says in err[0], (case, proc.stderr)
        assert "imported: []" in proc.stdout, (case, proc.stdout)


def test_a_tokenizer_that_cannot_be_loaded_is_refused_in_either_model(broken):
    """The loader's own check (the Python API with checked=True, Hub models): B's tokenizer as A's."""
    from hf_rebasin.sources.backends import BACKENDS
    from hf_rebasin.sources.models import load
    a, bad = load(PAIR / "model-a"), load(broken["bad-tokenizer"])
    backend = BACKENDS["transformers"]
    for first, second in ((a, bad), (bad, a)):
        problem = backend.vocabulary_problem(first, second)
        assert problem and "bad-tokenizer" in problem and "tokenizer" in problem, problem
    assert backend.vocabulary_problem(a, load(PAIR / "model-b")) is None
    with pytest.raises(IncompatibleModelsError, match="2 with different ids"):
        from hf_rebasin.sources.models import check_compatible
        check_compatible(a, load(broken["other-tokenizer"]))


# --- help texts and option messages ------------------------------------------------------------------------------

def test_help_lists_every_registered_class_and_one_output_group():
    from hf_rebasin.adapters import REGISTRY
    from hf_rebasin.architectures import registered_architectures
    from hf_rebasin.cli import build_parser
    assert registered_architectures() == sorted(REGISTRY)
    parser = build_parser()
    text = " ".join(parser.format_help().split())
    assert all(name in text for name in REGISTRY)
    merge = parser._subparsers._group_actions[0].choices["merge"]
    titles = [group.title for group in merge._action_groups]
    assert len(titles) == len(set(titles)) and "output" in titles, titles
    assert "--force" in merge.format_help().split("output:")[1]


def test_the_method_table_says_where_each_method_gets_its_data():
    from hf_rebasin.cli.commands import method_table
    lines = {line.split()[0]: line for line in method_table().splitlines()[1:]}
    assert "needs data" not in method_table()
    for learned in ("lm", "dual"):
        assert "self" in lines[learned], lines[learned]
    assert "--data" in lines["am"] and "[" not in lines["wm"].replace("[N models]", "")


def test_the_lambdas_range_says_what_it_refuses():
    from hf_rebasin.errors import OptionError
    from hf_rebasin.options import MergeOptions
    MergeOptions(lambdas=3).check(2)
    for value in (1, 2):
        with pytest.raises(OptionError, match=r"--lambdas must be in \[3, 1001\], got " + str(value)):
            MergeOptions(lambdas=value).check(2)


# --- the raw reference and lm-eval's data --------------------------------------------------------------------

def test_a_merge_reports_the_plain_averages_barrier_beside_its_own():
    """The raw barrier at the same points, as --method raw measures it (exactly: the endpoints are shared)."""
    import hf_rebasin
    settings = dict(data=str(PAIR / "heldout.txt"), seq_len=64, max_eval_tokens=512, lambdas=3, progress=False)
    wm = hf_rebasin.barrier([PAIR / "model-a", PAIR / "model-b"], method="wm", **settings).report
    raw = hf_rebasin.barrier([PAIR / "model-a", PAIR / "model-b"], method="raw", **settings).report
    assert raw.raw_barrier is None and "raw_barrier" not in raw.to_dict()
    assert wm.raw_barrier == pytest.approx(raw.barrier, rel=1e-5) and wm.raw_barrier > wm.barrier
    assert "raw_reference_s" in wm.timings
    skipped = hf_rebasin.barrier([PAIR / "model-a", PAIR / "model-b"], method="wm", no_raw_reference=True,
                                 **settings).report
    assert skipped.raw_barrier is None and skipped.barrier == wm.barrier


def test_eval_with_the_hub_unreachable_and_no_cached_data_is_one_line(offline_env, tmp_path):
    """Repro 7's `eval --tasks piqa` (41 s offline before): refused before lm-eval is imported."""
    from hub_server import write_merge_output
    out = tmp_path / "merged"
    shutil.copytree(PAIR / "model-a", out)
    write_merge_output(out)
    code, err, seconds = run_cli(["eval", out, "--tasks", "piqa"], offline_env, tmp_path)
    assert code == 2 and len(err) == 1 and "piqa" in err[0] and "cannot be reached" in err[0], err
    assert seconds < FAST_S * 2, seconds
