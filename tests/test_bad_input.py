"""Bad input on the command line (issue 13): every option out of range, and each case the issue lists, is a
one-line error with exit code 2 naming the flag, found within a second and before anything is written; or,
where the input is valid after all, the right output.

The out-of-range values are made from the option dataclasses themselves (the `low`/`high`/`above`/`choices`
metadata of every field of MergeOptions, EvalOptions and PushOptions), so a new flag is covered the day it is
added.  The commands run in this process (`hf_rebasin.cli.main`); the imports are done once beforehand, so
each timing is the command's own work."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from conftest import HF_REBASIN
from hub_server import FakeHub, use_fake_hub, write_merge_output

from hf_rebasin import __version__, tiny
from hf_rebasin.cli import DESCRIPTION, main
from hf_rebasin.export.io import STAGING_TAG
from hf_rebasin.options import EvalOptions, MergeOptions, PushOptions, fields_of, flag_of, value_type
from hf_rebasin.sources import models

MAX_SECONDS = 1.0  # every refusal comes within this, before any expensive step


# --- the out-of-range values, from the option dataclasses ---------------------------------------------

def out_of_range(cls, f: dataclasses.Field) -> list[str]:
    """Values the field's metadata says are invalid (an empty list for a field without a range)."""
    kind, meta = value_type(cls, f), f.metadata
    values: list = []
    if meta.get("choices"):
        values.append("no-such-choice")
    if kind in (int, float):
        step = 1 if kind is int else 0.25
        low, high, above = meta.get("low"), meta.get("high"), meta.get("above")
        if low is not None:
            values.append(low - step)
        if high is not None:
            values.append(high + step)
        if above is not None:
            values += [above, above - step]
        if low is not None or high is not None or above is not None:
            values.append("not-a-number")
            if kind is float:
                values += ["nan", "inf", "-inf"]
    return [str(kind(v)) if isinstance(v, (int, float)) else v for v in values]


def bad_flag_cases():
    """(command, number of models, field, flag, value) for every out-of-range value of every flag."""
    cases = []  # merge with two models, barrier with three: each flag is driven for both kinds of merge
    for command, cls, n in (("merge", MergeOptions, 2), ("barrier", MergeOptions, 3), ("eval", EvalOptions, 1),
                            ("push", PushOptions, 1)):
        for f in fields_of(cls):
            if f.metadata.get("positional"):
                continue
            for value in out_of_range(cls, f):
                cases.append(pytest.param(command, n, f.name, flag_of(f), value, id=f"{command}-{f.name}={value}"))
    return cases


BAD_FLAG_CASES = bad_flag_cases()


def test_every_ranged_flag_is_driven():
    """The enumeration is not empty by accident: every field with a range or choices yields values."""
    for cls in (MergeOptions, EvalOptions, PushOptions):
        for f in fields_of(cls):
            meta = f.metadata
            ranged = any(meta.get(k) is not None for k in ("low", "high", "above")) or meta.get("choices")
            assert bool(out_of_range(cls, f)) == bool(ranged), f.name
    flags = {case.values[3] for case in BAD_FLAG_CASES}
    assert {"--seq-len", "--max-eval-tokens", "--batch-size", "--am-batches", "--simplex-resolution", "--lambdas",
            "--alpha", "--lr", "--orth", "--limit"} <= flags


# --- fixtures and helpers ------------------------------------------------------------------------------

