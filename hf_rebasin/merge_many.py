"""Merging N > 2 models: one coordinate system for all (weight matching to a running average, then,
with --method lm / dual, one learned group element per model: match/learned_many.py), the barrier
over the simplex, the centroid exported.

barrier (N-way) = max over a simplex lattice of  L(sum_i w_i θ_i) - sum_i w_i L(θ_i).
The lattice holds every w with entries k/r (r = --simplex-resolution), the vertices and the
centroid among them; barrier.json stores the weight vectors under "lambdas"."""
from __future__ import annotations

import itertools
import json
import math
import shlex
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import __version__
from .barrier import evaluate
from .canonical import interpolate
from .cli import UserError
from .match import LEARNED
from .match.learned import continue_on_main_process, settings_from_args, training_data, validate
from .match.learned_many import learn_many
from .match.multi import align_many
from .models import canonicalise, check_compatible, check_same_structure, instantiate, load, save
from .symmetry import apply


def simplex_lattice(n: int, resolution: int) -> list[tuple[float, ...]]:
    points = [c for c in itertools.product(range(resolution + 1), repeat=n) if sum(c) == resolution]
    return [tuple(k / resolution for k in c) for c in sorted(points, reverse=True)]


def default_resolution(n: int) -> int:
    return 6 if n == 3 else n  # both put the centroid on the lattice


def align_all(args, progress: bool = True):
    from .merge import DEFAULT_LM_DATA, check_vocabularies, load_eval_data
    if args.method not in ("wm", "raw", "lm", "dual"):
        raise UserError(f"--method {args.method} is not available for {len(args.models)} models; use wm (weight "
                        "matching to a running average), lm or dual (learned on top of it) or raw")
    timings, start = {}, time.perf_counter()
    loaded = [load(s) for s in args.models]
    for other in loaded[1:]:
        check_compatible(loaded[0], other)
        check_vocabularies(loaded[0], other)
    graphs = [canonicalise(m) for m in loaded]
    for k, graph in enumerate(graphs[1:], start=1):
        check_same_structure(graphs[0], graph, ("model 0", f"model {k}"))
    timings["load_s"] = time.perf_counter() - start
    data_spec = args.data or (DEFAULT_LM_DATA if loaded[0].adapter.library == "transformers" else None)
    if data_spec is None:
        raise UserError("--data is required for image models (an ImageFolder, an .npz or a Hub dataset)")
    data = load_eval_data(data_spec, loaded[0], seq_len=args.seq_len, max_tokens=args.max_eval_tokens,
                          max_examples=args.max_eval_examples, text_field=args.text_field)
    settings = {}
    if args.method in LEARNED:
        learn_settings = settings_from_args(args, args.method)
        validate(learn_settings)
        match_spec = args.match_data or data_spec
        match_data = data if match_spec == data_spec else load_eval_data(
            match_spec, loaded[0], seq_len=args.seq_len, max_tokens=args.max_eval_tokens,
            max_examples=args.max_eval_examples, text_field=args.text_field)
        train = training_data(learn_settings, args, loaded[0], match_data, data, progress)
    start = time.perf_counter()
    if args.method == "raw":
        transforms, log = [None] * len(graphs), []
    else:
        transforms, log = align_many(graphs, max_rounds=args.rounds, progress=progress)
    if args.method in LEARNED:
        log = [{"stage": "wm", **entry} for entry in log]
        transforms, learned_log, settings, accelerator = learn_many(graphs, transforms, loaded[0], train, data,
                                                                     learn_settings, progress=progress)
        log += learned_log
        continue_on_main_process(accelerator)
    if args.method != "raw":
        graphs = [apply(g, t) for g, t in zip(graphs, transforms)]
    timings["match_s"] = time.perf_counter() - start
    return loaded, graphs, transforms, log, data, data_spec, timings, settings


