"""``hf-rebasin merge`` and ``hf-rebasin barrier``: align two checkpoints, measure the barrier on the
straight path, export the merged point as a checkpoint of the original class.

DIR is written to a temporary folder beside it and renamed at the very end, so a failure or
Ctrl-C never leaves a half-written DIR."""
from __future__ import annotations

import json
import math
import shlex
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from . import __version__
from .barrier import EvalData, evaluate, evaluate_path, plot_path
from .assets import example_pair
from .canonical import interpolate
from .cards import write_card
from .cli import UserError
from .match import DESCRIPTIONS, LEARNED, METHODS, NEEDS_DATA
from .match.learned import add_learned_arguments
from .models import Loaded, canonicalise, check_compatible, check_same_structure, instantiate, load, save
from .symmetry import apply

DEFAULT_LM_DATA = "wikitext:wikitext-103-raw-v1:test"


# --- data ----------------------------------------------------------------------------------------

def load_eval_data(spec: str, template: Loaded, *, seq_len: int | None, max_tokens: int | None,
                   max_examples: int | None, text_field: str = "text") -> EvalData:
    from .data import load_token_windows, read_images
    if template.adapter.library == "timm":
        import timm.data
        cfg = timm.data.resolve_data_config({}, model=template.model)
        images, labels, info = read_images(spec, input_size=tuple(cfg["input_size"]), mean=tuple(cfg["mean"]),
                                           std=tuple(cfg["std"]), max_examples=max_examples)
        return EvalData("image-classification", images, labels, info)
    context = getattr(template.config, "max_position_embeddings", None) or getattr(template.config, "n_positions", 512)
    seq_len = seq_len or min(512, context)
    if seq_len > context:
        raise UserError(f"--seq-len {seq_len} is longer than the model's context ({context} tokens)")
    windows, info = load_token_windows(spec, load_tokenizer(template), seq_len, max_tokens, text_field=text_field)
    return EvalData("causal-lm", windows, None, info)


def load_tokenizer(template: Loaded):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(template.source)
    except Exception as error:  # noqa: BLE001
        raise UserError(f"{template.source} has no loadable tokenizer ({type(error).__name__}: {error}); "
                        "the barrier needs one to tokenise --data") from error


def check_vocabularies(a: Loaded, b: Loaded) -> None:
    if a.adapter.library != "transformers":
        return
    try:
        va, vb = load_tokenizer(a).get_vocab(), load_tokenizer(b).get_vocab()
    except UserError:
        return  # the barrier step reports a missing tokenizer for A; B's is not needed
    if va != vb:
        only_a, only_b = len(set(va) - set(vb)), len(set(vb) - set(va))
        moved = sum(1 for tok in set(va) & set(vb) if va[tok] != vb[tok])
        raise UserError(f"the tokenizers of {a.source} and {b.source} differ ({only_a} tokens only in A, "
                        f"{only_b} only in B, {moved} with different ids): token embeddings are not indexed alike, "
                        "so the models cannot be aligned")


# --- output folder -------------------------------------------------------------------------------

