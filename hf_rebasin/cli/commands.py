"""The sub-commands: each parses its arguments, calls the library and prints what it returned."""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from ..option_fields import add_arguments, argument_group, from_namespace
from ..options import EvalOptions, MergeOptions, PushOptions, TokenizeOptions


def method_table() -> str:
    from ..match import METHODS
    width = max(map(len, METHODS))
    lines = [f"  {name:<{width}}  {m.description}" + data_tag(m) + ("  [N models]" if m.n_way else "")
             for name, m in METHODS.items()]
    return "methods (--method):\n" + "\n".join(lines)


def data_tag(method) -> str:
    """What data a method uses beyond --data, and where it comes from when no flag names it."""
    if method.learned:
        return "  [trains on --train-data; default for LMs: text sampled from the models (self)]"
    if method.needs_data:
        return "  [activations on --match-data; default: the --data set]"
    return ""


# --- inspect --------------------------------------------------------------------------------------

def run_inspect(args) -> int:
    from ..describe import describe
    info = describe(args.model)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, list):
            print(f"{key}:")
            for line in value:
                print(f"  - {line}")
        else:
            shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else value
            print(f"{key:<{width}}  {shown}")
    return 0


def register_inspect(subparsers) -> None:
    parser = subparsers.add_parser("inspect", help="show a model's architecture, sizes and symmetry group",
                                   description="A model's architecture, sizes, norm eps and the symmetry group "
                                               "hf-rebasin uses for it, from its config alone.")
    parser.add_argument("model", help="Hugging Face Hub id or local folder")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run_inspect)


# --- merge, barrier, demo -------------------------------------------------------------------------

def print_summary(report, out: Path | None) -> None:
    if report.n_models == 2:
        print(f"{'lambda':>7} {'loss':>9} {report.metric:>11}")
        for lam, loss, value in zip(report.lambdas, report.loss, report.metric_values):
            print(f"{lam:7.2f} {loss:9.4f} {value:11.4f}")
        print(f"method {report.method}: barrier {report.barrier:.4f} nats at λ={report.barrier_lambda:.2f}; "
              f"merged (α={report.alpha}) loss {report.merged_loss:.4f}")
        if report.raw_barrier is not None:
            print(f"reference: the plain average (raw) has barrier {report.raw_barrier:.4f} nats at the same λ "
                  "points (--no-raw-reference skips it)")
    else:
        print(f"{report.n_models}-way {report.method}: barrier {report.barrier:.4f} nats at weights "
              f"{[round(w, 3) for w in report.barrier_lambda]}; centroid loss {report.merged_loss:.4f}; "
              f"endpoint losses {[round(v, 4) for v in report.endpoint_loss]}")
    if report.refined:
        r = report.refined
        print(f"refined: {r['steps']} steps towards the endpoints' ensemble: loss {r['loss']:.4f} (merged "
              f"{r['merged_loss']:.4f}, ensemble {r['ensemble_loss']:.4f}, endpoints "
              f"{' / '.join(f'{v:.4f}' for v in r['endpoint_loss'])}); the checkpoint written is the refined model")
    if out is not None:
        print(f"wrote {out}/ (model, barrier.json, barrier.png, transforms.safetensors, README.md)")


def run_merge(args) -> int:
    from ..checks import check_request
    options = from_namespace(MergeOptions, args)
    check_request(args.models, options, out=args.out, force=args.force, push_to=args.push_to_hub)  # before torch
    from ..pipeline import run
    result = run(args.models, options, out=args.out, force=args.force, push_to=args.push_to_hub,
                 private=args.private, command="hf-rebasin " + shlex.join(args.argv), checked=True)
    if result.report is not None:  # None in the other processes of `accelerate launch`
        print_summary(result.report, result.out)
        if args.push_to_hub:
            print(f"pushed to {args.push_to_hub}")
    return 0


def run_barrier(args) -> int:
    from ..checks import check_request
    options = from_namespace(MergeOptions, args)
    check_request(args.models, options, json_path=args.json)  # before torch is imported
    from ..pipeline import run
    result = run(args.models, options, json_path=args.json, command="hf-rebasin " + shlex.join(args.argv),
                 checked=True)
    if result.report is not None:
        print_summary(result.report, None)
    return 0


def run_demo(args) -> int:
    from ..match import METHODS
    from ..pipeline import demo
    for method in ("raw", "wm"):
        print(f"== {method}: {METHODS[method].description}")
    reports = demo(args.out)
    print(f"\n{'method':<8} {'barrier':>8} {'loss A':>8} {'loss B':>8} {'midpoint':>9}   (nats/token, held-out)")
    for method, r in reports.items():
        print(f"{method:<8} {r.barrier:8.4f} {r.endpoint_loss[0]:8.4f} {r.endpoint_loss[1]:8.4f} {r.merged_loss:9.4f}")
    print(f"merged models: {Path(args.out) / 'wm'} (weight matching), {Path(args.out) / 'raw'} (plain average)")
    return 0


def add_models_and_options(parser) -> None:
    parser.add_argument("models", nargs="+", metavar="MODEL",
                        help="Hub ids or local folders: A B (or more, for an N-way merge)")
    add_arguments(parser, MergeOptions)


