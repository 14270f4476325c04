"""The one pipeline for N >= 2 models (two models are the N = 2 case):

    check options and output -> load, check, canonicalise -> data -> align (a registered method)
    -> evaluate the λ grid / simplex lattice -> report -> export (atomic folder) -> push

Every check that needs no weights runs before the first expensive step.  The Python API
(``hf_rebasin.merge`` / ``hf_rebasin.barrier``) and the command line both call ``run``."""
from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .checks import check_request, data_specs
from .core.canonical import interpolate
from .core.symmetry import Transform, apply
from .core.widths import embed
from .errors import IncompatibleModelsError
from .evaluation.barrier import (
    evaluate,
    evaluate_points,
    lambda_grid,
    plot_path,
    plot_simplex,
    simplex_lattice,
    worst_excess,
)
from .evaluation.report import Report, report_text
from .export.checkpoint import save, save_trained
from .export.io import ShardWriter, atomic_write
from .export.ownership import atomic_output_dir
from .match import METHODS, Alignment, MatchContext
from .match.experts import check_method as check_expert_method
from .options import DEFAULT_LM_DATA, SELF_DATA, MergeOptions
from .requirements import installed_versions
from .run_data import (
    eval_data,
    fitting_overlap,
    matching_split,
    self_samples,
    training_data,
)
from .sources.eval_data import EvalData
from .sources.models import (
    Loaded,
    PlainAverage,
    canonicalise,
    check_compatible,
    check_same_structure,
    instantiate,
    load,
)
from .sources.splits import data_digest
from .version import __version__


@dataclass
class MergeResult:
    report: Report | None  # None in the other processes of an `accelerate launch` run (only the main one reports)
    transforms: list[Transform]  # one per model, acting on its canonical graph
    out: Path | None = None  # the output folder, when one was written
    # every window's summed loss at every point, its predicted tokens, its bootstrap unit, the points' weights and
    # the models' own points: what a paired comparison of two methods on the same windows needs
    # (evaluation/intervals.paired_difference); not written to barrier.json
    evaluation: dict | None = None

    @property
    def barrier(self) -> float:
        return self.report.barrier