@contextmanager
def atomic_output_dir(out: Path, force: bool):
    """Yield a temporary folder beside `out`; move it to `out` only when the block succeeds."""
    out = Path(out)
    if out.exists() and not force:
        raise UserError(f"{out} already exists; choose another --out or pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def source_license(source: str) -> str | None:
    try:
        from huggingface_hub import ModelCard
        card = ModelCard.load(Path(source) / "README.md" if Path(source).is_dir() else source)
        return card.data.to_dict().get("license")
    except Exception:  # noqa: BLE001 - no card, no licence
        return None


def versions() -> dict:
    import timm
    import transformers
    return {"hf_rebasin": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "timm": timm.__version__}


# --- the pipeline ------------------------------------------------------------------------------

def align(args, progress: bool = True):
    """Load, check, canonicalise and match the two models; return what every command needs."""
    timings = {}
    start = time.perf_counter()
    if len(args.models) < 2:
        raise UserError(f"got {len(args.models)} model; a merge needs at least two (A B ...)")
    if args.method not in METHODS:
        raise UserError(f"unknown --method {args.method!r}; choose one of {', '.join(METHODS)}")
    if not 0.0 <= args.alpha <= 1.0:
        raise UserError(f"--alpha must be in [0, 1], got {args.alpha}")
    a, b = (load(s) for s in args.models)
    check_compatible(a, b)
    check_vocabularies(a, b)
    graph_a, graph_b = canonicalise(a), canonicalise(b)
    check_same_structure(graph_a, graph_b)
    timings["load_s"] = time.perf_counter() - start

    data_spec = args.data or (DEFAULT_LM_DATA if a.adapter.library == "transformers" else None)
    if data_spec is None:
        raise UserError("--data is required for image models (an ImageFolder, an .npz or a Hub dataset)")
    data = load_eval_data(data_spec, a, seq_len=args.seq_len, max_tokens=args.max_eval_tokens,
                          max_examples=args.max_eval_examples, text_field=args.text_field)
    options = {}
    if args.method in NEEDS_DATA:
        match_spec = args.match_data or data_spec
        match_data = data if match_spec == data_spec else load_eval_data(
            match_spec, a, seq_len=args.seq_len, max_tokens=args.max_eval_tokens,
            max_examples=args.max_eval_examples, text_field=args.text_field)
        options.update(data=match_data, template=a, batches=args.am_batches, batch_size=args.batch_size)
    if args.method in LEARNED:
        options.update(cli_args=args, eval_data=data)
    if args.method in ("wm", "wm-perm"):
        options["max_rounds"] = args.rounds
    start = time.perf_counter()
    result = METHODS[args.method](graph_a, graph_b, progress=progress, **options)
    timings["match_s"] = time.perf_counter() - start
    aligned_a, aligned_b = apply(graph_a, result.transform_a), apply(graph_b, result.transform_b)
    return a, b, aligned_a, aligned_b, result, data, data_spec, timings


def lambda_grid(points: int) -> list[float]:
    if points < 2:
        raise UserError(f"--lambdas needs at least 2 points, got {points}")
    return [k / (points - 1) for k in range(points)]


def path_report(args, a, b, aligned_a, aligned_b, result, data, data_spec, timings, progress=True) -> dict:
    lambdas = lambda_grid(args.lambdas)
    start = time.perf_counter()
    path = evaluate_path(aligned_a, aligned_b, a, data, lambdas, batch_size=args.batch_size,
                         device=args.device, progress=progress)
    on_grid = [k for k, lam in enumerate(lambdas) if math.isclose(lam, args.alpha, abs_tol=1e-9)]
    if on_grid:
        merged_loss = path["loss"][on_grid[0]]
    else:
        merged_loss = evaluate(instantiate(interpolate([aligned_a, aligned_b], [1 - args.alpha, args.alpha]), a),
                               data, args.batch_size, args.device)["loss"]
    timings["barrier_s"] = time.perf_counter() - start
    licences = {source_license(s) for s in args.models}
    data_info = {k: v for k, v in (data.info or {}).items()}
    data_info["spec"] = data_spec
    return {
        "hf_rebasin_version": __version__, "method": args.method, "method_description": DESCRIPTIONS[args.method],
        "models": list(args.models), "architecture": a.adapter.architecture, "task": data.task,
        "alpha": args.alpha, **path, "merged_loss": merged_loss, "data": data_info,
        "settings": {**result.settings, "lambdas": args.lambdas, "batch_size": args.batch_size,
                     "seq_len": data_info.get("seq_len"), "max_eval_tokens": args.max_eval_tokens},
        "match_log": result.log, "timings": timings, "versions": versions(),
        "command": "hf-rebasin " + shlex.join(args.argv),
        "notes": list(a.spec.notes), "license": licences.pop() if len(licences) == 1 else None,
    }


def write_merge(out_dir: Path, args, a, aligned_a, aligned_b, result, report) -> None:
    from safetensors.torch import save_file
    start = time.perf_counter()
    merged = instantiate(interpolate([aligned_a, aligned_b], [1 - args.alpha, args.alpha]), a)
    save(merged, a, out_dir)
    tensors = {f"a.{k}": v for k, v in result.transform_a.to_tensors().items()}
    tensors.update({f"b.{k}": v for k, v in result.transform_b.to_tensors().items()})
    save_file(tensors, str(out_dir / "transforms.safetensors"), metadata={"method": args.method})
    report["timings"]["export_s"] = time.perf_counter() - start
    (out_dir / "barrier.json").write_text(json.dumps(report, indent=2))
    plot_path({args.method: report}, out_dir / "barrier.png",
              f"{Path(args.models[0]).name} × {Path(args.models[1]).name}  ({args.method})")
    write_card(out_dir)


def run_merge(args) -> int:
    out = Path(args.out)
    if out.exists() and not args.force:  # fail before any heavy work
        raise UserError(f"{out} already exists; choose another --out or pass --force to replace it")
    if len(args.models) > 2:
        from .merge_many import run_many
        return run_many(args, out)
    aligned = align(args)
    report = path_report(args, *aligned)
    with atomic_output_dir(out, args.force) as tmp:
        a, _, aligned_a, aligned_b, result = aligned[:5]
        write_merge(tmp, args, a, aligned_a, aligned_b, result, report)
    print_summary(report, out)
    if getattr(args, "push_to_hub", None):
        from .hub import push
        print(f"pushed: {push(out, args.push_to_hub, private=args.private)}")
    return 0


def run_barrier(args) -> int:
    if len(args.models) > 2:
        from .merge_many import run_many
        return run_many(args, None, args.json)
    aligned = align(args)
    report = path_report(args, *aligned)
    if args.json:
        tmp = Path(str(args.json) + ".partial")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(args.json)
    print_summary(report, None)
    return 0


def print_summary(report: dict, out: Path | None) -> None:
    metric = "perplexity" if report["task"] == "causal-lm" else "accuracy"
    print(f"{'lambda':>7} {'loss':>9} {metric:>11}")
    for lam, loss, value in zip(report["lambdas"], report["loss"], report[metric]):
        print(f"{lam:7.2f} {loss:9.4f} {value:11.4f}")
    print(f"method {report['method']}: barrier {report['barrier']:.4f} nats at λ={report['barrier_lambda']:.2f}; "
          f"merged (α={report['alpha']}) loss {report['merged_loss']:.4f}")
    if out is not None:
        print(f"wrote {out}/ (model, barrier.json, barrier.png, transforms.safetensors)")


def add_common(parser) -> None:
    parser.add_argument("models", nargs="+", help="Hub ids or local folders: A B (or more, for an N-way merge)")
    parser.add_argument("--method", default="wm", help=f"one of: {', '.join(METHODS)} (default wm)")
    parser.add_argument("--data", help="held-out data: .txt file or folder, .jsonl, datasets spec NAME[:CONFIG[:SPLIT]]"
                        f" (LM default {DEFAULT_LM_DATA}); images: ImageFolder, .npz, datasets spec")
    parser.add_argument("--match-data", help="data for activation matching (default: --data)")
    parser.add_argument("--text-field", default="text", help="text field of .jsonl / datasets rows")
    parser.add_argument("--alpha", type=float, default=0.5, help="merged model = (1-α)·A + α·π(B) (default 0.5)")
    parser.add_argument("--lambdas", type=int, default=11, help="points on the λ grid, 0..1 (default 11)")
    parser.add_argument("--seq-len", type=int, help="window length in tokens (default min(512, context))")
    parser.add_argument("--max-eval-tokens", type=int, default=65536, help="cap on evaluated tokens (default 65536)")
    parser.add_argument("--max-eval-examples", type=int, help="cap on evaluated images")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10, help="cap on weight-matching rounds (default 10)")
    parser.add_argument("--am-batches", type=int, default=4, help="batches for activation matching (default 4)")
    parser.add_argument("--simplex-resolution", type=int, help="N-way merges: lattice step 1/r on the simplex "
                        "(default 6 for three models, N otherwise; both include the centroid)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_learned_arguments(parser)


EXAMPLE_PAIR = example_pair()


def run_demo(args) -> int:
    """The README's main job: merge the bundled example pair offline, raw vs weight matching."""
    from .cli import build_parser
    pair = Path(args.pair)
    a, b, heldout = pair / "model-a", pair / "model-b", pair / "heldout.txt"
    if not (a.is_dir() and b.is_dir() and heldout.is_file()):
        raise UserError(f"{pair} does not hold the example pair (model-a/, model-b/, heldout.txt)")
    reports = {}
    for method in ("raw", "wm"):
        argv = ["merge", str(a), str(b), "--method", method, "--data", str(heldout), "--seq-len", "128",
                "--max-eval-tokens", "16384", "--out", str(Path(args.out) / method), "--force"]
        ns = build_parser().parse_args(argv)
        ns.argv = argv
        print(f"== {method}: {DESCRIPTIONS[method]}")
        run_merge(ns)
        reports[method] = json.loads((Path(args.out) / method / "barrier.json").read_text())
    print(f"\n{'method':<8} {'barrier':>8} {'loss A':>8} {'loss B':>8} {'midpoint':>9}   (nats/token, held-out)")
    for method, r in reports.items():
        print(f"{method:<8} {r['barrier']:8.4f} {r['endpoint_loss'][0]:8.4f} {r['endpoint_loss'][1]:8.4f} "
              f"{r['merged_loss']:9.4f}")
    print(f"merged models: {Path(args.out) / 'wm'} (weight matching), {Path(args.out) / 'raw'} (plain average)")
    return 0


def register(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="merge the bundled example pair (offline): raw vs weight matching")
    demo.add_argument("--pair", default=str(EXAMPLE_PAIR), help="folder with model-a/, model-b/, heldout.txt")
    demo.add_argument("--out", default="runs/demo", help="where the merged models go (replaced)")
    demo.set_defaults(func=run_demo)
    merge = subparsers.add_parser("merge", help="align two models, measure the barrier, write the merged model")
    add_common(merge)
    merge.add_argument("--out", required=True, help="output folder (refused if it exists, unless --force)")
    merge.add_argument("--force", action="store_true", help="replace an existing --out")
    merge.add_argument("--push-to-hub", metavar="REPO_ID", help="push DIR to this Hub repo afterwards")
    merge.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repo")
    merge.set_defaults(func=run_merge)
    barrier = subparsers.add_parser("barrier", help="measure the loss barrier without exporting")
    add_common(barrier)
    barrier.add_argument("--json", type=Path, help="write the report to this file")
    barrier.set_defaults(func=run_barrier)
