"""Ctrl-C at evenly spaced moments of one hf-rebasin command: how each run ended (0; 130 and its one line; killed
by SIGINT with no traceback, before main ran or while Python shut down after it), and the first lines of stderr of
every run that ended otherwise.
The tests send 3 to 8 random moments per command; this sweeps hundreds, to find a crash that is rare per moment.

    .venv/bin/python benchmarks/ctrl_c_sweep.py push --from 0.3 --to 3.0 --step 0.01
    .venv/bin/python benchmarks/ctrl_c_sweep.py merge --from 0.3 --to 6.0 --step 0.02

The scenarios are tests/interrupt_scenarios.py's: `push` uploads a tiny wm merge to the tests' fake Hub (a local
server); `merge` is that wm merge.  Each run has its own folders; moments run one after another (a run takes one
core).  To sweep another checkout of the package, put it first on PYTHONPATH."""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hub_server import TOKEN, FakeHub
from interrupt_scenarios import base_env, make_pair, merge_args

HF_REBASIN = [sys.executable, "-m", "hf_rebasin.cli"]


def run(args: list, env: dict, delay: float | None) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.Popen([*HF_REBASIN, *map(str, args)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if delay is not None:
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("push", "merge"))
    parser.add_argument("--from", dest="start", type=float, default=0.3, help="the first moment, s")
    parser.add_argument("--to", dest="stop", type=float, default=3.0, help="the last moment is before this, s")
    parser.add_argument("--step", type=float, default=0.01, help="s between moments")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ctrl-c-sweep-"))
    try:
        env = base_env(make_pair(root) / "hf_home")
        if args.command == "merge":
            return sweep(args, root, env)
        code, err, _ = run(merge_args(root, root / "reference", "wm"), env, None)  # the folder every push uploads
        assert code == 0, err[-3000:]
        with FakeHub(lifetime_s=24 * 3600) as hub:
            env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.endpoint, HF_TOKEN=TOKEN, TRANSFORMERS_OFFLINE="0")
            sweep(args, root, env)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def sweep(args, root: Path, env: dict) -> None:
    def command(k: int) -> list:
        work = root / f"point{k}"
        if args.command == "merge":
            return merge_args(root, work / "out", "wm")
        shutil.copytree(root / "reference", work / "merged")
        return ["push", str(work / "merged"), f"someuser/sweep-{k}"]

    code, err, whole = run(command(0), env, None)
    assert code == 0, err[-3000:]
    print(f"{args.command} uninterrupted: {whole:.2f} s", flush=True)
    moments = [args.start + k * args.step for k in range(int((args.stop - args.start) / args.step + 1e-9))]
    outcomes = collections.Counter()
    for k, delay in enumerate(moments, start=1):
        code, err, _ = run(command(k), env, delay)
        outcome = outcome_of(code, err)
        outcomes[outcome] += 1
        if outcome not in EXPECTED:
            print(f"at {delay:.3f} s: {outcome}\n" + "\n".join(err.splitlines()[:6]), flush=True)
        shutil.rmtree(root / f"point{k}", ignore_errors=True)
    unexpected = sum(n for outcome, n in outcomes.items() if outcome not in EXPECTED)
    print(f"{len(moments)} moments from {args.start} s to {args.stop} s: {dict(outcomes.most_common())}; "
          f"unexpected: {unexpected}")


INTERRUPTED_LINE = re.compile(r"hf-rebasin [a-z]+: interrupted; nothing was left half-written")
EXPECTED = ("done (0)", "interrupted (130, one line)", "killed by SIGINT, no traceback (-2)")


def outcome_of(code: int, err: str) -> str:
    """0; 130 with the one line; -SIGINT with no traceback (the Ctrl-C came before main ran, or after it returned,
    while Python shut down: the command's own lines may be there); anything else is unexpected."""
    lines = [line for line in err.splitlines() if line.strip()]
    if code == 0:
        return "done (0)"
    if code == 130:
        return "interrupted (130, one line)" if INTERRUPTED_LINE.fullmatch(lines[-1] if lines else "") else \
            "interrupted (130) with other output"
    if code == -signal.SIGINT:
        traceback = any(line.startswith("Traceback") or "KeyboardInterrupt" in line for line in lines)
        return "killed by SIGINT after a traceback (-2)" if traceback else "killed by SIGINT, no traceback (-2)"
    return f"exit code {code}"


if __name__ == "__main__":
    main()