def run(models: list[str], options: MergeOptions, *, out: str | Path | None = None, force: bool = False,
        json_path: str | Path | None = None, push_to: str | None = None, private: bool = False,
        progress: bool = True, command: str | None = None, names: list[str] | None = None,
        checked: bool = False) -> MergeResult:
    """names: what the report, card and messages call the models (default: `models`, the folders or Hub ids; the
    API names a loaded model, written to a temporary folder, by where it came from).  checked: check_request has
    run already (the command line runs it before it imports this module)."""
    models = [str(m) for m in models]
    names = list(names or models)
    if not checked:
        check_request(models, options, out=out, force=force, json_path=json_path, push_to=push_to)

    timings, start = {}, time.perf_counter()
    loaded = [load(source) for source in models]
    for model, name in zip(loaded, names):
        model.source = name
    narrower = [k for k, other in enumerate(loaded[1:], start=1) if embeddable(loaded[0], other)]
    for k, other in enumerate(loaded[1:], start=1):
        check_compatible(loaded[0], other, shapes=k not in narrower)
    check_expert_method(loaded[0].spec, options.method, options.init)
    memory_plan = refine_plan = None
    if METHODS[options.method].learned:  # before any weight is read: a run that cannot fit stops here
        from .match.memory_plan import plan_run
        options, memory_plan = plan_run(options, loaded[0], len(loaded), progress)
    if options.refine_steps and out is not None:  # the refinement's step (the whole model trained) planned too
        from .match.memory_plan import plan_run
        options, refine_plan = plan_run(options, loaded[0], len(loaded), progress, refine=True)
    graphs = [canonicalise(m) for m in loaded]
    embedding_notes = []
    for k in narrower:  # written exactly into the first (wider) model's configuration
        graphs[k] = embed(graphs[k], graphs[0].spec, norm_eps=graphs[0].norm_eps)
        embedding_notes.append(f"{names[k]} (residual width {loaded[k].spec.d_model}) was embedded exactly into "
                               f"the configuration of {names[0]} (width {loaded[0].spec.d_model}) before matching")
    for k, graph in enumerate(graphs[1:], start=1):
        check_same_structure(graphs[0], graph, ("model 0", f"model {k}") if len(graphs) > 2 else ("A", "B"))
    if options.method == "raw" and not narrower:  # the element-wise average of the checkpoints as loaded
        graphs = [PlainAverage(g) for g in graphs]
    elif options.method == "raw":
        embedding_notes.append("raw with a narrower model averages the canonical forms (checkpoints of different "
                               "shapes have no element-wise average)")
    reference = raw_reference(graphs, narrower, options)
    timings["load_s"] = time.perf_counter() - start

    template = loaded[0]
    data_spec = options.data or (DEFAULT_LM_DATA if template.task in ("causal-lm", "masked-lm") else None)
    data = eval_data(data_spec, template, options)
    context = MatchContext(options, template=template, eval_data=data, progress=progress)
    method = METHODS[options.method]
    # `self` data, sampled from the models: language models only (`self` asked for image models is refused by name)
    sampled = options.self_sampled(template.task)
    refining = options.refine_steps > 0 and out is not None
    refine_sampled = refining and options.refine_sampled(template.task)
    samples = self_samples(loaded, template, options, progress, timings) if sampled or refine_sampled else None
    if samples is not None and sampled:
        context.match_data = samples
    elif method.needs_data:
        context.match_data = data if (options.match_data or data_spec) == data_spec else eval_data(
            options.match_data, template, options, flag="--match-data")
    data_notes, am_split = [], False
    if method.learned:
        context.train_data, data, data_notes = training_data(options, template, context.match_data, data, data_spec,
                                                             samples)
        context.eval_data = data
    elif method.needs_data and context.match_data is data:
        context.match_data, data, data_notes = matching_split(options, template, data)
        am_split = True
        context.eval_data = data
    if refining and not method.learned:  # what --refine-steps trains on, as the learned methods would
        context.train_data, data, refine_notes = training_data(
            options, template, context.match_data if method.needs_data else data, data, data_spec,
            samples if refine_sampled else None)
        context.eval_data, data_notes = data, data_notes + refine_notes
    overlap, overlap_notes = fitting_overlap(method, context, data, options)
    refine_overlap, refine_overlap_notes = (fitting_overlap(method, context, data, options, refine=True)
                                            if refining and not method.learned else (None, []))
    if refining:
        from .match.refine import resumes_refinement
        if resumes_refinement(options.resume):  # the matching before it runs from its start
            context.options = dataclasses.replace(options, resume=None)
    start = time.perf_counter()
    alignment = method.run(graphs, context)
    timings["match_s"] = time.perf_counter() - start
    refined = refine_merged(graphs, alignment, loaded, context, data, options, progress) if refining else None
    if method.learned or refining:
        from .match.learned import is_main_process
        if not is_main_process():
            return MergeResult(None, alignment.transforms)
    if method.learned:
        alignment.settings["train_data"] = {**alignment.settings.get("train_data", {}),
                                            "digest": data_digest(context.train_data)}
        alignment.settings.setdefault("notes", []).extend(data_notes)
        sampled_peak = (samples.info.get("peak_memory") or {}).get("bytes") if samples is not None else None
        alignment.settings["memory_plan"] = {**memory_plan, "sampling_peak_bytes": sampled_peak}
    elif am_split:  # activation matching on one half of --data
        alignment.settings["match_data"] = {"split": "disjoint halves of --data, by document",
                                            "windows": len(context.match_data.inputs),
                                            "digest": data_digest(context.match_data)}
    if not method.learned:
        alignment.settings.setdefault("notes", []).extend(data_notes)
    if overlap is not None:
        alignment.settings["overlap"] = overlap
        alignment.settings.setdefault("notes", []).extend(overlap_notes)
    if samples is not None:
        recorded = ("tokens", "windows", "sampling", "per_model", "file", "reused")  # digest: as --data's is computed
        alignment.settings["self_samples"] = {"digest": data_digest(samples), **{k: samples.info[k] for k in recorded},
                                              "peak_memory": samples.info.get("peak_memory")}

    alignment.notes += embedding_notes
    export_bytes = sum(p.stat().st_size for p in template.files.files) if out is not None else 0
    with held([g if t.is_identity() else apply(g, t) for g, t in zip(graphs, alignment.transforms)], out,
              reserve=export_bytes) as aligned:
        report, evaluation = evaluate_report(names, aligned, alignment, template, data, data_spec, options, timings,
                                             progress, command or equivalent_command(names, options, out), reference)
        _, merged_at = evaluation_points(len(models), options)
        if template.spec.n_experts and len(aligned) == 2 and template.task == "causal-lm":
            from .evaluation.routing import routing_report
            report.routing = routing_report(aligned, template, data, merged_at)
        if refined is not None:
            from .evaluation.refined import evaluate_refined
            from .run_data import endpoint_loader
            load_fp32 = endpoint_loader(loaded, options.resolved_device(), None)
            report.refined = evaluate_refined(refined[0], [load_fp32(k) for k in range(len(loaded))], list(merged_at),
                                              data, options, refined[1], report.endpoint_loss, report.merged_loss)
            report.refined.update(memory_plan=refine_plan, overlap=refine_overlap or overlap)
            report.notes += refine_overlap_notes
        result = MergeResult(report, alignment.transforms, evaluation=evaluation)
        if out is not None:
            result.out = export(Path(out), force, models, aligned, merged_at, alignment, template, report, options,
                                names, refined=refined[0] if refined is not None else None)
    if json_path is not None:
        atomic_write(json_path, report_text(report))
    if push_to is not None:
        from .hub.push import push
        push(result.out, push_to, private=private)
    return result


