"""How long the command line takes to refuse bad input that needs no weights: misspelt names with the Hub
unreachable or offline, and config-level problems (architecture or tokenizer mismatch, a corrupt tokenizer,
empty data, a corrupt safetensors header), plus `inspect`.  Each case is run as a subprocess, the median of
--repeats runs is printed (wall clock, and the CPU time of the process, which a busy machine inflates less) with
the exit code and the number of stderr lines.

    .venv/bin/python benchmarks/refusal_times.py --repeats 3 --before /tmp/old-checkout

"The Hub unreachable" is HF_ENDPOINT on a closed port of 127.0.0.1 (nothing listens there), with an empty Hub
cache.  The fixtures (a tiny LLaMA, edited copies of the bundled example pair, a merge output for `eval`) are made
in a temporary folder.  --before: another checkout of the package (e.g. `git archive` of an earlier commit),
timed case by case beside this one, so that both see the same machine load."""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

HF_REBASIN = [sys.executable, "-m", "hf_rebasin.cli"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fixtures(root: Path) -> dict[str, Path]:
    from hf_rebasin import tiny
    from hf_rebasin.assets import example_pair
    pair = example_pair()
    paths = {"A": pair / "model-a", "B": pair / "model-b", "heldout": pair / "heldout.txt"}
    paths["llama"] = tiny.make_tiny("llama_gqa_tied", root / "llama")
    for name in ("bad-tok", "other-tok", "bad-weights"):
        shutil.copytree(pair / "model-b", root / name)
        paths[name] = root / name
    (root / "bad-tok" / "tokenizer.json").write_text('{"broken": ')
    tok = json.loads((pair / "model-b" / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = list(vocab)[1:3]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (root / "other-tok" / "tokenizer.json").write_text(json.dumps(tok))
    (root / "bad-weights" / "model.safetensors").write_bytes(b"\xff" * 64)
    (root / "empty.txt").write_text("")
    paths["empty"] = root / "empty.txt"
    from hub_server import write_merge_output
    paths["merged"] = Path(shutil.copytree(pair / "model-a", root / "merged"))
    write_merge_output(paths["merged"])
    return paths


def cases(p: dict[str, Path], root: Path) -> dict[str, tuple[list, dict]]:
    data = ["--data", p["heldout"], "--seq-len", "128", "--max-eval-tokens", "1024", "--lambdas", "3"]
    closed = {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HOME": str(root / "hf-home")}
    offline = {"HF_HUB_OFFLINE": "1"}
    return {
        "misspelt name, Hub unreachable": (["merge", "model-a", p["B"], *data, "--out", "x"], closed),
        "misspelt name, HF_HUB_OFFLINE=1": (["merge", "model-a", p["B"], *data, "--out", "x"], offline),
        "default --data, Hub unreachable": (["barrier", p["A"], p["B"], "--seq-len", "128", "--lambdas", "3"], closed),
        "run pythia-1b --dry-run, Hub unreachable": (["run", "pythia-1b", "--dry-run"], closed),
        "eval --tasks piqa, Hub unreachable": (["eval", p["merged"], "--tasks", "piqa"], closed),
        "architecture mismatch": (["barrier", p["A"], p["llama"], *data], {}),
        "tokenizer mismatch": (["barrier", p["A"], p["other-tok"], *data], {}),
        "corrupt tokenizer.json in B": (["barrier", p["A"], p["bad-tok"], *data], {}),
        "empty --data": (["barrier", p["A"], p["B"], *data[:-6], "--data", p["empty"]], {}),
        "corrupt safetensors header in B": (["barrier", p["A"], p["bad-weights"], *data], {}),
        "inspect": (["inspect", p["A"]], {}),
    }


def time_case(args: list, env: dict, cwd: Path, repeats: int) -> tuple[float, float, int, int, str]:
    """(median wall seconds, median CPU seconds of the process, exit code, stderr lines, last stderr line)."""
    seconds, cpu, code, lines, last = [], [], 0, 0, ""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")} | env
    for _ in range(repeats):
        start, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run([*HF_REBASIN, *map(str, args)], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=300)
        seconds.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime)
        code, lines = proc.returncode, len(proc.stderr.splitlines())
        last = (proc.stderr.strip().splitlines() or [""])[-1]
    return statistics.median(seconds), statistics.median(cpu), code, lines, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="+", help="run the cases whose name contains one of these")
    parser.add_argument("--before", type=Path, help="another checkout, timed beside this one case by case")
    args = parser.parse_args()
    checkouts = {"now": {}} if args.before is None else {
        "before": {"PYTHONPATH": str(args.before.resolve())}, "now": {}}
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "cwd").mkdir()
        for name, (argv, env) in cases(fixtures(root), root).items():
            if args.only and not any(part in name for part in args.only):
                continue
            for label, extra in checkouts.items():
                wall, cpu, code, lines, last = time_case(argv, {**env, **extra}, root / "cwd", args.repeats)
                print(f"{name:<42} {label:<6} {wall:6.2f} s (cpu {cpu:5.2f} s)  exit {code}  {lines} stderr line(s)  "
                      f"| {last[:100]}", flush=True)


if __name__ == "__main__":
    main()
