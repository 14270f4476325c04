"""What the training loop itself asks of a GPU per step, counted on the CPU under CUDA's rules
(hf_rebasin/match/cuda_loop.py).

    .venv/bin/python benchmarks/cuda_loop_counts.py                 # Pythia-70M shape, batch 2 x 64
    .venv/bin/python benchmarks/cuda_loop_counts.py --config 160m --json counts.json

Two random-init checkpoints with the published Pythia config (merge_size.py), canonicalised by the library; then
train_transforms, the project's own loop, runs the first 2 steps of a 200-step run (the losses are read every 2 steps)
of lm and dual (whole-model and layer by layer with checkpointing, bf16 autocast and fp32; and dual with soft targets)
on simulated CUDA, the backward included, with a stub accelerator.  Printed per step: host syncs and where they are
(the loss read: the losses of the steps since the last read and the Ctrl-C flag, one transfer that fake tensors read
value by value), fused AdamW launches, launches (aten ops that are not views) of the step and of its backward,
launches with bf16 operands in the forward and the backward, host-to-device copies and float64 ops.  Every step is
checked as it ends (cuda_loop.check_counts): the script fails on a sync outside the read, a non-fused AdamW or a
float64 op.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from merge_size import PYTHIA, make_checkpoint  # noqa: E402

from hf_rebasin.match.cuda_loop import run_loop  # noqa: E402
from hf_rebasin.match.cuda_rules import _path_loss  # noqa: E402
from hf_rebasin.sources import models  # noqa: E402
from hf_rebasin.sources.eval_data import EvalData  # noqa: E402

CONFIGS = [(method, layered, precision, 0.0) for method in ("lm", "dual") for layered in (False, True)
           for precision in ("bf16", "fp32")] + [("dual", False, "bf16", 1.0), ("dual", True, "bf16", 1.0)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="70m", choices=list(PYTHIA))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = [make_checkpoint(args.config, seed, Path(tmp) / f"seed{seed}", tokenizer=False) for seed in (1, 2)]
        template = models.load(folders[0])
        graphs = [models.canonicalise(models.load(f)).materialise() for f in folders]
        windows = torch.randint(0, template.spec.n_out, (8 * args.batch, args.seq),
                                generator=torch.Generator().manual_seed(0))
        train = EvalData(template.task, windows, None, {})
        for method, layered, precision, soft in CONFIGS:
            dtype = torch.bfloat16 if precision == "bf16" else None
            path_loss = _path_loss(template, graphs, method, layered, dtype, "absorbed", soft_targets=soft)
            for step in run_loop(path_loss, train, method=method, batch=args.batch):
                rows.append({"loop": f"{method} {'layered' if layered else 'whole'}{' soft' if soft else ''}",
                             "precision": precision, **step.summary()})
    print(f"Pythia-{args.config} shape, {args.batch} x {args.seq} tokens, steps 1-2 of a 200-step run\n")
    print("| loop | precision | step | host syncs (where) | fused AdamW | launches | backward launches "
          "| bf16 launches fwd / bwd | host→device | float64 ops |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        where = ", ".join(f"{site} ×{n}" for site, n in r["sync_sites"].items())
        bf16 = r["bf16_launches"]
        print(f"| {r['loop']} | {r['precision']} | {r['step']} | {r['host_syncs']}{f' ({where})' if where else ''} | "
              f"{r['fused_adamw']} | {r['launches']} | {r['backward_launches']} | {bf16.get('forward', 0)} / "
              f"{bf16.get('backward', 0)} | {r['host_to_device']} | {r['float64_ops']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
