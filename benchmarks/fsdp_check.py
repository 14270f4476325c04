"""Data parallel against FSDP for learned matching, two CPU processes, on a real-size pair.

    .venv/bin/python benchmarks/fsdp_check.py [--config 70m] [--steps 10] [--work runs/fsdp]

Two random-init checkpoints with a published Pythia config (stored in fp16, benchmarks/merge_size.py), then the
same `hf-rebasin merge A B --method dual ...` three times: one process; two processes data parallel (DDP);
two processes with `--fsdp --gradient-checkpointing`, both under `ACCELERATE_USE_CPU=true accelerate launch
--multi_gpu --num_processes 2`.  Prints, per run, the endpoint bytes each process stores (barrier.json
`settings.endpoint_storage`), the main process's peak RSS, the matching time, the barrier, and the largest
difference of the learned transforms from the one-process run (the same trajectory: rounding only).  Training
text: the start of ../shared/data/tinyshakespeare.txt; evaluation: its end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from merge_size import SHARED, make_checkpoint  # noqa: E402

LAUNCH = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
          "--dynamo_backend", "no"]
LAYOUTS = {"one process": (None, []), "2 processes, DDP": (LAUNCH, []),
           "2 processes, FSDP + checkpointing": (LAUNCH, ["--fsdp", "--gradient-checkpointing"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="70m")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "fsdp")
    args = parser.parse_args()
    from safetensors.torch import load_file
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    a, b = (make_checkpoint(args.config, seed, work / f"pythia-{args.config}-{name}")
            for seed, name in ((0, "a"), (1, "b")))
    text = (SHARED / "tinyshakespeare.txt").read_text()
    (work / "train.txt").write_text(text[:200_000])
    (work / "heldout.txt").write_text(text[-100_000:])
    merge = ["merge", str(a), str(b), "--method", "dual", "--rounds", "1", "--data", str(work / "heldout.txt"),
             "--train-data", str(work / "train.txt"), "--seq-len", "128", "--learn-batch-size", "8", "--steps",
             str(args.steps), "--lr", "1e-3", "--eval-every", "0", "--holdout", "0", "--lambdas", "3",
             "--max-eval-tokens", "2048", "--force"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    rows, reference = [], None
    for k, (layout, (launch, extra)) in enumerate(LAYOUTS.items()):
        out = work / f"merged-{k}"
        prefix = ([str(REPO / ".venv" / "bin" / "accelerate"), "launch", *launch, "-m", "hf_rebasin.cli"] if launch
                  else [str(REPO / ".venv" / "bin" / "hf-rebasin")])
        run = subprocess.run([*prefix, *merge, *extra, "--out", str(out)], env=env, capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stderr[-3000:], file=sys.stderr)
            return 1
        report = json.loads((out / "barrier.json").read_text())
        settings = report["settings"]
        transforms = load_file(out / "transforms.safetensors")
        reference = reference or transforms
        difference = max(float((transforms[key].double() - value.double()).abs().max())
                         for key, value in reference.items())
        rows.append((layout, settings["endpoint_storage"], settings["peak_memory"]["GiB"],
                     report["timings"]["match_s"], report["barrier"], difference))
    print(f"| {args.config}, dual, {args.steps} steps of 8 × 128 | endpoint bytes per process / all | main process "
          "peak RSS GiB | match s (wm + learning) | barrier | max Δ transforms vs one process |")
    print("|---|---|---|---|---|---|")
    for layout, storage, peak, match_s, barrier, difference in rows:
        print(f"| {layout} | {storage['bytes_per_process'] / 2**20:.0f} / {storage['bytes_total'] / 2**20:.0f} MiB | "
              f"{peak:.2f} | {match_s:.0f} | {barrier:.4f} | {difference:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
