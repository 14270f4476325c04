"""Fault injection (issue 13): `hf-rebasin` is interrupted with SIGINT (Ctrl-C), SIGTERM (issue 48: `timeout`,
slurm, `docker stop`) or SIGKILL at seeded random moments of a merge, a --force replacement, a learned run with
checkpoints and a push, and with SIGTERM, SIGHUP and SIGINT while it samples `self` training data.  After each
interruption the sources, the previous output and every checkpoint are intact, the output is either absent / the
old one or a complete new one, and the next run succeeds (or resumes) and leaves no staging folder behind.

The moments are stratified over the duration of one uninterrupted run of the same command (measured first), with
seeded jitter, and the signals alternate in a seeded order: the same points on every run of the suite up to the
machine's speed.  A merge's export is a small part of its run, so some points of the merge scenarios are taken from
the moment its staging folder appears instead (EXPORT_POINTS); where every signal landed (before, during or after
the export, read just before it was sent) is asserted, and what the output is after it.  The counts below are the
numbers of interruption points per scenario."""
from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import HF_REBASIN
from hub_server import TOKEN, FakeHub
from interrupt_scenarios import base_env, make_pair, merge_args
from safetensors.torch import load_file

from hf_rebasin.export.io import STAGING_TAG
from hf_rebasin.export.ownership import MANIFEST
from hf_rebasin.match.train_loop import CHECKPOINT_FORMAT
from hf_rebasin.sources import models

SEED = 13
MERGE_POINTS = 9  # a first merge (no output yet)
FORCE_POINTS = 4  # a --force replacement of an earlier output
LEARNED_POINTS = 4  # a learned run (--method dual) writing checkpoints
PUSH_POINTS = 3  # a push to the (fake) Hub
EXPORT_POINTS = {"merge": 3, "force": 2}  # of MERGE_POINTS / FORCE_POINTS: sent 0-EXPORT_JITTER s into the export
EXPORT_JITTER = 0.05
DOUBLE_SIGINT = "SIGINT twice"  # Ctrl-C, then Ctrl-C again at once: abort without waiting for the step
LEARNED_STEPS, CHECKPOINT_EVERY = 40, 8
LANES = 2  # interruption points checked side by side (one core each)
RUN_TIMEOUT_S = 180  # one run; a run that outlives it hangs
LOADING = threading.Lock()  # loading in this process: one lane at a time
OUTPUT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "barrier.json", "barrier.png",
                "transforms.safetensors", "README.md")


# --- running and interrupting -----------------------------------------------------------------------