def refine_merged(graphs: list, alignment: Alignment, loaded: list[Loaded], context: MatchContext, data: EvalData,
                  options: MergeOptions, progress: bool) -> tuple:
    """(the merged point trained towards the endpoints' ensemble, its record): match/refine.py, on every process of
    an `accelerate launch` run.  --resume is the refinement's when it names a refinement checkpoint."""
    from .match.refine import refine, resumes_refinement
    from .run_data import endpoint_loader
    _, merged_at = evaluation_points(len(graphs), options)
    point = interpolate([g if t.is_identity() else apply(g, t) for g, t in zip(graphs, alignment.transforms)],
                        list(merged_at))
    own = options if resumes_refinement(options.resume) else dataclasses.replace(options, resume=None)
    model, record = refine(point, context.template, endpoint_loader(loaded, "cpu", None), len(graphs),
                           list(merged_at), context.train_data, data, own, progress=progress)
    spec = options.train_data or (SELF_DATA if options.refine_sampled(data.task) else "one half of --data")
    record["train_data"].update(spec=spec, digest=data_digest(context.train_data))
    return model, record


def raw_reference(graphs: list, narrower: list[int], options: MergeOptions) -> list | None:
    """The unaligned models whose plain average's barrier a two-model merge reports beside its own (None: raw
    itself, N models, or --no-raw-reference); with a narrower model, the average of the canonical forms."""
    if len(graphs) != 2 or options.method == "raw" or options.no_raw_reference:
        return None
    return list(graphs) if narrower else [PlainAverage(g) for g in graphs]


