"""What one learned-matching step asks of a GPU, counted on the CPU under CUDA's rules (hf_rebasin/match/cuda_rules.py).

    .venv/bin/python benchmarks/cuda_step_counts.py                 # Pythia-70M shape, batch 2 x 64
    .venv/bin/python benchmarks/cuda_step_counts.py --config 160m --json counts.json

Two random-init checkpoints with the published Pythia config (merge_size.py), canonicalised by the library; then
one step of lm and dual (the whole-model loss and the layer-by-layer one with checkpointing, bf16 autocast and
fp32; dual whole also with --soft-targets 1, the default on `self` text) on simulated CUDA: forward and fused
AdamW on fake CUDA tensors under CUDA's autocast, backward on the meta twin.  Printed per row: aten ops and
launches (ops that are not views), host syncs in this project's code and in the model's own forward
(transformers), host-to-device copies and float64 ops; and the same counts for a plain training step of one model
(forward, backward, fused AdamW over all its weights), the yardstick of the ratio.
Counts do not depend on the batch size (the same ops on larger tensors).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from merge_size import PYTHIA, make_checkpoint  # noqa: E402

from hf_rebasin.match.cuda_rules import check_plain_step, check_step  # noqa: E402
from hf_rebasin.sources import models  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="70m", choices=list(PYTHIA))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folders = [make_checkpoint(args.config, seed, Path(tmp) / f"seed{seed}", tokenizer=False) for seed in (1, 2)]
        template = models.load(folders[0])
        graphs = [models.canonicalise(models.load(f)).materialise() for f in folders]
        rows = []
        for precision in ("bf16", "fp32"):
            plain = check_plain_step(template, precision=precision, batch=args.batch, seq=args.seq).total
            rows.append({"step": "plain f+b+AdamW", "precision": precision, **plain.summary()})
            for method, layered, soft in (("lm", False, 0.0), ("lm", True, 0.0), ("dual", False, 0.0),
                                          ("dual", True, 0.0), ("dual", False, 1.0)):
                report = check_step(template, graphs, method=method, layered=layered, precision=precision,
                                    batch=args.batch, seq=args.seq, soft_targets=soft)
                total = report.total
                name = f"{method} {'layered' if layered else 'whole'}{' + soft targets' if soft else ''}"
                rows.append({"step": name, "precision": precision, **total.summary(),
                             "ops_ratio": total.ops / plain.ops, "launch_ratio": total.launches / plain.launches})
    print(f"Pythia-{args.config} shape, {args.batch} x {args.seq} tokens\n")
    print("| step | precision | aten ops | launches | × plain ops | × plain launches | host syncs (ours / model) "
          "| host→device | float64 ops |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['ops_ratio']:.2f}" if "ops_ratio" in r else "1"
        launch = f"{r['launch_ratio']:.2f}" if "launch_ratio" in r else "1"
        print(f"| {r['step']} | {r['precision']} | {r['aten_ops']} | {r['launches']} | {ratio} | {launch} | "
              f"{r['host_syncs']} / {r['model_host_syncs']} | {r['host_to_device']} | {r['float64_ops']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
