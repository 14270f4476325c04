"""Ctrl-C (or --signal TERM / HUP) at evenly spaced moments of one hf-rebasin command: how each run ended (0; 130
-- 143, 129 -- and its one line; killed by the signal with no traceback, before main ran or while Python shut down
after it), and the first lines of stderr of every run that ended otherwise; a run that left a staging folder or a
partial file beside its output counts as "left something half-written" whatever its exit code.
The tests send 3 to 9 random moments per command; this sweeps hundreds, to find a crash that is rare per moment.

    .venv/bin/python benchmarks/ctrl_c_sweep.py push --from 0.3 --to 3.0 --step 0.01
    .venv/bin/python benchmarks/ctrl_c_sweep.py merge --from 0.3 --to 6.0 --step 0.02
    .venv/bin/python benchmarks/ctrl_c_sweep.py merge --signal TERM --from 0.5 --to 12 --step 0.5

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

from hf_rebasin.export.io import STAGING_TAG

HF_REBASIN = [sys.executable, "-m", "hf_rebasin.cli"]


def run(args: list, env: dict, delay: float | None, signum: int = signal.SIGINT) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.Popen([*HF_REBASIN, *map(str, args)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if delay is not None:
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signum)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("push", "merge"))
    parser.add_argument("--from", dest="start", type=float, default=0.3, help="the first moment, s")
    parser.add_argument("--to", dest="stop", type=float, default=3.0, help="the last moment is before this, s")
    parser.add_argument("--step", type=float, default=0.01, help="s between moments")
    parser.add_argument("--signal", choices=("INT", "TERM", "HUP"), default="INT",
                        help="the signal sent: INT (Ctrl-C), TERM (timeout, slurm, docker stop), HUP (hang-up)")
    args = parser.parse_args()
    args.signum = signal.Signals[f"SIG{args.signal}"]
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
    print(f"{args.command} uninterrupted: {whole:.2f} s; sending SIG{args.signal}", flush=True)
    moments = [args.start + k * args.step for k in range(int((args.stop - args.start) / args.step + 1e-9))]
    outcomes = collections.Counter()
    for k, delay in enumerate(moments, start=1):
        code, err, _ = run(command(k), env, delay, args.signum)
        outcome = outcome_of(code, err, args.signum)
        if half_written(root / f"point{k}"):
            outcome = "left something half-written"
        outcomes[outcome] += 1
        if outcome not in expected(args.signum):
            print(f"at {delay:.3f} s: {outcome}\n" + "\n".join(err.splitlines()[:6]), flush=True)
        shutil.rmtree(root / f"point{k}", ignore_errors=True)
    unexpected = sum(n for outcome, n in outcomes.items() if outcome not in expected(args.signum))
    print(f"{len(moments)} moments from {args.start} s to {args.stop} s: {dict(outcomes.most_common())}; "
          f"unexpected: {unexpected}")


def expected(signum: int) -> tuple[str, ...]:
    name = signal.Signals(signum).name
    return ("done (0)", f"interrupted ({128 + signum}, one line)", f"killed by {name}, no traceback (-{signum})")


def half_written(work: Path) -> bool:
    """Whether a staging folder or a partial file is left in the run's folders."""
    return work.exists() and any(STAGING_TAG in p.name or p.name.endswith((".partial", ".tmp"))
                                 for p in work.rglob("*"))


def outcome_of(code: int, err: str, signum: int = signal.SIGINT) -> str:
    """0; 128 + signum with the one line; -signum with no traceback (the signal came before main ran, or after it
    returned, while Python shut down: the command's own lines may be there); anything else is unexpected."""
    lines = [line for line in err.splitlines() if line.strip()]
    name = signal.Signals(signum).name
    by = "" if signum == signal.SIGINT else f" by {name}"
    if code == 0:
        return "done (0)"
    if code == 128 + signum:
        line = re.compile(rf"hf-rebasin( [a-z]+)?: interrupted{by}; nothing was left half-written")
        return f"interrupted ({code}, one line)" if line.fullmatch(lines[-1] if lines else "") else \
            f"interrupted ({code}) with other output"
    if code == -signum:
        traceback = any(line.startswith("Traceback") or "KeyboardInterrupt" in line for line in lines)
        return f"killed by {name} after a traceback (-{signum})" if traceback else \
            f"killed by {name}, no traceback (-{signum})"
    return f"exit code {code}"


if __name__ == "__main__":
    main()