def embeddable(wide: Loaded, other: Loaded) -> bool:
    """True when `other` differs from the first model only in widths it can be embedded exactly from (a
    narrower sibling); the merge is then written in the first model's configuration."""
    from .core.widths import can_embed
    same = dataclasses.replace(other.spec, notes=()) == dataclasses.replace(wide.spec, notes=())
    if same or wide.adapter is not other.adapter:
        return False
    why = can_embed(other.spec, wide.spec)
    if why is not None and can_embed(wide.spec, other.spec) is None:
        detail = "; ".join(f"{f}: {getattr(wide.spec, f)} vs {getattr(other.spec, f)}"
                           for f in wide.spec.__dataclass_fields__
                           if f != "notes" and getattr(wide.spec, f) != getattr(other.spec, f))
        raise IncompatibleModelsError(f"{other.source} is wider than {wide.source} ({detail}): put the widest "
                                      "model first (the merge is written in the first model's configuration)")
    return why is None


IN_MEMORY_BYTES = 2**30  # aligned models up to this size (fp32, all together) are held in memory


@contextmanager
def held(aligned: list, out: str | Path | None, reserve: int = 0):
    """The aligned models, computed once for the many points of the path: in memory when small; else a model whose
    transform rotates the residual stream (d x d products on every tensor) is spilled to fp32 files in a
    temporary folder (beside the output, removed at the end) and read one layer at a time, while one that is not
    transformed (--method raw) or only by per-head maps and permutations (weight matching's reference model: cheap
    products of head width) is recomputed from its checkpoint files wherever it is read.  Without disk room for
    the spill and `reserve` bytes more (the export, written while the spill exists), every model is recomputed."""
    from .core.symmetry import TransformedGraph
    from .sources.checkpoints import SpilledGraph, canonical_bytes
    if sum(canonical_bytes(g) for g in aligned) <= IN_MEMORY_BYTES:
        yield [g.materialise() for g in aligned]
        return
    parent = Path(out).expanduser().absolute().parent if out is not None else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    rotated = [isinstance(g, TransformedGraph) and g.t.rotation is not None for g in aligned]
    need = sum(canonical_bytes(g) for g, r in zip(aligned, rotated) if r)
    if need + reserve > 0.9 * shutil.disk_usage(parent or tempfile.gettempdir()).free:
        rotated = [False] * len(aligned)  # no room: every layer is recomputed where it is read (slower, same values)
    with tempfile.TemporaryDirectory(prefix=".hf-rebasin-aligned-", dir=parent) as folder:
        yield [SpilledGraph(g, Path(folder) / f"model-{k}") if r else g
               for k, (g, r) in enumerate(zip(aligned, rotated))]


def evaluation_points(n_models: int, options: MergeOptions) -> tuple[list[tuple[float, ...]], tuple[float, ...]]:
    """(the points evaluated, the merged point), as weight vectors over the models."""
    if n_models == 2:
        alpha = options.merge_alpha()
        return [(1.0 - lam, lam) for lam in lambda_grid(options.lambda_points())], (1.0 - alpha, alpha)
    return simplex_lattice(n_models, options.resolution(n_models)), tuple(1.0 / n_models for _ in range(n_models))


