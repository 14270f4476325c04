"""Barrier table: pairs the project trains from two seeds, every matching method, test-split barriers.

    .venv/bin/python benchmarks/barrier_table.py [--pairs neox-shakespeare,gpt2-shakespeare,vit-digits]
                                                 [--methods raw,am,wm,dual,dual/self] [--json runs/barrier_table.json]
                                                 [--learned-args "--steps 300 --lr 3e-3"] [--seeds 11,12]

Pairs come from benchmarks/pairs.py (trained once, cached under runs/pairs/); `example` is the bundled example
pair (hf_rebasin/assets), evaluated on its held-out file, for the data-free methods (raw, wm-perm, wm).
Evaluation on the test split; activation matching uses the validation split, lm and dual train on the train split
(METHOD/self: on text sampled from the two models instead, `--train-data self` / `--match-data self`).  Prints a
Markdown table for BENCHMARKS.md with the published Tiny Shakespeare figures of Theus et al.
(Table 2: vanilla averaging 2.02, activation matching 1.43, weight matching 0.34) beside, then the paired
differences between the methods of each pair ("dual − wm = −1.31 [−1.38, −1.25]": the barrier of one minus the
other's and the same for the loss at λ = 0.5, with the 95 % interval of a bootstrap that resamples the same
documents for both methods; evaluation/intervals.paired_difference).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PAPER = {"raw": 2.02, "am": 1.43, "wm": 0.34}  # Theus et al. Table 2, Tiny Shakespeare (their model and split)


def barrier_options(pair: dict, method: str, seq_len: int | None, max_tokens: int, learned: list[str],
                    am_args: list[str] = ()):
    """The options of `hf-rebasin barrier` for models of a pair: test split, am on the validation split, lm/dual
    trained on the train split (`learned`, `am_args`: extra merge flags for lm/dual and for am/am-perm, parsed
    like the command line's)."""
    from hf_rebasin.cli import build_parser
    from hf_rebasin.option_fields import from_namespace
    from hf_rebasin.options import MergeOptions
    method, _, data = method.partition("/")  # "dual/self": sampled from the models instead of the pair's text
    argv = ["barrier", "A", "B", "--method", method, "--data", pair["test_data"], "--max-eval-tokens", str(max_tokens)]
    if method in ("am", "am-perm"):  # (an option a method ignores is refused)
        argv += ["--match-data", data or pair["val_data"], *am_args]
    if seq_len:
        argv += ["--seq-len", str(seq_len)]
    if method in ("lm", "dual"):
        argv += ["--train-data", data or pair["train_data"], *learned]
    return from_namespace(MergeOptions, build_parser().parse_args(argv))


def measure(models: list[str], options, evaluations: dict | None = None) -> tuple[dict, float]:
    """(the report, seconds); with `evaluations`, the run's per-window losses stored there under the method."""
    from hf_rebasin.pipeline import run
    start = time.perf_counter()
    result = run(models, options)
    report = result.report.to_dict()
    if evaluations is not None:
        evaluations[options.method] = {**result.evaluation, "digest": report["data"].get("digest")}
    return report, time.perf_counter() - start


def paired_rows(pair: str, evaluations: dict[str, dict]) -> list[dict]:
    """For every two methods of a pair evaluated on the same windows: later − earlier, barrier and loss at λ=0.5,
    each with its paired bootstrap interval."""
    from hf_rebasin.evaluation.intervals import paired_difference
    rows, names = [], list(evaluations)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            a, b = evaluations[second], evaluations[first]
            if a["digest"] != b["digest"] or a["units"] != b["units"]:
                continue  # not the same windows: no paired comparison
            mid = next((k for k, w in enumerate(a["weights"]) if len(w) == 2 and abs(w[1] - 0.5) < 1e-9), None)
            diff = paired_difference(a, b, point=mid)
            rows.append({"pair": pair, "difference": f"{second} − {first}", **diff})
    return rows


def run_pair(name: str, methods: list[str], seq_len: int | None, max_tokens: int,
             learned: list[str] = (), seeds: tuple[int, int] | None = None, am_args: list[str] = ()) -> list[dict]:
    """Rows of one pair; with `seeds`, two further models of the pair's recipe trained from those seeds
    (a fresh pair, e.g. to check defaults on models they were not tuned on) instead of the cached pair."""
    if name == "example":  # the bundled example pair (data-free methods: its held-out file is all the text it has)
        from hf_rebasin.assets import example_pair
        root = example_pair()
        pair = {"model_a": str(root / "model-a"), "model_b": str(root / "model-b"),
                "test_data": str(root / "heldout.txt")}
    else:
        import pairs
        pair = pairs.get_pair(name)
    if seeds is not None:
        model_a, model_b = pairs.extra_models(name, list(seeds))
        pair = {**pair, "model_a": model_a, "model_b": model_b}
        name = f"{name} (seeds {seeds[0]}, {seeds[1]})"
    rows, evaluations = [], {}
    for method in methods:
        report, seconds = measure([pair["model_a"], pair["model_b"]],
                                  barrier_options(pair, method, seq_len, max_tokens, learned, am_args), evaluations)
        evaluations[method] = evaluations.pop(report["method"])
        metric = "perplexity" if report["task"] == "causal-lm" else "accuracy"
        mid = report["lambdas"].index(0.5)
        rows.append({"pair": name, "method": method, "barrier": report["barrier"],
                     "loss_a": report["endpoint_loss"][0], "loss_b": report["endpoint_loss"][1],
                     "loss_mid": report["loss"][mid], "metric": metric,
                     "metric_a": report[metric][0], "metric_b": report[metric][-1], "metric_mid": report[metric][mid],
                     "match_s": report["timings"]["match_s"], "total_s": seconds,
                     "rounds": max(0, sum("distance" in e for e in report.get("match_log") or []) - 1),
                     "sample_s": report["timings"].get("sample_s"),
                     "tokens_sampled": (report["settings"].get("self_samples") or {}).get("tokens")})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows + paired_rows(name, evaluations)


def run_three_way(name: str, methods: list[str], seq_len: int | None, max_tokens: int,
                  learned: list[str] = ()) -> list[dict]:
    """Models of seeds 0, 1 and 2 of a pair; barrier = worst excess over the simplex lattice (resolution 6)."""
    import pairs
    pair = pairs.get_pair(name)
    models = [pair["model_a"], pair["model_b"], pairs.extra_model(name, 2)]
    rows = []
    for method in methods:
        report, seconds = measure(models, barrier_options(pair, method, seq_len, max_tokens, learned))
        metric = "perplexity" if report["task"] == "causal-lm" else "accuracy"
        centre = report["lambdas"].index(report["alpha"]) if report["alpha"] in report["lambdas"] else None
        rows.append({"pair": f"{name} (3 seeds)", "method": method, "barrier": report["barrier"],
                     "loss_a": report["endpoint_loss"][0], "loss_b": report["endpoint_loss"][1],
                     "loss_c": report["endpoint_loss"][2], "loss_mid": report["merged_loss"], "metric": metric,
                     "metric_a": report[metric][0],
                     "metric_b": report[metric][report["lambdas"].index([0.0, 1.0, 0.0])],
                     "metric_mid": report[metric][centre] if centre is not None else float("nan"),
                     "match_s": report["timings"]["match_s"], "total_s": seconds})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def run_narrow(name: str, methods: list[str], seq_len: int | None, max_tokens: int,
               learned: list[str] = ()) -> list[dict]:
    """Model A of a pair against a narrower sibling (pairs.NARROW, seed 2), embedded exactly into A's width."""
    import pairs
    pair = pairs.get_pair(name)
    narrow = pairs.extra_model(name, 2, narrow=True)
    rows = []
    for method in methods:
        options = barrier_options(pair, method, seq_len, max_tokens, learned)
        report, seconds = measure([pair["model_a"], narrow], options)
        metric = "perplexity" if report["task"] == "causal-lm" else "accuracy"
        mid = report["lambdas"].index(0.5)
        widths = ", ".join(f"{k} {v}" for k, v in pairs.NARROW[name].items())
        rows.append({"pair": f"{name} A + narrow ({widths})", "method": method, "barrier": report["barrier"],
                     "loss_a": report["endpoint_loss"][0], "loss_b": report["endpoint_loss"][1],
                     "loss_mid": report["loss"][mid], "metric": metric,
                     "metric_a": report[metric][0], "metric_b": report[metric][-1], "metric_mid": report[metric][mid],
                     "match_s": report["timings"]["match_s"], "total_s": seconds})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def paired_markdown(rows: list[dict]) -> str:
    """The paired differences: "dual − wm | −1.310 [−1.380, −1.250] | ..."."""
    lines = ["| pair | difference | barrier (nats), 95 % paired interval | loss at λ=0.5 (nats), 95 % paired interval "
             "| units resampled |", "|---|---|---|---|---|"]
    for r in rows:
        loss = (f"{r['loss']:+.3f} [{r['loss_interval'][0]:+.3f}, {r['loss_interval'][1]:+.3f}]"
                if "loss" in r else "")
        lines.append(f"| {r['pair']} | {r['difference']} | {r['barrier']:+.3f} [{r['barrier_interval'][0]:+.3f}, "
                     f"{r['barrier_interval'][1]:+.3f}] | {loss} | {r['bootstrap']['units']} |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = ["| pair | method | test barrier (nats) | loss A | loss B | loss at λ=0.5 | metric A / B / mid | "
             "match s | Theus et al. (Tiny Shakespeare) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "difference" in r:
            continue
        fmt = "{:.1%}" if r["metric"] == "accuracy" else "{:.2f}"
        metric = " / ".join(fmt.format(r[k]) for k in ("metric_a", "metric_b", "metric_mid"))
        comparable = "shakespeare" in r["pair"] and "bpe512" not in r["pair"]  # (the paper's pairs use GPT-2 tokens)
        paper = PAPER.get(r["method"], "") if comparable else ""
        lines.append(f"| {r['pair']} | {r['method']} | {r['barrier']:.3f} | {r['loss_a']:.3f} | {r['loss_b']:.3f} | "
                     f"{r['loss_mid']:.3f} | {r['metric']}: {metric} | {r['match_s']:.1f} | {paper} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="neox-shakespeare,gpt2-shakespeare,vit-digits")
    parser.add_argument("--methods", default="raw,am,wm-perm,wm")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--max-eval-tokens", type=int, default=65536)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--three-way", default="", help="pairs to also merge three ways (a third seed is trained)")
    parser.add_argument("--three-way-methods", default="wm,dual")
    parser.add_argument("--narrow", default="", help="pairs to also merge with a narrower sibling (pairs.NARROW)")
    parser.add_argument("--narrow-methods", default="raw,wm,dual")
    parser.add_argument("--seeds", help="A,B: instead of each cached pair, two models of its recipe trained from "
                                            "these seeds (a fresh pair)")
    parser.add_argument("--learned-args", default="",
                        help="extra merge flags for lm/dual, e.g. '--steps 200 --lr 1e-2'")
    parser.add_argument("--am-args", default="", help="extra merge flags for am/am-perm, e.g. '--am-batches 32'")
    args = parser.parse_args()
    rows = []
    for name in filter(None, args.pairs.split(",")):
        seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None
        rows += run_pair(name, args.methods.split(","), args.seq_len, args.max_eval_tokens, args.learned_args.split(),
                         seeds, args.am_args.split())
    for name in filter(None, args.three_way.split(",")):
        rows += run_three_way(name, args.three_way_methods.split(","), args.seq_len, args.max_eval_tokens,
                              args.learned_args.split())
    for name in filter(None, args.narrow.split(",")):
        rows += run_narrow(name, args.narrow_methods.split(","), args.seq_len, args.max_eval_tokens,
                           args.learned_args.split())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    print(markdown(rows))
    paired = [r for r in rows if "difference" in r]
    if paired:
        print()
        print(paired_markdown(paired))


if __name__ == "__main__":
    main()