def run_to_end(args: list, env: dict) -> float:
    """Run hf-rebasin to the end (it must succeed); return its wall time."""
    start = time.monotonic()
    done = subprocess.run([*HF_REBASIN, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{args}\n{done.stderr[-3000:]}"
    return time.monotonic() - start


def interrupt(args: list, env: dict, delay: float, how, anchor=None, phase=None) -> tuple[int, str, str | None]:
    """Start hf-rebasin, send `how` (a signal, or DOUBLE_SIGINT) after `delay` s; return (exit code, stderr, where
    it landed: phase() read just before the signal was sent, "after the end" when the run had finished first).
    anchor=(seen, at): a moment past `at` s is taken from when seen() first holds instead (the first checkpoint of
    a learned run, the staging folder of an export), so that a run slower than the measured one is still
    interrupted at the same stage."""
    proc = subprocess.Popen([*HF_REBASIN, *map(str, args)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if anchor is not None and delay >= anchor[1]:
        while proc.poll() is None and not anchor[0]():
            time.sleep(0.01)
        delay -= anchor[1]
    landed = "after the end"
    try:
        proc.wait(timeout=delay)  # it may finish first: then the point lies after the end
    except subprocess.TimeoutExpired:
        landed = phase() if phase is not None else None
        if how == DOUBLE_SIGINT:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
        else:
            proc.send_signal(how)
    try:
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"hf-rebasin did not stop within {RUN_TIMEOUT_S} s of {how} at {delay:.2f} s") from None
    code = proc.returncode
    if how == signal.SIGKILL:
        assert code in (0, -signal.SIGKILL), (code, err[-3000:])
    else:  # Ctrl-C: exit code 130 and the line saying so (after a progress bar the interrupt cut short); before
        # main runs, or once it has returned, Python's own KeyboardInterrupt (-SIGINT); never another exception.
        # SIGTERM, SIGHUP: the same, with 128 + its number and its name in the line (killed by it before main)
        signum = signal.SIGINT if how == DOUBLE_SIGINT else how
        assert code in (0, 128 + signum, -signum), (code, err[-3000:])
        assert not re.search(r"^\w[\w.]*Error\b", err, re.MULTILINE), err[-3000:]
        if code == 128 + signum:
            by = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
            assert re.search(rf"hf-rebasin( \w+)?: interrupted{by}; nothing was left half-written$",
                             err.strip().splitlines()[-1]), err[-3000:]
    return code, err, landed


def schedule(duration: float, n: int, rng: random.Random, kinds=(signal.SIGINT, signal.SIGKILL),
             start: float = 0.0) -> list[tuple[float, object]]:
    """n moments stratified over [start, duration) with seeded jitter, each with a signal (balanced, shuffled)."""
    span = duration - start
    delays = [start + span * (k + rng.random()) / n for k in range(n)]
    signals = [kinds[k % len(kinds)] for k in range(n)]
    rng.shuffle(signals)
    return list(zip(delays, signals))


# --- what must hold ---------------------------------------------------------------------------------

def tree_hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def staging(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if STAGING_TAG in p.name)


def assert_complete_output(out: Path, method: str) -> None:
    """Every file of a merge output, barrier.json parses and names the method, the model and transforms load."""
    for name in OUTPUT_FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    report = json.loads((out / "barrier.json").read_text())
    assert report["method"] == method and len(report["loss"]) == len(report["lambdas"])
    with LOADING:
        assert models.load(out).model is not None
        assert load_file(out / "transforms.safetensors")
    assert not [p.name for p in out.rglob("*") if p.name.endswith((".tmp", ".partial")) or STAGING_TAG in p.name]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two tiny GPT-NeoX models, held-out and training text: the sources every run reads."""
    return make_pair(tmp_path_factory.mktemp("sources"))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return base_env(tmp_path_factory.mktemp("hf_home"))


@pytest.fixture(scope="module")
def reference(pair, env, tmp_path_factory):
    """One uninterrupted wm merge: its duration and its output (the folder the push scenario uploads)."""
    out = tmp_path_factory.mktemp("reference") / "merged"
    duration = run_to_end(merge_args(pair, out, "wm"), env)
    assert_complete_output(out, "wm")
    return duration, out


# --- the scenarios ----------------------------------------------------------------------------------

def in_lanes(points: list, check_point) -> list:
    """check_point(k, delay, how) for every point, LANES at a time (each point has its own folders; each run is
    single-threaded, so two lanes on two cores keep every run at its solo pace); the first failure is raised."""
    with ThreadPoolExecutor(LANES) as pool:
        futures = [pool.submit(check_point, k, *point) for k, point in enumerate(points)]
        return [future.result() for future in futures]


def with_export_points(points: list, n: int, rng: random.Random, kinds: tuple) -> list[tuple]:
    """(delay, signal, False) for the stratified points but the last n, which become (jitter, signal, True): sent
    that long after the staging folder of the export appears."""
    signals = [kinds[k % len(kinds)] for k in range(n)]
    rng.shuffle(signals)
    return ([(delay, how, False) for delay, how in points[:len(points) - n]]
            + [(EXPORT_JITTER * rng.random(), how, True) for how in signals])


def export_anchor(work: Path) -> tuple:
    return (lambda: bool(staging(work)), 0.0)


def test_interrupted_first_merge(pair, env, reference, tmp_path):
    """A merge into a new folder: after the kill the folder is absent or a complete output; a signal sent before
    the export leaves no output, one sent during it leaves none or the whole output (a SIGKILL that left none left
    its half-written staging folder, never the output's name), and some signals land during the export."""
    sources = tree_hashes(pair)

    def check_point(k: int, delay: float, how, at_export: bool) -> tuple[str, str]:
        work = tmp_path / f"point{k}"
        work.mkdir()
        out = work / "out"
        args = merge_args(pair, out, "wm")

        def phase() -> str:
            return "during the export" if staging(work) else "after the export" if out.exists() else \
                "before the export"

        _, _, landed = interrupt(args, env, delay, how, anchor=export_anchor(work) if at_export else None,
                                 phase=phase)
        assert tree_hashes(pair) == sources, (delay, how)
        if how != signal.SIGKILL:  # a signal the command handles: its staging is gone before it exits
            assert staging(work) == [], (delay, how)
        found = "complete" if out.exists() else "absent"
        if landed == "before the export":
            assert found == "absent", (delay, how)
        if landed == "during the export" and how == signal.SIGKILL and found == "absent":
            assert staging(work), (delay, how)  # killed mid-export: the half-written folder, under another name
        if out.exists():
            assert_complete_output(out, "wm")
        run_to_end([*args, "--force"] if out.exists() else args, env)
        assert_complete_output(out, "wm")
        assert staging(work) == [] and sorted(p.name for p in work.iterdir()) == ["out"], (delay, how)
        return landed, found

    kinds = (signal.SIGINT, signal.SIGKILL, signal.SIGTERM)
    rng = random.Random(SEED)
    points = with_export_points(schedule(reference[0], MERGE_POINTS, rng, kinds), EXPORT_POINTS["merge"], rng, kinds)
    found = in_lanes(points, check_point)
    assert len(found) == MERGE_POINTS and tree_hashes(pair) == sources
    landed = [where for where, _ in found]
    assert landed.count("during the export") >= EXPORT_POINTS["merge"] - 1, found  # (one may see the export end)
    assert "before the export" in landed, found


def test_interrupted_force_replacement(pair, env, reference, tmp_path):
    """--force over an earlier output: after the kill the old output is byte-identical or the new one complete;
    a signal sent before the export leaves the old one, and some signals land during the export."""
    sources = tree_hashes(pair)
    pristine = tmp_path / "pristine"
    run_to_end(merge_args(pair, pristine, "raw"), env)
    old = tree_hashes(pristine)

    def check_point(k: int, delay: float, how, at_export: bool) -> tuple[str, str]:
        work = tmp_path / f"point{k}"
        work.mkdir()
        out = work / "out"
        shutil.copytree(pristine, out)
        args = merge_args(pair, out, "wm", "--force")

        def phase() -> str:
            try:
                return "during the export" if staging(work) else "before the export" if tree_hashes(out) == old \
                    else "after the export"
            except FileNotFoundError:  # a file gone while it was read: the swap, at the end of the export
                return "during the export"

        _, _, landed = interrupt(args, env, delay, how, anchor=export_anchor(work) if at_export else None,
                                 phase=phase)
        assert tree_hashes(pair) == sources, (delay, how)
        assert out.is_dir(), (delay, how)
        if how != signal.SIGKILL:  # a signal the command handles: its staging is gone before it exits
            assert staging(work) == [], (delay, how)
        found = "old" if tree_hashes(out) == old else "new"
        if landed == "before the export":
            assert found == "old", (delay, how)
        if landed == "during the export" and how == signal.SIGKILL and found == "old":
            assert staging(work), (delay, how)  # killed mid-export: the half-written folder, under another name
        if found == "new":
            assert_complete_output(out, "wm")  # the swap happened: the new output, whole
        run_to_end(args, env)
        assert_complete_output(out, "wm")
        assert staging(work) == [] and sorted(p.name for p in work.iterdir()) == ["out"], (delay, how)
        return landed, found

    kinds = (signal.SIGINT, signal.SIGKILL)
    rng = random.Random(SEED + 1)
    points = with_export_points(schedule(reference[0], FORCE_POINTS, rng), EXPORT_POINTS["force"], rng, kinds)
    found = in_lanes(points, check_point)
    assert len(found) == FORCE_POINTS and tree_hashes(pair) == sources and tree_hashes(pristine) == old
    assert [where for where, _ in found].count("during the export") >= 1, found


def checkpoints(folder: Path) -> dict[str, str]:
    """{name: sha256} of the checkpoints in folder, each checked to load as one."""
    found = {}
    for path in sorted(folder.glob("*.pt")) if folder.exists() else []:
        state = torch.load(path, map_location="cpu", weights_only=True)
        assert state["format"] == CHECKPOINT_FORMAT and state["step"] >= 1, path.name
        found[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def test_interrupted_learned_run_resumes(pair, env, tmp_path):
    """--method dual with checkpoints, interrupted: every checkpoint written loads and stays as it was, and
    --resume (a fresh start when none was written yet) finishes with the transforms of an uninterrupted run."""
    sources = tree_hashes(pair)

    def args(out: Path, ckpt: Path, *extra) -> list:
        return merge_args(pair, out, "dual", "--steps", LEARNED_STEPS, "--checkpoint-every", CHECKPOINT_EVERY,
                          "--checkpoint-dir", ckpt, "--train-data", pair / "train.txt", "--learn-batch-size", "8",
                          "--eval-every", "0", "--lr", "1e-2", *extra)

    # the uninterrupted run: its duration, when its first checkpoint appears, and its transforms
    whole, whole_ckpt = tmp_path / "whole", tmp_path / "whole-ckpt"
    start = time.monotonic()
    proc = subprocess.Popen([*HF_REBASIN, *map(str, args(whole, whole_ckpt))], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first_checkpoint = None
    while proc.poll() is None:
        if first_checkpoint is None and any(whole_ckpt.glob("*.pt")):
            first_checkpoint = time.monotonic() - start
        time.sleep(0.02)
    duration = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    assert first_checkpoint is not None and len(checkpoints(whole_ckpt)) == LEARNED_STEPS // CHECKPOINT_EVERY
    expected = load_file(whole / "transforms.safetensors")

    def check_point(k: int, delay: float, how) -> bool:
        work = tmp_path / f"point{k}"
        work.mkdir()
        out, ckpt = work / "out", work / "ckpt"
        code, err, _ = interrupt(args(out, ckpt), env, delay, how, anchor=(lambda: any(ckpt.glob("*.pt")),
                                                                          first_checkpoint))
        assert tree_hashes(pair) == sources, (delay, how)
        written = checkpoints(ckpt)
        if how in (signal.SIGINT, signal.SIGTERM) and code == 128 + how and "saved" in err:  # the first Ctrl-C
            assert written, err  # (or SIGTERM) saves the step it finished
        if how == signal.SIGTERM and "stopping after this step" in err:  # it came while it trained
            assert code == 128 + how and "saved" in err and written, err
        if how == signal.SIGTERM and code == -how and delay >= first_checkpoint:  # sent once it trained: killed by
            assert out.exists(), err[-3000:]  # it only in Python's shutdown, once the command returned its output
        if out.exists():
            assert_complete_output(out, "dual")
        again = args(out, ckpt, *(["--resume", ckpt] if written else []), *(["--force"] if out.exists() else []))
        run_to_end(again, env)
        assert_complete_output(out, "dual")
        after = checkpoints(ckpt)
        assert {name: after.get(name) for name in written} == written, (delay, how)  # untouched
        assert not list(ckpt.glob("*.partial")), (delay, how)
        got = load_file(out / "transforms.safetensors")
        assert got.keys() == expected.keys() and all(torch.equal(got[key], expected[key]) for key in got), \
            (delay, how)  # resumed or restarted: the trajectory of the uninterrupted run, bit for bit
        assert staging(work) == [], (delay, how)
        return bool(written)

    # the moments: over training (from a little before the first checkpoint to the end), and Ctrl-C twice
    points = schedule(duration, LEARNED_POINTS, random.Random(SEED + 2), (signal.SIGINT, signal.SIGKILL,
                                                                          DOUBLE_SIGINT, signal.SIGTERM),
                      start=0.8 * first_checkpoint)
    resumed = in_lanes(points, check_point)
    assert tree_hashes(pair) == sources and any(resumed)


@pytest.fixture
def hub():
    with FakeHub(lifetime_s=240) as server:
        yield server


def test_interrupted_push(reference, hub, tmp_path):
    """push killed mid-run: the folder is unchanged (its card is replaced only once the upload succeeded, by the
    card that was published), and `push --exist-ok` afterwards succeeds."""
    from hf_rebasin.hub.push import publishable_report
    home = tmp_path / "hf_home"
    env = {**base_env(home), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN,
           "HF_HUB_CACHE": str(home / "hub"), "TRANSFORMERS_OFFLINE": "0"}
    baseline = tmp_path / "baseline" / "merged"
    shutil.copytree(reference[1], baseline)
    duration = run_to_end(["push", baseline, "someuser/reliable-baseline"], env)

    def check_point(k: int, delay: float, how) -> str:
        parent = tmp_path / f"point{k}"
        folder = parent / "merged"
        shutil.copytree(reference[1], folder)
        repo = f"someuser/reliable-{k}"
        before = tree_hashes(folder)
        interrupt(["push", folder, repo], env, delay, how)
        after = tree_hashes(folder)
        changed = {name for name in set(before) | set(after) if before.get(name) != after.get(name)}
        assert changed <= {"README.md", MANIFEST}, (delay, how, changed)  # the manifest records the card's size
        if changed:  # the upload went through: the folder's card is now the published one
            assert (folder / "README.md").read_bytes() == hub.files(repo)["README.md"], (delay, how)
        found = "pushed" if changed else ("created" if repo in hub.repos else "untouched")
        run_to_end(["push", folder, repo, "--exist-ok"], env)
        remote = hub.files(repo)
        local = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
                 if p.is_file() and p.name != MANIFEST}  # the folder's own record of its files is not pushed
        assert set(remote) == set(local) | {".gitattributes"}, (delay, how)
        assert all(remote[name] == content for name, content in local.items() if name != "barrier.json")
        assert remote["barrier.json"] == publishable_report(folder).encode()
        assert tree_hashes(folder).keys() == before.keys()
        assert sorted(p.name for p in parent.iterdir()) == ["merged"], (delay, how)  # no staging copy left
        return found

    found = in_lanes(schedule(duration, PUSH_POINTS, random.Random(SEED + 3)), check_point)
    assert len(found) == PUSH_POINTS


CTRL_C_IN_A_LIBRARY = """
import os, signal, sys, time
from hf_rebasin.cli import commands, main

def run_inspect(args):  # a library that turns the Ctrl-C it was interrupted by into another error
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        raise ImportError("initialization failed") from None

commands.run_inspect = run_inspect
sys.argv = ["hf-rebasin", "inspect", "some/model"]
code = main()
os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again while the command exits
time.sleep(0.5)
sys.exit(code)
"""


def test_ctrl_c_that_a_library_turns_into_another_exception(env):
    """A Ctrl-C that cuts short a C extension's import (Python reports "ImportError: initialization failed") or
    a tensor conversion (a ValueError) is still a Ctrl-C: exit code 130 and one line, no traceback; and a second
    Ctrl-C while the command exits changes nothing."""
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_A_LIBRARY], env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "hf-rebasin inspect: interrupted; nothing was left half-written", done.stderr


COMMAND_RUN_BY_AN_IMPORT = """
import pathlib, sys
folder = pathlib.Path(sys.argv[1])
(folder / "runs_the_command.py").write_text(  # a program whose import runs the command: that is no import to wait on
    "import os, pathlib, signal, sys, time\\n"
    "from hf_rebasin.cli import commands, main\\n"
    "folder = pathlib.Path(sys.argv[1])\\n"
    "def run_inspect(args):\\n"
    "    os.kill(os.getpid(), signal.SIGINT)\\n"
    "    time.sleep(5)\\n"
    "    (folder / 'ran_on').write_text('the Ctrl-C waited for the import that ran the command')\\n"
    "commands.run_inspect = run_inspect\\n"
    "sys.argv = ['hf-rebasin', 'inspect', 'some/model']\\n"
    "sys.exit(main())\\n")
sys.path.insert(0, str(folder))
import runs_the_command  # noqa: F401
"""


def test_ctrl_c_in_a_command_that_an_import_runs(env, tmp_path):
    """Only the imports the command starts hold a Ctrl-C back: a command run from inside an import (a program
    whose module body calls main()) stops at once."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", COMMAND_RUN_BY_AN_IMPORT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip() == "hf-rebasin inspect: interrupted; nothing was left half-written", done.stderr
    assert not (tmp_path / "ran_on").exists() and time.monotonic() - start < 5


def test_signals_while_sampling_self_data(pair, env, tmp_path):
    """SIGTERM, SIGHUP and Ctrl-C while `self` training data is being sampled (sent once its partial file is there,
    and a moment later): the one line, 128 + the signal, and no partial sample file (nor a sample file) left."""
    sources = tree_hashes(pair)

    def check_point(k: int, delay: float, how) -> None:
        work = tmp_path / f"point{k}"
        cache = work / "self-samples"
        args = merge_args(pair, work / "out", "dual", "--steps", "20000", "--learn-batch-size", "32", "--train-data",
                          "self", "--self-samples-dir", cache, "--checkpoint-dir", work / "ckpt")
        code, err, _ = interrupt(args, env, delay, how, anchor=(lambda: any(cache.glob(".self-*.partial")), 0.0))
        assert code == 128 + how, (delay, how, code, err[-3000:])  # sampling 10,000 windows outlasts the moment
        assert tree_hashes(pair) == sources, (delay, how)
        assert sorted(p.name for p in work.iterdir()) == ["self-samples"], (delay, how)  # no output, no checkpoint
        assert list(cache.iterdir()) == [], (delay, how)  # no .self-*.npy.ids.partial, no half a sample file

    points = [(0.0, signal.SIGTERM), (0.1, signal.SIGHUP), (0.05, signal.SIGINT)]
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:  # (run under nohup: the command inherits it ignored)
        points = [(delay, how) for delay, how in points if how != signal.SIGHUP]
    in_lanes(points, check_point)