def register_merge(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="merge the bundled example pair (offline): raw vs weight matching",
                                 description="Merge the example pair that ships with hf-rebasin (two tiny GPT-NeoX "
                                             "models trained from two seeds on Python's standard library): the plain "
                                             "average and weight matching, with their barriers.")
    demo.add_argument("--out", default="runs/demo", help="where the merged models go; an earlier demo there is "
                                                         "replaced (default %(default)s)")
    demo.set_defaults(func=run_demo)
    formatter = argparse.RawDescriptionHelpFormatter
    merge = subparsers.add_parser("merge", help="align models, measure the barrier, write the merged model",
                                  description="Align two (or more) models, measure the loss barrier on held-out data "
                                              "and write the merged model as a checkpoint of its own class.",
                                  epilog=method_table(), formatter_class=formatter)
    add_models_and_options(merge)
    out = argument_group(merge, "output")
    out.add_argument("--out", required=True, help="output folder (refused if it exists, unless --force)")
    out.add_argument("--force", action="store_true", help="replace an earlier hf-rebasin output at --out (a folder "
                                                          "with barrier.json; anything else is never replaced)")
    out.add_argument("--push-to-hub", metavar="REPO_ID", help="push the output folder to this Hub repo afterwards")
    out.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repo")
    merge.set_defaults(func=run_merge)
    barrier = subparsers.add_parser("barrier", help="measure the loss barrier without exporting",
                                    description="Align models and measure the loss barrier; write nothing but the "
                                                "optional --json report.", epilog=method_table(),
                                    formatter_class=formatter)
    add_models_and_options(barrier)
    barrier.add_argument("--json", type=Path, help="write the report to this file")
    barrier.set_defaults(func=run_barrier)


# --- eval and push --------------------------------------------------------------------------------

def run_eval(args) -> int:
    from ..hub.evals import evaluate_merge, results_table
    evaluation = evaluate_merge(args.dir, from_namespace(EvalOptions, args), announce=lambda s: print(s, flush=True))
    print(results_table(evaluation["results"]))
    print(f"wrote {Path(args.dir) / 'eval.json'} and updated the model card")
    return 0


def run_push(args) -> int:
    from ..hub.push import push
    options = from_namespace(PushOptions, args)
    options.check()
    print(push(args.dir, args.repo_id, private=options.private, revision=options.revision,
               commit_message=options.commit_message, exist_ok=options.exist_ok))
    return 0


def register_eval_and_push(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval", help="zero-shot lm-eval scores of a merged language model (and optionally its endpoints)",
        description="Zero-shot lm-eval scores (default: PIQA, SciQ, ARC-Easy) of a merged language model, "
                    "written to DIR/eval.json and added to the model card.")
    parser.add_argument("dir", metavar="DIR", help="a merge output folder (written by `hf-rebasin merge`)")
    add_arguments(parser, EvalOptions)
    parser.set_defaults(func=run_eval)
    parser = subparsers.add_parser(
        "push", help="upload a merge output folder to the Hugging Face Hub",
        description="Upload the output folder of `hf-rebasin merge` (merged model, barrier.json, barrier.png and a "
                    "model card rendered for the repository) to a new Hub repository. Local paths are published "
                    "by their names only. Needs HF_TOKEN or `hf auth login`.")
    parser.add_argument("dir", help="the merge output folder (holds barrier.json)")
    parser.add_argument("repo_id", help="the Hub repository to create, e.g. your-name/pythia-70m-merged")
    add_arguments(parser, PushOptions)
    parser.set_defaults(func=run_push)


def run_tokenize(args) -> int:
    from .. import tokenize as api_tokenize
    tokenize = api_tokenize.__wrapped__  # its errors name the flags, not the keywords
    options = from_namespace(TokenizeOptions, args)
    options.check()
    record = tokenize(args.data, args.model, args.out, text_field=options.text_field, split=options.split,
                      max_tokens=options.max_tokens, force=options.force)
    print(f"wrote {args.out}: {record['tokens']:,} tokens ({record['dtype']}) of {args.data}, tokenizer of "
          f"{args.model}; train on it with --train-data {args.out}")
    return 0


def register_tokenize(subparsers) -> None:
    parser = subparsers.add_parser(
        "tokenize", help="tokenise training text into a token file that --train-data reads memory-mapped",
        description="Tokenise DATA (any --data form; a datasets spec is read as a streaming split) with MODEL's "
                    "tokenizer, under the same protocol as --data, into one flat .npy array of token ids (with "
                    "FILE.npy.json saying what it holds). `merge --train-data FILE.npy` then reads its windows from "
                    "disk as the batches need them, so large training sets never sit in memory.")
    parser.add_argument("data", metavar="DATA",
                        help="a .txt file or folder, .jsonl, or a datasets spec NAME[:CONFIG[:SPLIT]]")
    parser.add_argument("--model", required=True, help="the model (Hub id or folder) whose tokenizer to use")
    parser.add_argument("--out", required=True, help="the token file to write (FILE.npy)")
    add_arguments(parser, TokenizeOptions)
    parser.set_defaults(func=run_tokenize)


REGISTER = (register_inspect, register_merge, register_eval_and_push, register_tokenize)  # `run`: recipe_command