def file_hashes(*folders: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for folder in folders for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sources(tiny_dirs, tmp_path_factory):
    """Three tiny GPT-NeoX models with distinctive folder names (the card must name each)."""
    root = tmp_path_factory.mktemp("sources")
    return [tiny.make_tiny("gpt_neox", root / name, seed=seed)
            for seed, name in ((1, "neox-alpha"), (2, "neox-beta"), (3, "neox-gamma"))]


@pytest.fixture(scope="module")
def merge_output(tiny_dirs, tmp_path_factory):
    """A folder laid out as a merge output (a model, barrier.json, barrier.png), for eval and push."""
    out = tmp_path_factory.mktemp("merge-output") / "merged"
    shutil.copytree(tiny_dirs["gpt_neox"], out)
    write_merge_output(out)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def imports_done(sources, merge_output, text_file):
    """Run each command once so that the imports (torch, transformers, the pipeline) are not timed."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        for argv in (["merge", *map(str, sources[:2]), "--out", "/nonexistent/x", "--seq-len", "0"],
                     ["barrier", *map(str, sources[:2]), "--lambdas", "0"],
                     ["eval", str(merge_output), "--limit", "0"], ["push", str(merge_output), "a/b", "--bogus"]):
            try:
                main(argv)
            except SystemExit:
                pass


@dataclasses.dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float

    def refused(self, *names: str, seconds: float = MAX_SECONDS) -> str:
        """Assert a one-line error, exit code 2, naming each of `names`, within `seconds`; return the line."""
        lines = self.err.strip().splitlines()
        assert self.code == 2, (self.code, self.err)
        assert len(lines) == 1, f"not one line:\n{self.err}"
        assert "Traceback" not in self.err
        for name in names:
            assert name in lines[0], (name, lines[0])
        assert self.seconds < seconds, f"{self.seconds:.2f} s: {lines[0]}"
        return lines[0]


@pytest.fixture
def cli(capsys):
    def run(argv: list) -> Outcome:
        capsys.readouterr()
        start = time.perf_counter()
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:
            code = exit_.code
        seconds = time.perf_counter() - start
        captured = capsys.readouterr()
        return Outcome(code, captured.out, captured.err, seconds)
    return run


@pytest.fixture
def work(tmp_path):
    """An empty folder for outputs: after a refusal it must still be empty."""
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


# --- (a) every flag out of range ------------------------------------------------------------------------

@pytest.mark.parametrize("command, n_models, name, flag, value", BAD_FLAG_CASES)
def test_flag_out_of_range_is_refused_at_once(command, n_models, name, flag, value, cli, work, sources, text_file,
                                              merge_output):
    before = file_hashes(*sources, merge_output, text_file.parent)
    models_ = [str(s) for s in sources[:n_models]]
    argv = {"merge": ["merge", *models_, "--out", work / "out", "--data", text_file],
            "barrier": ["barrier", *models_, "--json", work / "barrier.json", "--data", text_file],
            "eval": ["eval", merge_output], "push": ["push", merge_output, "someuser/never"]}[command]
    outcome = cli([*argv, f"{flag}={value}"])
    line = outcome.refused(flag)
    assert line.startswith(f"hf-rebasin {command}: error:"), line
    assert list(work.iterdir()) == []  # no output, no staging sibling, no report
    assert sorted(p.name for p in merge_output.parent.iterdir()) == ["merged"]
    assert file_hashes(*sources, merge_output, text_file.parent) == before


def test_eval_batch_size_and_device(cli, merge_output):
    """eval's --batch-size is a string (a number or 'auto'); --device is checked by name."""
    before = file_hashes(merge_output)
    for value in ("0", "-3", "eight", "1.5"):
        cli(["eval", merge_output, "--batch-size", value]).refused("--batch-size")
    cli(["eval", merge_output, "--device", "tpu"]).refused("--device", "tpu")
    assert file_hashes(merge_output) == before and sorted(p.name for p in merge_output.parent.iterdir()) == ["merged"]


# --- (c) the cases of issue 13 ----------------------------------------------------------------------------

def merge_args(sources, text_file, out, n=2):
    return ["merge", *map(str, sources[:n]), "--out", str(out), "--data", str(text_file)]


CUDA_DEVICE = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"

REFUSED_OPTIONS = [  # (extra argv, number of models, what the message must name)
    (["--seq-len", "1"], 2, ["--seq-len"]),
    (["--seq-len", "0"], 2, ["--seq-len"]),
    (["--seq-len", "4096"], 2, ["--seq-len", "context"]),  # longer than the model's context: from its config
    (["--batch-size", "0"], 2, ["--batch-size"]),
    (["--method", "am", "--am-batches", "0"], 2, ["--am-batches"]),
    (["--simplex-resolution", "0"], 3, ["--simplex-resolution"]),
    (["--simplex-resolution", "40"], 3, ["--simplex-resolution", "lattice points"]),
    (["--simplex-resolution", "3"], 2, ["--simplex-resolution", "three or more"]),
    (["--device", CUDA_DEVICE], 2, ["--device", "GPU"]),
    (["--device", "tpu"], 2, ["--device", "tpu"]),
    (["--device", "cuda:x"], 2, ["--device", "cuda:x"]),
    (["--method", "dual", "--lambdas", "1"], 2, ["--lambdas"]),
    (["--alpha", "0.5"], 3, ["--alpha", "two models"]),
    (["--lambdas", "5"], 3, ["--lambdas", "two models"]),
    (["--method", "am"], 3, ["--method am", "3 models"]),
    (["--method", "dual", "--start", "am"], 3, ["--start", "two models"]),
    (["--max-eval-tokens", "0"], 2, ["--max-eval-tokens"]),
    (["--max-eval-tokens", "16", "--seq-len", "32"], 2, ["--max-eval-tokens", "--seq-len"]),
    (["--method", "dual", "--steps", "10", "--warmup", "10"], 2, ["--warmup"]),
    (["--method", "dual", "--learn-batch-size", "6", "--grad-accum", "4"], 2, ["--learn-batch-size", "--grad-accum"]),
    (["--method", "dual", "--resume", "/nope/checkpoint.pt"], 2, ["--resume", "no such checkpoint"]),
    (["--train-data", "/nope/train.txt", "--method", "dual"], 2, ["--train-data", "/nope/train.txt"]),
    (["--method", "magic"], 2, ["--method", "magic"]),
    (["--method", "dual", "--fsdp"], 2, ["--fsdp", "one process", "accelerate"]),
]


@pytest.mark.parametrize("extra, n_models, names", REFUSED_OPTIONS, ids=[" ".join(c[0]) + f" ({c[1]} models)"
                                                                         for c in REFUSED_OPTIONS])
def test_listed_bad_options(extra, n_models, names, cli, work, sources, text_file):
    checkpoints = work / "ckpt"
    outcome = cli([*merge_args(sources, text_file, work / "out", n_models), "--checkpoint-dir", checkpoints, *extra])
    outcome.refused(*names)
    assert list(work.iterdir()) == []  # no output, no checkpoint folder: refused before any training


def test_force_never_replaces_the_current_folder_its_parents_or_home(cli, tmp_path, sources, text_file, monkeypatch):
    here = tmp_path / "project"
    (here / "notes").mkdir(parents=True)
    (here / "notes" / "todo.txt").write_text("mine")
    (here / "data.csv").write_text("1,2,3\n")
    before = file_hashes(tmp_path)
    monkeypatch.chdir(here)
    for out in (".", "..", str(here), "./"):
        cli([*merge_args(sources, text_file, out), "--force"]).refused("current folder")
    (here / "barrier.json").write_text("{}")  # even a folder that looks like an earlier output
    before = file_hashes(tmp_path)
    cli([*merge_args(sources, text_file, "."), "--force"]).refused("current folder")
    home = tmp_path / "home"
    home.mkdir()
    (home / "barrier.json").write_text("{}")
    (home / ".bashrc").write_text("# mine\n")
    monkeypatch.setenv("HOME", str(home))
    before = file_hashes(tmp_path)
    cli([*merge_args(sources, text_file, "~"), "--force"]).refused("home folder")
    cli([*merge_args(sources, text_file, home), "--force"]).refused("home folder")
    # a source model's folder, or one inside it
    cli([*merge_args(sources, text_file, sources[0]), "--force"]).refused("overlaps the source")
    cli([*merge_args(sources, text_file, sources[1] / "sub"), "--force"]).refused("overlaps the source")
    assert file_hashes(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "project"]


def test_out_naming_a_file_or_under_a_file(cli, work, sources, text_file):
    target = work / "model.txt"
    target.write_text("not a folder")
    cli(merge_args(sources, text_file, target)).refused("--out", "is a file")
    cli([*merge_args(sources, text_file, target), "--force"]).refused("--out", "is a file")
    cli(merge_args(sources, text_file, target / "deeper" / "out")).refused("--out", "is a file")
    assert sorted(p.name for p in work.iterdir()) == ["model.txt"] and target.read_text() == "not a folder"


def test_unwritable_out_parent(cli, tmp_path, sources, text_file, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root may write anywhere: behave as an ordinary user would see this folder
        real_access = os.access

        def access(path, mode, *args, **kwargs):
            if mode & os.W_OK and Path(path).resolve() == locked:
                return False
            return real_access(path, mode, *args, **kwargs)
        monkeypatch.setattr(os, "access", access)
    try:
        cli(merge_args(sources, text_file, locked / "out")).refused("--out", "not writable")
        cli(merge_args(sources, text_file, locked / "a" / "b")).refused("--out", "not writable")
        cli(["barrier", *map(str, sources[:2]), "--data", text_file, "--json", locked / "b.json"]).refused(
            "--json", "not writable")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_barrier_json_naming_a_folder_or_a_missing_folder(cli, work, sources, text_file):
    args = ["barrier", *map(str, sources[:2]), "--data", text_file, "--json"]
    (work / "reports").mkdir()
    cli([*args, work / "reports"]).refused("--json", "is a folder")
    cli([*args, work / "missing" / "b.json"]).refused("--json", "does not exist")
    assert [p.relative_to(work).as_posix() for p in work.rglob("*")] == ["reports"]  # no *.partial, no *.tmp


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    with FakeHub(lifetime_s=60) as server:
        use_fake_hub(monkeypatch, server, tmp_path)
        yield server


def test_push_to_hub_without_a_token_is_refused_before_the_merge(cli, work, sources, text_file, fake_hub,
                                                                 monkeypatch, tmp_path):
    use_fake_hub(monkeypatch, fake_hub, tmp_path, token=None)
    outcome = cli([*merge_args(sources, text_file, work / "out"), "--push-to-hub", "someuser/merged"])
    outcome.refused("HF_TOKEN")
    assert list(work.iterdir()) == [] and fake_hub.repos == {}
    use_fake_hub(monkeypatch, fake_hub, tmp_path)  # a token, but a repo id the Hub cannot have
    cli([*merge_args(sources, text_file, work / "out"), "--push-to-hub", "not a/repo/id"]).refused("--push-to-hub")
    assert list(work.iterdir()) == [] and fake_hub.requests == []


def test_a_missing_absolute_path_is_no_hub_lookup(cli, work, text_file, sources, fake_hub):
    for missing in ("/nope/model", "./nope-model", "~/nope/model"):
        line = cli(["merge", missing, str(sources[0]), "--out", work / "out", "--data", text_file]).refused(
            "no such model folder", missing)
        assert "Hub" not in line
        cli(["inspect", missing]).refused("no such model folder")
    assert fake_hub.requests == [] and list(work.iterdir()) == []


def test_push_that_cannot_reach_the_hub_leaves_the_folder_unchanged(cli, merge_output, monkeypatch, tmp_path):
    with socket.socket() as sock:  # a port nobody listens on: the connection is refused, as when offline
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    use_fake_hub(monkeypatch, types.SimpleNamespace(endpoint=f"http://127.0.0.1:{port}"), tmp_path)
    before = file_hashes(merge_output)
    line = cli(["push", merge_output, "someuser/x"]).refused("someuser/x", "Retry with", seconds=30)
    assert "could not create the Hub repo" in line
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cli(["push", merge_output, "someuser/x"]).refused("someuser/x")
    assert file_hashes(merge_output) == before
    assert sorted(p.name for p in merge_output.parent.iterdir()) == ["merged"]  # no staging copy left


def test_push_bad_inputs(cli, merge_output, fake_hub, tmp_path):
    before = file_hashes(merge_output)
    cli(["push", merge_output, "not a/repo/id"]).refused("not a/repo/id")
    cli(["push", tmp_path / "missing", "someuser/x"]).refused("is not a folder")
    (tmp_path / "plain").mkdir()
    cli(["push", tmp_path / "plain", "someuser/x"]).refused("barrier.json")
    assert fake_hub.repos == {} and file_hashes(merge_output) == before


def test_non_finite_weights_are_named_by_the_checkpoints_own_key(cli, work, sources, text_file):
    broken = tiny.build_tiny("gpt_neox", seed=1)
    with torch.no_grad():
        broken.gpt_neox.layers[0].mlp.dense_h_to_4h.weight[5, 7] = float("nan")
    broken.save_pretrained(work / "nan")
    tiny.tiny_tokenizer(97).save_pretrained(work / "nan")
    outcome = cli(["merge", sources[0], work / "nan", "--out", work / "out", "--data", text_file,
                   "--seq-len", "32", "--max-eval-tokens", "512"])
    outcome.refused("gpt_neox.layers.0.mlp.dense_h_to_4h.weight", "non-finite", "NaN", seconds=30)
    assert sorted(p.name for p in work.iterdir()) == ["nan"]


def test_resume_on_a_garbage_file_is_one_line(cli, work, sources, text_file):
    garbage = {"pickle.pt": b"\x80\x04not a checkpoint at all" * 10, "text.pt": b"hello world\n"}
    for name, content in garbage.items():
        (work / name).write_bytes(content)
    torch.save({"step": 3, "params": {}}, work / "foreign.pt")  # a torch file, but not a checkpoint of ours
    for name, message in (("pickle.pt", "not a readable checkpoint"), ("text.pt", "not a readable checkpoint"),
                          ("foreign.pt", "not a hf-rebasin learned-matching checkpoint")):
        outcome = cli([*merge_args(sources, text_file, work / "out"), "--seq-len", "32", "--max-eval-tokens", "512",
                       "--method", "dual", "--steps", "2", "--learn-batch-size", "4", "--train-data", text_file,
                       "--resume", work / name, "--checkpoint-dir", work / "ckpt"])
        line = outcome.refused("--resume", name, message)  # read before the models are loaded
        assert "weights_only" not in outcome.err and "torch.load" not in outcome.err, line
    assert sorted(p.name for p in work.iterdir()) == ["foreign.pt", "pickle.pt", "text.pt"]


def test_inspect_into_a_closed_pipe_is_quiet(sources):
    """`hf-rebasin inspect ... | head`: the reader goes away; no BrokenPipeError traceback, exit code 0.  Run with
    stdout buffered, as in a terminal session (PYTHONUNBUFFERED would hide the error at exit)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    with subprocess.Popen([*HF_REBASIN, "inspect", str(sources[0])], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=env) as proc:
        proc.stdout.close()  # as `head` does once it has its lines (here: before the first one)
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=120)
    assert code == 0 and err == "", (code, err)
    shell = subprocess.run(f"{shlex.join(HF_REBASIN)} inspect --json '{sources[0]}' | head -n 1", shell=True,
                           capture_output=True, text=True, env=env, timeout=120)
    assert shell.stderr == "" and shell.stdout == "{\n", shell


def test_help_and_version(cli):
    outcome = cli(["--help"])
    assert outcome.code == 0 and outcome.err == ""
    text = " ".join(outcome.out.split())
    assert " ".join(DESCRIPTION.split()) in text and DESCRIPTION.endswith(".")
    for command in ("inspect", "merge", "barrier", "eval", "push", "demo", "tokenize"):
        assert re.search(rf"\b{command}\b", text), command
        sub = cli([command, "--help"])
        assert sub.code == 0 and sub.out.startswith("usage: hf-rebasin " + command), sub.err
    outcome = cli(["--version"])
    assert outcome.code == 0 and outcome.out.strip() == f"hf-rebasin {__version__}"
    # a wrong sub-command or a missing argument: one line too, not the usage block
    cli(["mergee"]).refused("mergee")
    cli(["merge", "a", "b"]).refused("--out")


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.fixture(scope="module")
def three_way_merge(sources, text_file, tmp_path_factory):
    """A three-model merge at --simplex-resolution 2 (the centroid is off that lattice) under umask 027."""
    out = tmp_path_factory.mktemp("merges") / "three-way-card"
    old = os.umask(0o027)
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err, contextlib.redirect_stdout(io.StringIO()):
            code = main(["merge", *map(str, sources), "--method", "wm", "--out", str(out), "--data", str(text_file),
                         "--seq-len", "32", "--max-eval-tokens", "1024", "--simplex-resolution", "2"])
    finally:
        os.umask(old)
    assert code == 0, err.getvalue()
    return out


def test_simplex_resolution_2_with_three_models_works_end_to_end(three_way_merge, text_file):
    from transformers import AutoTokenizer

    from hf_rebasin.evaluation.barrier import evaluate
    from hf_rebasin.sources.data import load_token_windows
    from hf_rebasin.sources.eval_data import EvalData
    out = three_way_merge
    report = json.loads((out / "barrier.json").read_text())
    assert report["n_models"] == 3 and len(report["lambdas"]) == 6  # C(4, 2) lattice points
    assert sorted(map(tuple, report["lambdas"])) == sorted(
        [(i / 2, j / 2, (2 - i - j) / 2) for i in range(3) for j in range(3 - i)])
    assert report["alpha"] == pytest.approx([1 / 3] * 3)
    windows, _ = load_token_windows(str(text_file), AutoTokenizer.from_pretrained(out), 32, 1024)
    loss = evaluate(models.load(out).model, EvalData("causal-lm", windows))["loss"]
    assert math.isfinite(report["merged_loss"]) and abs(loss - report["merged_loss"]) < 1e-3  # the centroid itself
    assert report["barrier"] == pytest.approx(max(report["excess"]))


def test_output_folders_follow_the_umask(three_way_merge, cli, sources, text_file, tmp_path):
    out = three_way_merge
    assert mode(out) == 0o750
    assert {mode(p) for p in out.rglob("*") if p.is_file()} == {0o640}
    old = os.umask(0o022)
    try:
        again = tmp_path / "two-way"
        assert cli([*merge_args(sources, text_file, again), "--seq-len", "32", "--max-eval-tokens", "512",
                    "--lambdas", "3", "--method", "raw"]).code == 0
        assert cli(["barrier", *map(str, sources[:2]), "--data", text_file, "--seq-len", "32", "--max-eval-tokens",
                    "512", "--lambdas", "3", "--method", "raw", "--json", tmp_path / "b.json"]).code == 0
    finally:
        os.umask(old)
    assert mode(again) == 0o755 and {mode(p) for p in again.rglob("*") if p.is_file()} == {0o644}
    assert mode(tmp_path / "b.json") == 0o644


def test_card_names_the_final_folder_and_every_model_and_no_local_path(three_way_merge, sources, tmp_path):
    card = (three_way_merge / "README.md").read_text()
    assert "three-way-card" in card and STAGING_TAG not in card  # not the name of the folder it was built in
    from huggingface_hub import ModelCard
    assert ModelCard(card).data.model_name == "three-way-card"
    for source in sources:
        assert source.name in card, source.name
    for local in (str(tmp_path), str(sources[0].parent), str(Path.home()), os.getcwd()):
        assert local not in card, local
    assert not re.search(r"(?<![\w.])/(tmp|home|root|work|Users)/", card), "an absolute local path in the card"


def test_ctrl_c_while_force_replaces_keeps_old_or_new_whole(cli, sources, text_file, tmp_path, monkeypatch):
    """Ctrl-C at each step of a --force replacement: before the swap the old output is intact, after it the new
    one is whole; with renameat2 and without it (two renames, the old restored on failure)."""
    from hf_rebasin import pipeline
    from hf_rebasin.export import io as hio
    out = tmp_path / "out"
    common = [*merge_args(sources, text_file, out), "--seq-len", "32", "--max-eval-tokens", "512", "--lambdas", "3"]
    assert cli([*common, "--method", "raw"]).code == 0
    old = file_hashes(out)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    real_rename, real_rmtree = Path.rename, shutil.rmtree

    def rename_interrupted_into_place(self, target):  # the second rename of the fallback: new -> out
        if STAGING_TAG in self.name and "-new-" in self.name and Path(target) == out:
            raise KeyboardInterrupt
        return real_rename(self, target)

    calls = []

    def rmtree_interrupted_once(path, *args, **kwargs):  # removing what the swap put aside
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    before_swap = [(pipeline, "plot_path", interrupt), (hio, "_exchange", interrupt)]
    fallback = [(hio, "_exchange", lambda a, b: False), (Path, "rename", rename_interrupted_into_place)]
    for patches, expect_new in ((before_swap[:1], False), (before_swap[1:], False), (fallback, False),
                                ([(hio.shutil, "rmtree", rmtree_interrupted_once)], True)):
        with monkeypatch.context() as patch:
            for owner, name, value in patches:
                patch.setattr(owner, name, value)
            outcome = cli([*common, "--method", "wm", "--force"])
        assert outcome.code == 130 and "interrupted" in outcome.err
        if expect_new:
            report = json.loads((out / "barrier.json").read_text())
            assert report["method"] == "wm" and models.load(out).model is not None
            assert sorted(p.name for p in out.iterdir()) == sorted(Path(p).name for p in old)
        else:
            assert file_hashes(out) == old, patches
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], patches  # no staging sibling left
        if expect_new:
            assert cli([*common, "--method", "raw", "--force"]).code == 0
            old = file_hashes(out)


def test_a_killed_fallback_swap_is_restored_not_removed(sources, text_file, tmp_path):
    """Without renameat2 a replacement is two renames; a kill between them leaves the old output only in its
    temporary sibling.  The next run puts it back instead of removing it as a stale staging folder."""
    from hf_rebasin.export.io import remove_stale_staging
    out = tmp_path / "out"
    out.mkdir()
    (out / "barrier.json").write_text('{"method": "raw"}')
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    aside = tmp_path / f".out{STAGING_TAG}{dead.pid}-old-abcd1234"
    out.rename(aside)
    new = tmp_path / f".out{STAGING_TAG}{dead.pid}-new-efgh5678"
    new.mkdir()
    (new / "barrier.json").write_text('{"method": "wm"}')
    remove_stale_staging(out)
    assert (out / "barrier.json").read_text() == '{"method": "raw"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

