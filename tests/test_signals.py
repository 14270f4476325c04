"""Issue 48: progress in logs (a line per stage every HF_REBASIN_PROGRESS_EVERY seconds off a terminal), timed
checkpoints of learned runs, a signal held back during an import said at once, and a long learned run under
nohup-like conditions (output to a file, SIGHUP ignored): progress before it ends, and SIGTERM stops it with a
checkpoint and exit code 143.  The fault injection of SIGTERM and SIGHUP is in test_reliability.py."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import HF_REBASIN
from interrupt_scenarios import base_env, make_pair, merge_args

from hf_rebasin import progress
from hf_rebasin.match.train_loop import CHECKPOINT_FORMAT, TimedCheckpoints
from hf_rebasin.signals import Stopped, exit_code, interruption, is_interrupted

RUN_TIMEOUT_S = 240


def stage_lines(capsys, every: str, monkeypatch, steps: int = 6, pause_s: float = 0.02) -> list[str]:
    monkeypatch.setenv(progress.EVERY_VARIABLE, every)
    bar = progress.tqdm(total=steps, desc="dual matching", unit="step")
    for _ in range(steps):
        time.sleep(pause_s)
        bar.set_postfix(loss="2.5000")
        bar.update(1)
    bar.close()
    return capsys.readouterr().err.splitlines()


def test_a_stage_off_a_terminal_prints_a_line_every_n_seconds(capsys, monkeypatch):
    lines = stage_lines(capsys, "0.01", monkeypatch)
    running, last = lines[:-1], lines[-1]
    assert len(running) >= 3, lines  # one line per update here: each is 20 ms after the one before
    for line in running:
        assert re.fullmatch(r"dual matching: \d/6 steps \(\d+%\), [\d.]+ steps/s, \d+ s left \(loss=2\.5000\)",
                            line), line
    assert re.fullmatch(r"dual matching: 6/6 steps in \d+\.\d s \(loss=2\.5000\)", last), last
    assert lines == [line for line in lines if "\r" not in line]


@pytest.mark.parametrize("every", ["0", "30", "not a number"])
def test_a_stage_shorter_than_the_interval_prints_one_line(capsys, monkeypatch, every):
    lines = stage_lines(capsys, every, monkeypatch)
    assert len(lines) == 1 and lines[0].startswith("dual matching: 6/6 steps in "), lines


def test_a_stage_can_say_how_it_ended(capsys, monkeypatch):
    monkeypatch.setenv(progress.EVERY_VARIABLE, "0")
    bar = progress.tqdm(total=40, desc="weight matching")
    bar.update(16)
    progress.conclude(bar, "converged after 4 rounds (at most 10)")
    assert re.fullmatch(r"weight matching: converged after 4 rounds \(at most 10\) in \d+\.\d s\n",
                        capsys.readouterr().err)


def test_durations_read_as_time_left():
    assert [progress.duration(s) for s in (0.4, 59, 245, 6060)] == ["0 s", "59 s", "4m05s", "1h41m"]


def test_signals_map_to_their_exit_codes():
    assert type(interruption(signal.SIGINT)) is KeyboardInterrupt
    stopped = interruption(signal.SIGTERM)
    assert isinstance(stopped, Stopped) and isinstance(stopped, KeyboardInterrupt) and stopped.signum == 15
    assert (exit_code(signal.SIGINT), exit_code(signal.SIGTERM), exit_code(signal.SIGHUP)) == (130, 143, 129)
    assert all(map(is_interrupted, (130, 143, 129, -2, -15))) and not any(map(is_interrupted, (0, 1, 2, 137)))


def test_timed_checkpoints_keep_the_newest(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    timed = TimedCheckpoints(minutes=10)
    assert not timed.due()
    clock[0] += 599
    assert not timed.due()
    clock[0] += 1
    assert timed.due()
    first, second, kept = (tmp_path / name for name in ("a.pt", "b.pt", "every-k.pt"))
    for path in (first, second, kept):
        path.write_bytes(b"x")
    timed.saved(first, replace=True)
    assert not timed.due()
    timed.saved(kept, replace=False)  # a --checkpoint-every one: kept, and the timed one before it too
    timed.saved(second, replace=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.pt", "every-k.pt"]
    assert not TimedCheckpoints(minutes=0).due()


# --- a signal held back during an import ----------------------------------------------------------------

CTRL_C_DURING_AN_IMPORT = """
import os, pathlib, signal, sys, time
from hf_rebasin.cli import commands, main
folder = pathlib.Path(sys.argv[1])
(folder / "slow_extension.py").write_text(  # Ctrl-C early in a module's body, the module goes on for 1.5 s
    "import os, pathlib, signal, time\\n"
    f"os.kill(os.getpid(), signal.{sys.argv[2]})\\n"
    "time.sleep(1.5)\\n"
    "pathlib.Path(__file__).with_name('imported').write_text('whole')\\n")
