"""The rough edges a new user met (issue 28): each case as the user ran it, and what it must do now."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import HF_REBASIN

import hf_rebasin
from hf_rebasin import tiny
from hf_rebasin.cli import main
from hf_rebasin.errors import ModelLoadError, OptionError, OutputError

SMALL = ["--seq-len", "32", "--max-eval-tokens", "512", "--lambdas", "3"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return [tiny.make_tiny("gpt_neox", root / "model-a", seed=1), tiny.make_tiny("gpt_neox", root / "model-b", seed=2)]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    yield


def cli(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused(result, *names) -> str:
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def merge_argv(pair, text_file, out, *extra):
    return ["merge", *pair, "--data", text_file, "--out", out, *SMALL, *extra]


# --- the output place -------------------------------------------------------------------------------

@pytest.mark.parametrize("out", ["/proc/hf-rebasin-out", "/proc/no/such/hf-rebasin-out", "/sys/hf-rebasin-out"])
def test_out_where_no_folder_can_be_made_is_refused_before_loading(out, pair, text_file, capsys, monkeypatch):
    root = Path("/", out.split("/")[1])
    if not root.is_dir():
        pytest.skip(f"no {root} on this system")
    from hf_rebasin import pipeline

    def no_loading(source):
        raise AssertionError("a model was loaded before the output place was checked")
    monkeypatch.setattr(pipeline, "load", no_loading)
    refused(cli(merge_argv(pair, text_file, out), capsys), "--out", out, "no folder can be made")
    with pytest.raises(OutputError, match="no folder can be made") as error:
        hf_rebasin.merge(pair, out, data=str(text_file))
    assert "--out" not in str(error.value)


def test_the_probe_leaves_nothing_behind(pair, text_file, tmp_path, capsys):
    """The staging folder and the parents made for it are removed again, also when a later check refuses."""
    out = tmp_path / "new" / "deeper" / "out"
    refused(cli(merge_argv(pair, text_file, out, "--data", tmp_path / "missing.txt"), capsys), "missing.txt")
    assert list(tmp_path.iterdir()) == []


# --- Ctrl-C --------------------------------------------------------------------------------------------

CTRL_C_IN_A_FINALIZER = """
import os, signal, sys, time
from hf_rebasin.cli import commands, main

class Finalised:
    def __del__(self):  # the garbage collector runs this finalizer when the Ctrl-C arrives
        os.kill(os.getpid(), signal.SIGINT)

def run_inspect(args):
    Finalised()  # dropped at once: its __del__ runs here, and the KeyboardInterrupt raised in it is not raised
    time.sleep(3)
    print("ran to the end")
    return 0

commands.run_inspect = run_inspect
sys.argv = ["hf-rebasin", "inspect", "some/model"]
sys.exit(main())
"""


def test_ctrl_c_that_lands_in_a_finalizer_is_not_lost():
    """What lost the Ctrl-C in the first seconds: the handler ran inside a `__del__` (regex's, during the imports
    of transformers), where Python drops the KeyboardInterrupt ("Exception ignored in ..."). It is sent again."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_A_FINALIZER], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "ran to the end" not in done.stdout and done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr.strip() == "hf-rebasin inspect: interrupted; nothing was left half-written", done.stderr
    assert time.monotonic() - start < 60