def evaluate_report(models, aligned, alignment: Alignment, template: Loaded, data: EvalData, data_spec: str,
                    options: MergeOptions, timings: dict, progress: bool, command: str | None,
                    reference: list | None = None) -> tuple[Report, dict]:
    """(the report, every window's losses: MergeResult.evaluation)."""
    from .hub.cards import source_license
    n = len(models)
    weights, merged_at = evaluation_points(n, options)
    device = options.resolved_device()
    start = time.perf_counter()
    results = evaluate_points(aligned, weights, template, data, options.batch_size, device, progress,
                              desc="barrier" if n == 2 else "simplex")
    losses = [r["loss"] for r in results]
    vertices = [weights.index(tuple(1.0 if j == i else 0.0 for j in range(n))) for i in range(n)]
    endpoint_loss = [losses[k] for k in vertices]
    excess, worst = worst_excess(weights, losses, endpoint_loss)
    on_grid = [k for k, w in enumerate(weights) if all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(w, merged_at))]
    merged_loss = losses[on_grid[0]] if on_grid else evaluate(
        instantiate(interpolate(aligned, list(merged_at)), template), data, options.batch_size, device)["loss"]
    timings["barrier_s"] = time.perf_counter() - start
    raw_barrier = None
    if reference is not None:  # the endpoints are the same models (transforms are exact): only the inside points
        start = time.perf_counter()
        inside = [k for k in range(len(weights)) if k not in vertices]
        try:
            with held(reference, None) as graphs:
                found = evaluate_points(graphs, [weights[k] for k in inside], template, data, options.batch_size,
                                        device, progress, desc="raw reference")
        except IncompatibleModelsError as error:  # a reference only: the merge itself does not depend on it
            print(f"hf-rebasin: no raw reference ({error})", file=sys.stderr, flush=True)
        else:
            raw_losses = list(losses)
            for k, result in zip(inside, found):
                raw_losses[k] = result["loss"]
            raw_excess, raw_worst = worst_excess(weights, raw_losses, endpoint_loss)
            raw_barrier = raw_excess[raw_worst]
            timings["raw_reference_s"] = time.perf_counter() - start
    units = evaluation_units(data, template)
    intervals = barrier_intervals(results, weights, vertices, units, data.task)

    metric = "perplexity" if data.task == "causal-lm" else "accuracy"
    lambdas = [w[1] for w in weights] if n == 2 else [list(w) for w in weights]
    settings = {**alignment.settings, "batch_size": options.batch_size}
    if options.uses_rounds():
        settings["rounds"] = options.rounds
    settings["protocol"] = options.protocol  # li-shen evaluates the whole split: no cap
    cap = options.max_eval_tokens if options.protocol == "default" else None
    settings.update({"lambdas": options.lambda_points(), "seq_len": (data.info or {}).get("seq_len"),
                     "max_eval_tokens": cap} if n == 2 else
                    {"simplex_resolution": options.resolution(n)})
    licences = {source_license(s) for s in models}
    notes = list(aligned[0].spec.notes) + alignment.notes + list(alignment.settings.get("notes", []))
    report = Report(
        method=options.method, models=list(models), lambdas=lambdas, loss=losses, barrier=excess[worst],
        architecture=template.adapter.architecture, task=data.task, n_models=n,
        alpha=merged_at[1] if n == 2 else list(merged_at), **{metric: [r[metric] for r in results]},
        excess=excess, endpoint_loss=endpoint_loss, barrier_lambda=lambdas[worst], merged_loss=merged_loss,
        raw_barrier=raw_barrier,
        method_description=METHODS[options.method].description,
        data={**(data.info or {}), "spec": data_spec, "digest": data_digest(data)}, settings=settings,
        match_log=alignment.log, timings=timings,
        versions=installed_versions(), command=command or equivalent_command(models, options),
        notes=notes, license=licences.pop() if len(licences) == 1 else None, hf_rebasin_version=__version__,
        **intervals)
    evaluation = {"window_loss": [r["window_loss"] for r in results], "window_count": results[0]["window_count"],
                  "units": [int(u) for u in units], "weights": [list(w) for w in weights], "vertices": vertices}
    return report, evaluation


def evaluation_units(data: EvalData, template: Loaded) -> list:
    """The bootstrap unit of each evaluated example: its document (the data's own record of them, else found by EOS
    tokens), each window where the data has no document boundaries, each image for classifiers."""
    from .evaluation.intervals import units_of
    from .sources.splits import eos_token_id
    if data.task != "causal-lm":
        return list(range(len(data.inputs)))
    if data.units is not None:
        return list(data.units)
    return list(units_of(data.inputs.numpy(), eos_token_id(template)))