sys.path.insert(0, str(folder))

def run_inspect(args):
    import slow_extension  # noqa: F401
    time.sleep(5)  # the Ctrl-C arrives here, a moment after the import
    (folder / "ran_on").write_text("the command went on after the import")

commands.run_inspect = run_inspect
sys.argv = ["hf-rebasin", "inspect", "some/model"]
sys.exit(main())
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_never_cuts_an_import_short(tmp_path, signum):
    """A Ctrl-C (or SIGTERM) inside an import is raised once the import has returned: a C extension's
    initialization may call Python code that no exception may leave (torch's `import torch.distributed`: SIGABRT
    and a core dump instead of exit code 130).  A line says so at once (issue 48: importing torch and transformers
    held a Ctrl-C 4-7 s without a word); the module is imported whole, the command stops a moment after it."""
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_DURING_AN_IMPORT, str(tmp_path), signum.name],
                            env=base_env(tmp_path / "hf_home"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stderr.readline()
    still_importing = not (tmp_path / "imported").exists()
    rest = proc.communicate(timeout=RUN_TIMEOUT_S)[1]
    assert proc.returncode == 128 + signum, first + rest
    what = "interrupted" if signum == signal.SIGINT else "SIGTERM received"
    assert first == f"hf-rebasin: {what}; stopping as soon as the import in progress has finished\n", first + rest
    assert still_importing, "the line came only when the import had finished"
    by = "" if signum == signal.SIGINT else " by SIGTERM"
    assert rest.strip() == f"hf-rebasin inspect: interrupted{by}; nothing was left half-written", rest
    assert (tmp_path / "imported").read_text() == "whole"
    assert not (tmp_path / "ran_on").exists() and time.monotonic() - start < 6


# --- a long learned run under nohup -------------------------------------------------------------------

def ignore_sighup() -> None:  # what nohup does before it runs the command
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def wait_for(seen, proc, timeout_s: float = RUN_TIMEOUT_S) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        if seen():
            return True
        time.sleep(0.05)
    return seen()


def test_a_long_learned_run_under_nohup_shows_progress_and_stops_on_sigterm_with_a_checkpoint(tmp_path):
    """Output to a file and SIGHUP ignored, as under `nohup ... > log 2>&1 &`: progress lines come while it trains
    (before, nothing came until the stage ended), the hang-up is ignored, and SIGTERM (what slurm or `timeout`
    sends) stops it after the step in progress with a checkpoint, one line and exit code 143."""
    pair = make_pair(tmp_path / "sources")
    env = {**base_env(tmp_path / "hf_home"), progress.EVERY_VARIABLE: "0.5"}
    ckpt, log = tmp_path / "ckpt", tmp_path / "nohup.out"

    def args(*extra) -> list:
        return merge_args(pair, tmp_path / "out", "dual", "--steps", "100000", "--train-data", pair / "train.txt",
                          "--learn-batch-size", "8", "--eval-every", "0", "--checkpoint-dir", ckpt, *extra)

    def progress_lines() -> list[str]:
        return re.findall(r"^dual matching: \d+/100000 steps \(\d+%\), .* left.*$", log.read_text(), re.MULTILINE)

    with open(log, "w") as out:
        proc = subprocess.Popen([*HF_REBASIN, *map(str, args())], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=ignore_sighup)
    try:
        assert wait_for(lambda: len(progress_lines()) >= 1, proc), log.read_text()[-3000:]
        proc.send_signal(signal.SIGHUP)  # ignored, as nohup means
        seen = len(progress_lines())
        assert wait_for(lambda: len(progress_lines()) > seen + 1, proc), log.read_text()[-3000:]
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 143, text[-3000:]
    lines = text.strip().splitlines()
    assert lines[-1] == "hf-rebasin merge: interrupted by SIGTERM; nothing was left half-written", text[-3000:]
    assert "hf-rebasin: SIGTERM: stopping after this step and saving a checkpoint" in text
    (saved,) = ckpt.glob("*.pt")
    state = torch.load(saved, map_location="cpu", weights_only=True)
    assert state["format"] == CHECKPOINT_FORMAT and state["step"] >= 1
    assert f"saved {saved} after step {state['step']}/100000; continue with --resume {saved}" in text
    assert not (tmp_path / "out").exists() and not list(ckpt.glob("*.partial"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "nohup.out", "sources"]  # no staging left


def test_the_checkpoint_cadence_is_no_trajectory_setting():
    """A run resumed with another --checkpoint-minutes follows the same trajectory: it is not checked on --resume."""
    from hf_rebasin.match.learned import trajectory_settings
    from hf_rebasin.options import MergeOptions
    a, b = (trajectory_settings(MergeOptions(method="dual", checkpoint_minutes=m), 2, "causal-lm") for m in (10, 1))
    assert a == b
