"""Controls of `merge --refine-steps` (issue 47): the endpoints' ensemble distilled, with one budget, one data set
and one evaluation, into (a) endpoint A alone, (b) the raw average of the checkpoints, (c) the weight-matching
midpoint, (d) the dual midpoint; the ensemble itself is the ceiling.  The aligned start is worth its cost only
where (c) or (d) beats (a) and (b) at equal budget.

    OMP_NUM_THREADS=2 nice .venv/bin/python benchmarks/refine_controls.py [--pair FOLDER] [--steps 150]

--pair: a folder with model-a/ and model-b/ and either val.txt and test.txt (benchmarks/pairs.py) or one
heldout.txt, split in halves by document (the first half validates, the second tests; the bundled example pair,
the default).  Training data: `self` samples of the two models (the default of the learned methods and of the
refinement), sized for the largest budget and shared by every run.  The learning rate is chosen on validation, on
the wm start at the smallest budget, among --lrs; every start then trains with it.  Test figures are read once, for
the final models.  Costs: seconds per refinement step and per dual (learned-matching) step, same batch, same host.
Writes runs/refine-controls/<pair>.json and prints the table for BENCHMARKS.md.  `--plans` alone prints the memory
plan's estimated peak of a dual step and of a refinement step at Pythia configs instead."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hf_rebasin.assets import example_pair  # noqa: E402
from hf_rebasin.core.canonical import interpolate  # noqa: E402
from hf_rebasin.core.symmetry import apply  # noqa: E402
from hf_rebasin.evaluation.barrier import evaluate  # noqa: E402
from hf_rebasin.evaluation.refined import Ensemble  # noqa: E402
from hf_rebasin.match import METHODS, MatchContext  # noqa: E402
from hf_rebasin.match.refine import refine  # noqa: E402
from hf_rebasin.match.weight import weight_matching  # noqa: E402
from hf_rebasin.options import MergeOptions  # noqa: E402
from hf_rebasin.run_data import endpoint_loader, self_samples  # noqa: E402
from hf_rebasin.sources import models  # noqa: E402
from hf_rebasin.sources.eval_data import load_eval_data  # noqa: E402
from hf_rebasin.sources.splits import split_in_halves  # noqa: E402


def held_out(pair: Path, template, seq_len: int, max_tokens: int):
    """(validation, test) token windows."""
    def read(name):
        return load_eval_data(str(pair / name), template, seq_len=seq_len, max_tokens=max_tokens, max_examples=None)
    if (pair / "val.txt").is_file() and (pair / "test.txt").is_file():
        return read("val.txt"), read("test.txt")
    val, test, _ = split_in_halves(read("heldout.txt"), template, 0)
    return val, test


def starts(graphs, loaded, samples, val, options, progress) -> tuple[dict, dict]:
    """({start: the point refined}, {start: seconds its matching took})."""
    seconds = {}
    t = time.perf_counter()
    wm = weight_matching(*graphs, progress=False)
    seconds["wm"] = time.perf_counter() - t
    dual_options = dataclasses.replace(options, method="dual", steps=options.steps)
    t = time.perf_counter()
    dual = METHODS["dual"].run(graphs, MatchContext(dual_options, template=loaded[0], train_data=samples,
                                                    eval_data=val, progress=progress))
    seconds["dual"] = time.perf_counter() - t

    def midpoint(transforms):
        return interpolate([g if t.is_identity() else apply(g, t) for g, t in zip(graphs, transforms)], [0.5, 0.5])
    raw = interpolate([models.PlainAverage(models.canonicalise(m)) for m in loaded], [0.5, 0.5])
    return {"A alone": graphs[0], "raw average": raw,
            "wm midpoint": midpoint(wm.transforms), "dual midpoint": midpoint(dual.transforms)}, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default=None, help="folder with model-a, model-b (default: the example pair)")
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 400], help="refinement budgets")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    parser.add_argument("--batch", type=int, default=16, help="windows per step (refinement and dual)")
    parser.add_argument("--dual-steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-eval-tokens", type=int, default=32768)
    parser.add_argument("--out", default="runs/refine-controls")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args()
    pair = Path(args.pair) if args.pair else example_pair()
    loaded = [models.load(pair / "model-a"), models.load(pair / "model-b")]
    for model, name in zip(loaded, ("A", "B")):
        model.source = name
    template = loaded[0]
    graphs = [models.canonicalise(m).materialise() for m in loaded]
    val, test = held_out(pair, template, args.seq_len, args.max_eval_tokens)
    budget = max(max(args.steps), args.dual_steps)
    options = MergeOptions(method="dual", steps=budget, learn_batch_size=args.batch, seq_len=args.seq_len,
                           eval_every=50, device="cpu", self_samples_dir=str(REPO / "runs" / "self-samples"),
                           checkpoint_minutes=0, checkpoint_dir=str(REPO / "runs" / "refine-controls" / "ckpt"))
    timings = {}
    samples = self_samples(loaded, template, options, args.progress, timings)
    options = dataclasses.replace(options, steps=args.dual_steps)
    points, match_s = starts(graphs, loaded, samples, val, options, args.progress)

    load = endpoint_loader(loaded, "cpu", None)
    ends = [load(k).eval() for k in range(2)]
    result = {"pair": str(pair), "batch": args.batch, "seq_len": args.seq_len, "self_samples": samples.info["tokens"],
              "val_windows": len(val.inputs), "test_windows": len(test.inputs), "match_s": match_s,
              "dual_steps": args.dual_steps, "dual_s_per_step": match_s["dual"] / args.dual_steps,
              "endpoints": {name: {"val": evaluate(m, val)["loss"], "test": evaluate(m, test)["loss"]}
                            for name, m in zip("AB", ends)},
              "ensemble": {"val": evaluate(Ensemble(ends, [0.5, 0.5], "causal-lm"), val)["loss"],
                           "test": evaluate(Ensemble(ends, [0.5, 0.5], "causal-lm"), test)["loss"]},
              "unrefined": {}, "lr_choice": {}, "refined": {}}
    for name, point in points.items():
        model = models.instantiate(point, template)
        result["unrefined"][name] = {"val": evaluate(model, val)["loss"], "test": evaluate(model, test)["loss"]}

    def run(point, steps: int, lr: float):
        own = dataclasses.replace(options, refine_steps=steps, refine_lr=lr)
        return refine(point, template, load, 2, [0.5, 0.5], samples, val, own, progress=args.progress)

    smallest, tried = min(args.steps), {}
    for lr in args.lrs:  # the learning rate, on validation, on the wm start
        tried[lr] = run(points["wm midpoint"], smallest, lr)
        result["lr_choice"][str(lr)] = evaluate(tried[lr][0], val)["loss"]
        print(f"lr {lr:g}: wm start, {smallest} steps: val {result['lr_choice'][str(lr)]:.4f}", flush=True)
    lr = float(min(result["lr_choice"], key=result["lr_choice"].get))
    result["lr"] = lr
    for steps in args.steps:
        for name, point in points.items():
            same = name == "wm midpoint" and steps == smallest  # the choice's own run: the same run again
            model, record = tried[lr] if same else run(point, steps, lr)
            result["refined"].setdefault(str(steps), {})[name] = {
                "val": evaluate(model, val)["loss"], "test": evaluate(model, test)["loss"],
                "s_per_step": record["train_s"] / steps, "selected_step": next(
                    (e["selected_step"] for e in record["log"] if "selected_step" in e), None)}
            print(f"{steps} steps from {name}: test {result['refined'][str(steps)][name]['test']:.4f}", flush=True)
    out = REPO / args.out / f"{pair.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


def print_table(result: dict) -> None:
    budgets = sorted(result["refined"], key=int)
    print(f"\n| start | unrefined | {' | '.join(f'{b} steps' for b in budgets)} |")
    print("|---|---|" + "---|" * len(budgets))
    for name, before in result["unrefined"].items():
        print(f"| {name} | {before['test']:.4f} | "
              + " | ".join(f"{result['refined'][b][name]['test']:.4f}" for b in budgets) + " |")
    print(f"| ensemble (ceiling) | {result['ensemble']['test']:.4f} |" + " |" * len(budgets))
    print(f"endpoints (test): A {result['endpoints']['A']['test']:.4f}, B {result['endpoints']['B']['test']:.4f}; "
          f"lr {result['lr']:g} (validation: {result['lr_choice']}); s/step: refinement "
          f"{result['refined'][budgets[-1]]['wm midpoint']['s_per_step']:.3f}, dual {result['dual_s_per_step']:.3f}")


PYTHIA = {"160m": (768, 12, 12, 3072, 50304), "1b": (2048, 16, 8, 8192, 50304), "6.9b": (4096, 32, 32, 16384, 50432)}


def planned_peaks(micro_batch: int = 4, seq_len: int = 512) -> None:
    """--plans: the memory plan's estimated peak of one step (bf16, soft targets on) at Pythia configs: dual learned
    matching against refinement (match/memory_plan.py; the refinement's with the learned step's coefficients)."""
    from transformers import GPTNeoXConfig

    from hf_rebasin.match.memory_count import config_template, meta_graph
    from hf_rebasin.match.memory_plan import GIB, estimate_peak, step_shape
    print(f"| Pythia config | dual step | refinement step |  (estimated peak, bf16, {micro_batch} x {seq_len} tokens)")
    print("|---|---|---|")
    for name, (hidden, layers, heads, ffn, vocab) in PYTHIA.items():
        template = config_template(GPTNeoXConfig(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn,
            vocab_size=vocab, max_position_embeddings=2048, rotary_pct=0.25, use_parallel_residual=True,
            tie_word_embeddings=False, architectures=["GPTNeoXForCausalLM"]))
        graph = meta_graph(template)
        shapes = {k: tuple(v.shape) for k, v in graph.params.items()}
        peaks = [estimate_peak(step_shape(graph.spec, shapes, 2, "dual", refine=refine), micro_batch=micro_batch,
                               seq_len=seq_len, checkpointing=False, value_bytes=2, soft_targets=True)
                 for refine in (False, True)]
        print(f"| {name} | {peaks[0] / GIB:.1f} GiB | {peaks[1] / GIB:.1f} GiB |")


if __name__ == "__main__":
    if sys.argv[1:] == ["--plans"]:
        planned_peaks()
    else:
        main()