def simplex_report(args, loaded, graphs, log, data, data_spec, timings, learned_settings: dict | None = None,
                   progress: bool = True) -> dict:
    from .merge import source_license, versions
    n = len(graphs)
    resolution = args.simplex_resolution or default_resolution(n)
    grid = simplex_lattice(n, resolution)
    metric = "perplexity" if data.task == "causal-lm" else "accuracy"
    start = time.perf_counter()
    results = [evaluate(instantiate(interpolate(graphs, list(w)), loaded[0]), data, args.batch_size, args.device)
               for w in tqdm(grid, desc="simplex", disable=not progress, leave=False)]
    timings["barrier_s"] = time.perf_counter() - start
    losses = [r["loss"] for r in results]
    vertex = [losses[grid.index(tuple(1.0 if j == i else 0.0 for j in range(n)))] for i in range(n)]
    excess = [loss - sum(wi * li for wi, li in zip(w, vertex)) for w, loss in zip(grid, losses)]
    worst = max(range(len(grid)), key=excess.__getitem__)
    centroid = tuple(1.0 / n for _ in range(n))
    on_grid = [k for k, w in enumerate(grid) if all(math.isclose(a, b) for a, b in zip(w, centroid))]
    licences = {source_license(s) for s in args.models}
    return {
        "hf_rebasin_version": __version__, "method": args.method, "models": list(args.models),
        "architecture": loaded[0].adapter.architecture, "task": data.task, "n_models": n,
        "alpha": list(centroid), "lambdas": [list(w) for w in grid], "loss": losses,
        metric: [r[metric] for r in results], "excess": excess, "endpoint_loss": vertex,
        "barrier": excess[worst], "barrier_lambda": list(grid[worst]),
        "merged_loss": losses[on_grid[0]], "data": {**(data.info or {}), "spec": data_spec},
        "settings": {"simplex_resolution": resolution, "rounds": args.rounds, "batch_size": args.batch_size,
                     **(learned_settings or {})},
        "match_log": log, "timings": timings, "versions": versions(),
        "command": "hf-rebasin " + shlex.join(args.argv),
        "notes": list(loaded[0].spec.notes) + list((learned_settings or {}).get("notes", [])),
        "license": licences.pop() if len(licences) == 1 else None,
    }


def plot_simplex(report: dict, path) -> None:
    """A ternary heat map of the excess loss for three models (a line plot of loss per point otherwise)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.2, 4.4), dpi=120)
    if report["n_models"] == 3:
        w = torch.tensor(report["lambdas"])
        x = w[:, 1] + 0.5 * w[:, 2]
        y = (math.sqrt(3) / 2) * w[:, 2]
        shading = ax.tricontourf(x.numpy(), y.numpy(), report["excess"], levels=12, cmap="viridis")
        ax.scatter(x, y, c="white", s=6)
        fig.colorbar(shading, ax=ax, label="excess loss over the plane of the endpoints (nats)")
        for (px, py), name in zip([(0, 0), (1, 0), (0.5, math.sqrt(3) / 2)], report["models"]):
            ax.annotate(Path(name).name, (px, py), ha="center", va="top" if py == 0 else "bottom", fontsize=8)
        ax.set_aspect("equal")
        ax.axis("off")
    else:
        ax.plot(report["excess"], marker="o")
        ax.set_xlabel("simplex lattice point")
        ax.set_ylabel("excess loss (nats)")
    ax.set_title(f"{report['n_models']}-way merge ({report['method']}), barrier {report['barrier']:.3f}", fontsize=9, pad=16)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_summary(report: dict) -> None:
    print(f"{report['n_models']}-way {report['method']}: barrier {report['barrier']:.4f} nats at weights "
          f"{[round(w, 3) for w in report['barrier_lambda']]}; centroid loss {report['merged_loss']:.4f}; "
          f"endpoint losses {[round(v, 4) for v in report['endpoint_loss']]}")


def run_many(args, out: Path | None, json_path: Path | None = None) -> int:
    from .merge import atomic_output_dir
    loaded, graphs, transforms, log, data, data_spec, timings, settings = align_all(args)
    report = simplex_report(args, loaded, graphs, log, data, data_spec, timings, settings)
    if out is not None:
        from safetensors.torch import save_file
        with atomic_output_dir(out, args.force) as tmp:
            start = time.perf_counter()
            save(instantiate(interpolate(graphs, report["alpha"]), loaded[0]), loaded[0], tmp)
            tensors = {}
            for k, t in enumerate(transforms):
                if t is not None:
                    tensors.update({f"{k}.{name}": v for name, v in t.to_tensors().items()})
            save_file(tensors or {"none": torch.zeros(())}, str(tmp / "transforms.safetensors"))
            report["timings"]["export_s"] = time.perf_counter() - start
            (tmp / "barrier.json").write_text(json.dumps(report, indent=2))
            plot_simplex(report, tmp / "barrier.png")
            from .cards import write_card
            write_card(tmp)
    if json_path is not None:
        partial = Path(str(json_path) + ".partial")
        partial.write_text(json.dumps(report, indent=2))
        partial.replace(json_path)
    print_summary(report)
    return 0