def barrier_intervals(results: list[dict], weights, vertices: list[int], units: list, task: str) -> dict:
    """The bootstrap intervals of every point's loss and of the barrier (evaluation/intervals.py) over `units`."""
    from .evaluation.intervals import path_intervals
    intervals = path_intervals([r["window_loss"] for r in results], results[0]["window_count"], units, weights,
                               vertices)
    unit = "images" if task == "image-classification" else "windows" if len(set(units)) == len(units) else "documents"
    intervals["bootstrap"]["unit"] = unit
    return intervals


def equivalent_command(models: list[str], options: MergeOptions, out: str | Path | None = None) -> str:
    """The `hf-rebasin merge` line that repeats an API call (options that differ from their defaults)."""
    import dataclasses
    import shlex

    from .options import flag_of
    words = ["hf-rebasin", "merge" if out is not None else "barrier", *models]
    defaults = MergeOptions()
    for f in dataclasses.fields(MergeOptions):
        value = getattr(options, f.name)
        if value == getattr(defaults, f.name):
            continue
        words += [flag_of(f)] if value is True else [flag_of(f), str(value)]
    return shlex.join(words + (["--out", str(out)] if out is not None else []))


# --- the output folder ------------------------------------------------------------------------------

def transforms_tensors(transforms: list[Transform]) -> dict:
    """transforms.safetensors: two models under a. and b., N models under 0., 1., ..."""
    names = ["a", "b"] if len(transforms) == 2 else [str(k) for k in range(len(transforms))]
    return {f"{name}.{key}": value for name, t in zip(names, transforms) for key, value in t.to_tensors().items()}


def export(out: Path, force: bool, models: list[str], aligned, merged_at, alignment: Alignment, template: Loaded,
           report: Report, options: MergeOptions, names: list[str] | None = None, refined=None) -> Path:
    """The output folder; with `refined` (--refine-steps) its weights are the checkpoint written (the unrefined
    merge is not: the transforms and the same command without --refine-steps give it)."""
    from .hub.cards import write_card
    with atomic_output_dir(out, force=force, sources=tuple(models), data=data_specs(options)) as tmp:
        start = time.perf_counter()
        if refined is not None:
            save_trained(refined, interpolate(aligned, list(merged_at)), template, tmp, dtype=options.export_dtype(),
                         max_shard_bytes=options.shard_bytes())
        else:
            save(interpolate(aligned, list(merged_at)), template, tmp, dtype=options.export_dtype(),
                 max_shard_bytes=options.shard_bytes())
        with ShardWriter(tmp, "transforms", options.shard_bytes(), {"method": report.method}) as writer:
            for name, tensor in transforms_tensors(alignment.transforms).items():
                writer.add(name, tensor)
        report.timings["export_s"] = time.perf_counter() - start
        atomic_write(tmp / "barrier.json", report_text(report))
        if len(models) == 2:
            title = " × ".join(Path(m).name for m in names or models)
            plot_path({report.method: report.to_dict()}, tmp / "barrier.png", f"{title}  ({report.method})")
        else:
            plot_simplex(report.to_dict(), tmp / "barrier.png", names or models)
        write_card(tmp, model_name=out.name)
    return out.expanduser().absolute()


def demo(out: str | Path = "runs/demo", *, progress: bool = True) -> dict[str, Report]:
    """The README's main job: merge the bundled example pair offline, raw and weight matching."""
    from .assets import example_pair
    pair = example_pair()
    reports = {}
    for method in ("raw", "wm"):
        options = MergeOptions(method=method, data=str(pair / "heldout.txt"), seq_len=128, max_eval_tokens=16384,
                               no_raw_reference=method == "wm")  # the demo merges raw itself
        target = Path(out) / method
        result = run([str(pair / "model-a"), str(pair / "model-b")], options, out=target,
                     force=(target / "barrier.json").is_file(), progress=progress)
        reports[method] = result.report
    return reports
