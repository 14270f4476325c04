"""Learned-matching settings compared on one pair: the test barrier, the match time and the held-out midpoint
loss (training examples kept out) and the barrier on a subset of the evaluation text (shown in the progress
bar) along the optimisation (to tell a run that plateaus from one that is cut short).

    .venv/bin/python benchmarks/dual_sweep.py --pair neox-stdlib-long --seq-len 128 \\
        --train-data runs/pairs/neox-stdlib-long/train.npy \\
        --config "--steps 300" --config "--steps 1000 --lr 1e-2" --config "--method wm" \\
        [--seeds 2,3 | --shared-init 1] [--freeze glu,qk,ov] [--lr-floor 0.1] [--json runs/dual_sweep.jsonl]

Each --config is a list of merge flags added to `--method dual` (or `--method lm ...`: a config may name its
method).  --train-data defaults to the pair's train split (a `hf-rebasin tokenize` file of it loads faster).
--freeze (an ablation) keeps the named parts of the continuous group at their weight-matching start: rotation,
qk / ov (the per-head maps), glu (the GLU scales).  --lr-floor (an ablation) sets where the cosine decay ends, as a
fraction of --lr (the package's 0.1; 1 is a constant rate after the warmup, 0 decays to nothing).
One JSON line per config is appended to --json and printed.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_config(pair: dict, config: list[str], seq_len: int | None, max_tokens: int, train_data: str | None) -> dict:
    from barrier_table import barrier_options, measure
    method = "dual"
    if "--method" in config:
        at = config.index("--method")
        method, config = config[at + 1], config[:at] + config[at + 2:]
    if train_data:
        pair = {**pair, "train_data": train_data}
    report, seconds = measure([pair["model_a"], pair["model_b"]],
                              barrier_options(pair, method, seq_len, max_tokens, config))
    log = report.get("match_log") or []
    curve = [(e["step"], round(e["holdout_midpoint_loss"], 4)) for e in log
             if "holdout_midpoint_loss" in e and "step" in e]
    barriers = [(e["step"], round(e["heldout_midpoint_barrier"], 4)) for e in log if "heldout_midpoint_barrier" in e]
    selected = next((e["selected_step"] for e in log if "selected_step" in e), None)
    return {"method": method, "config": " ".join(config), "barrier": report["barrier"],
            "match_s": report["timings"]["match_s"], "total_s": round(seconds, 1),
            "holdout_curve": curve, "eval_subset_barrier_curve": barriers,
            "selected_step": selected}


FROZEN_PARTS = ("rotation", "qk", "ov", "glu")


def freeze_parts(parts: list[str]) -> None:
    """From now on, every learned group element keeps `parts` at its start (requires_grad off: the optimiser
    skips them)."""
    from hf_rebasin.match import params

    unknown = sorted(set(parts) - set(FROZEN_PARTS))
    if unknown:
        raise SystemExit(f"--freeze: unknown part(s) {', '.join(unknown)}; choose from {', '.join(FROZEN_PARTS)}")
    build = params.SymmetryParams.__init__

    def build_frozen(self, *args, **kwargs):
        build(self, *args, **kwargs)
        for part in (getattr(self, name) for name in parts):
            for parameter in [] if part is None else part.parameters():
                parameter.requires_grad_(False)

    params.SymmetryParams.__init__ = build_frozen


def set_lr_floor(floor: float) -> None:
    """From now on, learned matching's cosine decays to `floor` x --lr instead of the package's floor."""
    from hf_rebasin.match import train_loop

    factor = train_loop.lr_factor
    train_loop.lr_factor = lambda step, steps, warmup: factor(step, steps, warmup, min_ratio=floor)


def main() -> None:
    import pairs
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="neox-stdlib-long")
    parser.add_argument("--config", action="append", required=True, help="merge flags of one run (quoted)")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--max-eval-tokens", type=int, default=65536)
    parser.add_argument("--train-data", help="instead of the pair's train split")
    parser.add_argument("--seeds", help="A,B: two further models of the pair's recipe instead of the cached pair")
    parser.add_argument("--shared-init", type=int, metavar="DATA_SEED",
                        help="model A and a model of A's initialisation trained on another data order "
                             "(pairs.shared_init_model), instead of the cached pair")
    parser.add_argument("--freeze", default="", help=f"comma-separated parts kept at their start: {FROZEN_PARTS}")
    parser.add_argument("--lr-floor", type=float, help="end of the cosine decay as a fraction of --lr")
    parser.add_argument("--json", default="runs/dual_sweep.jsonl", help="JSON lines appended here")
    args = parser.parse_args()
    frozen = [part for part in args.freeze.split(",") if part]
    if frozen:
        freeze_parts(frozen)
    if args.lr_floor is not None:
        set_lr_floor(args.lr_floor)
    pair = pairs.get_pair(args.pair)
    name = args.pair
    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
        model_a, model_b = pairs.extra_models(args.pair, seeds)
        pair, name = {**pair, "model_a": model_a, "model_b": model_b}, f"{args.pair} (seeds {args.seeds})"
    if args.shared_init is not None:
        pair = {**pair, "model_b": pairs.shared_init_model(args.pair, args.shared_init)}
        name = f"{args.pair} (shared initialisation, data order {args.shared_init})"
    out = pairs.resolve_cache(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for config in args.config:
        start = time.strftime("%Y-%m-%d %H:%M")
        result = run_config(pair, config.split(), args.seq_len, args.max_eval_tokens, args.train_data)
        row = {"pair": name, "started": start, **({"frozen": frozen} if frozen else {}),
               **({"lr_floor": args.lr_floor} if args.lr_floor is not None else {}), **result}
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