def test_ctrl_c_in_the_first_seconds_of_a_merge(pair, text_file, tmp_path):
    """SIGINT at early moments of a real merge (imports, loading): it stops, exit code 130 (or Python's own
    KeyboardInterrupt before main runs), and nothing is written."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for k, delay in enumerate((0.3, 0.9, 1.6, 2.4)):
        out = tmp_path / f"out{k}"
        proc = subprocess.Popen([*HF_REBASIN, *map(str, merge_argv(pair, text_file, out, "--method", "wm"))],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (130, -signal.SIGINT), (delay, proc.returncode, err[-2000:])
        assert list(tmp_path.iterdir()) == [], (delay, err[-2000:])  # no output, no staging folder


# --- the Python API -------------------------------------------------------------------------------------

def test_api_takes_loaded_models(pair, text_file, tmp_path):
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer
    temporary = set(Path(tempfile.gettempdir()).glob("hf-rebasin-loaded-*"))
    by_path = hf_rebasin.barrier(pair, data=str(text_file), seq_len=32, max_eval_tokens=512, lambdas=3,
                                 progress=False)
    loaded = [AutoModelForCausalLM.from_pretrained(p) for p in pair]
    result = hf_rebasin.merge(loaded, tmp_path / "out", data=str(text_file), seq_len=32, max_eval_tokens=512,
                              lambdas=3, progress=False)
    assert result.report.loss == pytest.approx(by_path.report.loss, abs=1e-5)
    assert result.report.models == [f"{p} (in memory)" for p in pair]
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    # a model that was not loaded from a folder with a tokenizer: as a (model, tokenizer) pair
    bare = [tiny.build_tiny("gpt_neox", seed=s) for s in (1, 2)]
    with pytest.raises(ModelLoadError, match=r"\(model, tokenizer\) pair"):
        hf_rebasin.barrier(bare, data=str(text_file), seq_len=32, max_eval_tokens=512, lambdas=3)
    tokenizer = AutoTokenizer.from_pretrained(pair[0])
    paired = hf_rebasin.barrier([(m, tokenizer) for m in bare], data=str(text_file), seq_len=32, max_eval_tokens=512,
                                lambdas=3, progress=False)
    assert paired.report.loss == pytest.approx(by_path.report.loss, abs=1e-5)
    assert set(Path(tempfile.gettempdir()).glob("hf-rebasin-loaded-*")) <= temporary  # the written copies removed


def test_api_refuses_a_bare_string_and_names_keywords(pair, text_file, tmp_path):
    with pytest.raises(TypeError, match="list"):
        hf_rebasin.merge(str(pair[0]), tmp_path / "out")
    with pytest.raises(TypeError, match="list"):
        hf_rebasin.barrier(pair[0])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("mine")
    with pytest.raises(OutputError) as error:
        hf_rebasin.merge(pair, tmp_path / "taken", data=str(text_file))
    assert "force=True" in str(error.value) and "--" not in str(error.value)
    with pytest.raises(OptionError) as error:
        hf_rebasin.merge(pair, tmp_path / "out", method="wm", steps=5, seq_len=0)
    assert "steps" in str(error.value) and "seq_len" in str(error.value) and "--" not in str(error.value)
    assert not (tmp_path / "out").exists()


# --- options that would do nothing -------------------------------------------------------------------

IGNORED = [  # (argv after the models, what the refusal names)
    (["merge", "--method", "wm", "--train-data", "tok.npy"], ["--train-data", "wm"]),
    (["merge", "--method", "wm", "--steps", "5"], ["--steps", "trains nothing"]),
    (["merge", "--method", "raw", "--rounds", "3"], ["--rounds", "raw"]),
    (["merge", "--method", "wm", "--am-batches", "2"], ["--am-batches"]),
    (["merge", "--method", "wm", "--match-data", "TEXT"], ["--match-data"]),
    (["barrier", "--dtype", "float16", "--max-shard-size", "1MB"], ["--dtype", "--max-shard-size", "barrier"]),
    (["merge", "--lambdas", "2"], ["--lambdas"]),
]


@pytest.mark.parametrize("argv, names", IGNORED, ids=[" ".join(a) for a, _ in IGNORED])
def test_an_option_the_run_ignores_is_refused_by_name(argv, names, pair, text_file, tmp_path, capsys):
    command, *extra = argv
    extra = [text_file if value == "TEXT" else value for value in extra]  # a file that exists
    outputs = ["--out", tmp_path / "out"] if command == "merge" else []
    refused(cli([command, *pair, "--data", text_file, *outputs, *extra], capsys), *names)
    assert list(tmp_path.iterdir()) == []


def test_a_recipe_run_with_another_method_leaves_the_ignored_options_out():
    """`hf-rebasin run pythia-1b --set method=wm`: the training budget of the dual recipe is not passed to wm."""
    from hf_rebasin.hub import recipes
    dual = recipes.commands(recipes.load_recipe("pythia-1b", check_paths=False))["merge"]
    assert "--steps" in dual and "--learn-batch-size" in dual
    wm = recipes.commands(recipes.load_recipe("pythia-1b", ["method=wm"], check_paths=False))["merge"]
    assert "--steps" not in wm and "--learn-batch-size" not in wm and "--train-data" not in wm
    assert wm[wm.index("--method") + 1] == "wm"


# --- messages that name the real problem ------------------------------------------------------------

def test_a_model_without_tokenizer_files_is_named(pair, text_file, tmp_path, capsys):
    import shutil
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(pair[1], bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    line = refused(cli(["barrier", pair[0], bare, "--data", text_file, *SMALL], capsys), str(bare),
                   "no tokenizer files")
    assert "differ" not in line


def test_data_that_is_no_regular_file(pair, tmp_path, capsys):
    line = refused(cli(["merge", *pair, "--data", "/dev/null", "--out", tmp_path / "out"], capsys), "--data",
                   "/dev/null", "not a regular file")
    assert "no such" not in line


def test_an_unknown_flag_is_refused_by_its_sub_command(pair, tmp_path, capsys):
    for command in ("merge", "barrier"):
        line = refused(cli([command, *pair, "--out", tmp_path / "out", "--cuda"], capsys), "--cuda")
        assert line.startswith(f"hf-rebasin {command}: error: unrecognized arguments"), line


# --- cards, plots, logs --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def raw_merge(pair, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("raw") / "raw-merge"
    assert main([str(a) for a in merge_argv(pair, text_file, out, "--method", "raw")]) == 0
    return out


def test_raw_card_and_plot_say_only_what_is_true(raw_merge, pair, text_file, monkeypatch):
    card = (raw_merge / "README.md").read_text()
    report = json.loads((raw_merge / "barrier.json").read_text())
    assert "rounds" not in report["settings"] and "`rounds`" not in card  # raw runs no weight matching
    assert "independently trained" not in card  # the card cannot know how the models were trained
    reproduce = card[card.index("## Reproduce"):]
    local = reproduce[reproduce.index("Local inputs"):].split("\n\n")[0]
    for name in ("model-a", "model-b", text_file.name):
        assert f"`{name}`" in local, local
    from matplotlib.figure import Figure

    from hf_rebasin.evaluation.barrier import plot_path
    labels = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: labels.append(fig.axes[0].get_xlabel()))
    plot_path({"raw": report}, "unused.png", "raw")
    plot_path({"wm": report}, "unused.png", "wm")
    assert labels == ["λ  (0 = model A, 1 = model B)", "λ  (0 = model A, 1 = aligned model B)"]


def test_progress_off_a_terminal_is_one_line_per_stage(pair, text_file, tmp_path, capsys):
    """(and a harmless ignored option, a checkpoint folder that weight matching never writes, is warned about once)"""
    code, _, err = cli(merge_argv(pair, text_file, tmp_path / "out", "--method", "wm", "--checkpoint-dir",
                                  tmp_path / "ckpt"), capsys)
    assert code == 0, err
    warned = [line for line in err.splitlines() if line.startswith("hf-rebasin: warning:")]
    assert len(warned) == 1 and "--checkpoint-dir" in warned[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert "\r" not in err
    stages = [line.split(":")[0] for line in err.splitlines()]
    assert stages.count("weight matching") == 1 and stages.count("barrier") == 1, err
    assert re.search(r"^barrier: 3/3 in \d+\.\d s$", err, re.MULTILINE), err
    # weight matching ends when it converges: said as such, not as a count of layer-rounds short of its limit
    assert re.search(r"^weight matching: converged after \d+ rounds? \(at most 10\) in \d+\.\d s \(distance=",
                     err, re.MULTILINE), err


def test_lm_eval_git_lookup_is_quiet_outside_a_repository(tmp_path, monkeypatch, capfd):
    from hf_rebasin.hub.evals import quiet_git_hash
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert quiet_git_hash() is None
    assert capfd.readouterr().err == ""
    repo = tmp_path / "repo"  # (a repository of its own: CI runs the tests in a copy that is none)
    repo.mkdir()
    for command in (["git", "init", "-q"], ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                                            "--allow-empty", "-m", "a commit"]):
        subprocess.run(command, cwd=repo, check=True)
    monkeypatch.chdir(repo)
    assert quiet_git_hash()


# --- answering at once ---------------------------------------------------------------------------------

def imported_modules(argv: list[str]) -> tuple[int, set[str], str]:
    """(exit code, modules imported, stderr) of `python -X importtime -m hf_rebasin.cli ARGV`."""
    done = subprocess.run([sys.executable, "-X", "importtime", *HF_REBASIN[1:], *argv], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    modules = {m.group(1) for m in re.finditer(r"^import time:.*\|\s*([\w.]+)\s*$", done.stderr, re.MULTILINE)}
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    return done.returncode, modules, "\n".join(lines)


def test_version_help_and_refusals_do_not_import_torch(pair, text_file, tmp_path):
    heavy = {"torch", "transformers", "timm", "numpy", "lm_eval", "datasets", "matplotlib"}
    cases = [(["--version"], 0), (["--help"], 0), (["merge", "--help"], 0), (["merge", "a", "b"], 2),
             (["merge", *map(str, pair), "--out", str(tmp_path / "o"), "--steps", "5"], 2),
             (["merge", *map(str, pair), "--out", "/proc/hf-rebasin-out"], 2),
             (["barrier", *map(str, pair), "--data", "/dev/null"], 2),
             (["merge", *map(str, pair), "--out", str(tmp_path / "o"), "--cuda"], 2),
             (["merge", "/no/such/model", str(pair[0]), "--out", str(tmp_path / "o")], 2)]
    for argv, expected in cases:
        code, modules, err = imported_modules(argv)
        assert code == expected, (argv, err)
        assert "hf_rebasin.cli" in modules and not heavy & modules, (argv, sorted(heavy & modules))
    assert list(tmp_path.iterdir()) == []
