"""The model card (README.md) of a merge output: Hub metadata (base models, tags, license, model-index)
and a body that says what was merged, how, the loss barrier along the path and how to reproduce it.

Everything comes from the files the merge wrote: ``barrier.json`` (required) and ``eval.json`` (optional).
A card is meant to be published: it never shows a local absolute path (a local folder appears by its
name, a path relative to the working folder as it was given, a Hub id as it is)."""
from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..assets import card_template
from ..evaluation.report import Report, read_json, read_report
from ..export.io import atomic_write
from ..sources.backends import BACKENDS, is_hub_id

PIPELINE_TAGS = {"causal-lm": "text-generation", "masked-lm": "fill-mask",
                 "image-classification": "image-classification"}
CARD_DESCRIPTIONS = {
    "wm": "weight matching (data-free: residual rotation, head permutations, per-head maps, FFN permutations)",
    "wm-perm": "weight matching restricted to permutations (data-free)",
    "am": "activation matching over the full group (residual rotation and assignments from activations on data)",
    "am-perm": "activation matching restricted to permutations (assignments from activation correlations on data)",
    "raw": "none: the checkpoints are averaged element-wise as loaded (the papers' raw interpolation, baseline)",
    "lm": "learned matching (the symmetry parameters of every model but A trained on the loss along the path)",
    "dual": "dual learned matching, LMC-DM (every endpoint carries trained symmetry parameters)",
}


# --- what may be published ------------------------------------------------------------------------

def public_name(text: str) -> str:
    """A source, data spec or path as a card may show it: absolute and home paths by their last name."""
    text = str(text)
    if text.startswith(("/", "~")) or re.match(r"^[A-Za-z]:[\\/]", text):
        return Path(text.rstrip("/")).name or text
    if ":" in text and not text.startswith(("http://", "https://")):  # a datasets spec NAME:CONFIG:SPLIT
        return ":".join(public_name(part) for part in text.split(":"))
    return text


def public_command(command: str) -> str:
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    out = []
    for word in words:
        flag, sep, value = word.partition("=")
        out.append(f"{flag}={public_name(value)}" if sep and flag.startswith("--") else public_name(word))
    return shlex.join(out)


def public_value(value):
    if isinstance(value, str):
        return public_name(value)
    if isinstance(value, list):
        return [public_value(v) for v in value]
    if isinstance(value, dict):
        return {k: public_value(v) for k, v in value.items()}
    return value


def settings_rows(settings: dict, prefix: str = "") -> list[tuple[str, str]]:
    """Nested settings as (dotted name, value) rows; lists of numbers shown whole, notes left to Caveats."""
    rows = []
    for key, value in settings.items():
        if key == "notes":
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += settings_rows(value, f"{name}.")
        else:
            shown = public_value(value)
            rows.append((name, "none" if shown is None else str(shown)))
    return rows


def source_license(source: str) -> str | None:
    try:
        card = ModelCard.load(Path(source) / "README.md" if Path(source).is_dir() else source)
        return card.data.to_dict().get("license")
    except Exception:  # noqa: BLE001 - no card, no licence
        return None


def local_inputs(report: Report) -> list[str]:
    """The models and data of a report that are local files or folders (not Hub ids or datasets), as a card
    names them: the Reproduce line cannot fetch them."""
    from ..sources.data_specs import looks_like_path
    spec = report.data.get("spec")
    data = [spec] if spec and (looks_like_path(spec) or Path(spec).expanduser().exists()) else []
    names = [public_name(m) for m in report.models if not is_hub_id(m)] + [public_name(d) for d in data]
    return list(dict.fromkeys(names))


# --- tables ---------------------------------------------------------------------------------------

def number(value, digits: int = 4) -> str:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return f"{value:.{digits}f}"
    if isinstance(value, list):
        return "(" + ", ".join(number(v, 2) for v in value) + ")"
    return str(value)


def labels(n: int) -> list[str]:
    return [chr(ord("A") + i) if i < 26 else f"M{i}" for i in range(n)]


def barrier_table(report: Report) -> tuple[list[str], list[list[str]]]:
    extra = [(key, digits) for key, digits in (("perplexity", 2), ("accuracy", 4)) if getattr(report, key)]
    two = report.n_models == 2
    header = (["λ"] if two else [f"w ({', '.join(labels(report.n_models))})"]) + ["loss"]
    header += [f"loss, {100 * report.bootstrap['level']:g} % interval"] if report.loss_interval else []
    header += ["excess over the endpoint line" if two else "excess over the endpoint plane"] if report.excess else []
    header += [key for key, _ in extra]
    rows = []
    for i, lam in enumerate(report.lambdas):
        row = [number(lam, 2), number(report.loss[i])]
        row += [f"[{number(report.loss_interval[i][0])}, {number(report.loss_interval[i][1])}]"] \
            if report.loss_interval else []
        row += [number(report.excess[i])] if report.excess else []
        rows.append(row + [number(getattr(report, key)[i], digits) for key, digits in extra])
    return header, rows


def metric_name(key: str) -> str:
    return key.split(",")[0]  # lm-eval writes "acc,none"; keep "acc"


def eval_metrics(task_results: dict) -> dict[str, tuple[float, float | None]]:
    """{metric: (value, stderr or None)} of one task's lm-eval results."""
    flat = {metric_name(k): v for k, v in task_results.items() if isinstance(v, (int, float))}
    return {k: (v, flat.get(f"{k}_stderr")) for k, v in flat.items() if not k.endswith("_stderr")}


def eval_table(evals: dict) -> tuple[list[str], list[list[str]]]:
    results = evals.get("results", {})
    columns = ["merged"] + [c for c in results if c != "merged"] if "merged" in results else list(results)
    header = ["task", "metric"] + [f"{c} (`{public_name(evals.get('models', {}).get(c, c))}`)" if c != "merged" else c
                                   for c in columns]
    rows = []
    for task in evals.get("tasks") or list(results.get("merged", {})):
        for metric in eval_metrics(results.get("merged", {}).get(task, {})):
            cells = [eval_metrics(results[c].get(task, {})).get(metric, (None, None)) for c in columns]
            rows.append([task, metric] + [score(value, stderr) for value, stderr in cells])
    return header, rows


def score(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "–"
    return number(value) + (f" ± {number(stderr)}" if stderr is not None else "")


def eval_results(report: Report, evals: dict | None) -> list[EvalResult]:
    task_type = PIPELINE_TAGS.get(report.task, "text-generation")
    spec = public_name(report.data.get("spec", "unknown"))
    where = f"at λ = {report.alpha}" if report.n_models == 2 else "at the centroid"
    results = [EvalResult(task_type=task_type, dataset_type=spec, dataset_name=spec, metric_type="loss_barrier",
                          metric_name="loss barrier (max over λ)", metric_value=report.barrier)]
    merged = report.merged_metric()
    pairs = (("loss", report.merged_loss), (report.metric, merged))
    if report.refined:  # the checkpoint is the refined model: its own figures
        where = f"{where}, then trained {report.refined['steps']} steps towards the endpoints' ensemble"
        pairs = (("loss", report.refined.get("loss")), (report.metric, report.refined.get(report.metric)))
    for key, value in pairs:
        if value is not None:
            results.append(EvalResult(task_type=task_type, dataset_type=spec, dataset_name=spec, metric_type=key,
                                      metric_name=f"{key} {where}", metric_value=value))
    if evals:
        shots = evals.get("num_fewshot", 0)
        for task, task_results in evals.get("results", {}).get("merged", {}).items():
            for metric, (value, _) in eval_metrics(task_results).items():
                results.append(EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                                          dataset_args={"num_few_shot": shots}, metric_type=metric,
                                          metric_name=f"{metric} ({shots}-shot)", metric_value=value))
    return [r for r in results if isinstance(r.metric_value, (int, float)) and math.isfinite(r.metric_value)]


def data_detail(data: dict) -> str:
    if "tokens" in data:  # predicted tokens (a window of S tokens predicts S - 1)
        protocol = f", protocol {data['protocol']}" if data.get("protocol") else ""
        if data.get("seq_len") and data.get("windows"):
            return (f"{data['tokens']:,} predicted tokens ({data['windows']:,} windows of {data['seq_len']} tokens"
                    f"{protocol})")
        return f"{data['tokens']:,} predicted tokens" + (f" ({protocol[2:]})" if protocol else "")
    if "examples" in data:
        return f"{data['examples']:,} examples"
    return ""


def self_samples_line(report: Report) -> str | None:
    """What `--train-data self` / `--match-data self` sampled, or None."""
    samples = report.settings.get("self_samples")
    if not samples:
        return None
    sampling = samples.get("sampling", {})
    use = "trained on" if report.method in ("lm", "dual") else "matched on"
    if report.refined and report.method not in ("am", "am-perm", "lm", "dual"):
        use = "the refinement after merging trained on"
    chain = sampling.get("chain", 1)
    carried = sampling.get("carried")
    texts = (f"texts starting with token {sampling.get('start_token')}, each over up to {chain} windows, the next "
             f"beginning with the last {'token' if carried == 1 else f'{carried} tokens'} of the one before"
             if chain > 1 else
             f"each starting with token {sampling.get('start_token')}")
    share = report.settings.get("learned", {}).get("soft_targets") if use == "trained on" else None
    target = (f"; the target {share:g} × the models' own prediction at the step's λ, mixed, and {1 - share:g} × the "
              "sampled next token" if share else "")
    return (f"{use} {samples['tokens']:,} predicted tokens of text sampled from the models themselves "
            f"({samples['windows']:,} "
            f"windows of {sampling.get('seq_len')} tokens, {' / '.join(map(str, samples.get('per_model', [])))} "
            f"per model; {texts}; temperature "
            f"{sampling.get('temperature')}, top-p {sampling.get('top_p')}, seed {sampling.get('seed')}; token file "
            f"digest {samples.get('digest')}{target})")


def refined_text(report: Report) -> str | None:
    """What --refine-steps did to the checkpoint, in words (None: nothing)."""
    r = report.refined
    if not r:
        return None
    amount = f"{r['tokens']:,} tokens" if "tokens" in r else f"{r.get('images', 0):,} images"
    data = r.get("train_data") or {}
    samples = report.settings.get("self_samples")
    if data.get("spec") and data.get("spec") != "self":
        on = f"`{public_name(data['spec'])}`"
    elif samples:
        on = f"{samples['tokens']:,} tokens of text sampled from the endpoints themselves"
    else:
        on = "the training data of the run"
    ends = " / ".join(number(x) for x in r.get("endpoint_loss", []))
    return (f"**This checkpoint was trained after merging.** It is not the interpolated model: every weight of the "
            f"merged model was then trained for {r['steps']:,} steps ({amount}, batches of {r['batch_size']}, AdamW "
            f"at {r['lr']:g}, {r['train_s']:.0f} s on {r.get('device', 'unknown')}) to predict the endpoints' ensemble "
            f"(the average of their predicted distributions) on {on}. Held-out loss: {number(r['loss'])} after "
            f"training, {number(r.get('merged_loss'))} for the merged model before it, {number(r['ensemble_loss'])} "
            f"for the ensemble of the endpoints, {ends} for the endpoints. The loss barrier below is that of the "
            "aligned interpolation path, before the training.")


def merged_point(report: Report) -> str:
    if report.n_models == 2 and isinstance(report.alpha, (int, float)):
        return f"λ = {report.alpha} on the path from A (λ = 0) to B (λ = 1)"
    return f"weights {number(report.alpha)} of the aligned models (the centroid)"


def library_name(report: Report) -> str:
    from ..adapters import REGISTRY
    adapter = REGISTRY.get(report.architecture)
    if adapter is not None:
        return adapter.backend
    return next((b.name for b in BACKENDS.values() if b.task == report.task), "transformers")


# --- the card -------------------------------------------------------------------------------------

def barrier_text(report: Report) -> str:
    """The barrier with its bootstrap interval (evaluation/intervals.py), when the report has one."""
    if not report.barrier_interval:
        return number(report.barrier)
    low, high = report.barrier_interval
    b = report.bootstrap
    return (f"{number(report.barrier)} ({100 * b['level']:g} % interval [{number(low)}, {number(high)}], "
            f"{b['resamples']} bootstrap resamples of {b['units']} {b.get('unit', 'units')}, seed {b['seed']})")


def routing_line(routing: dict) -> str | None:
    """One line for the model card on a merged mixture of experts (evaluation/routing.py), None otherwise."""
    if not routing or "skipped" in routing:
        return None
    mean = lambda xs: sum(xs) / len(xs)
    spread = lambda name: max(max(layer) for layer in routing["load"][name])
    return (f"Routing at the merged point ({routing['tokens']} tokens, {routing['experts']} experts, top-"
            f"{routing['top_k']}): the top-k set changed for {mean(routing['top_k_changed']['merged_vs_A']):.1%} of "
            f"tokens against A and {mean(routing['top_k_changed']['merged_vs_B']):.1%} against B (mean over layers); "
            f"the busiest expert takes {spread('merged'):.1%} of the routed slots (A {spread('A'):.1%}, "
            f"B {spread('B'):.1%}); per layer and expert in barrier.json (`routing`).")


def render_card(out_dir: str | Path, *, model_name: str | None = None) -> ModelCard:
    """The model card of a merge output folder (read from its barrier.json and, if present, eval.json).
    model_name: the name it is published under (default: the folder's name)."""
    out_dir = Path(out_dir)
    report = read_report(out_dir)
    evals = read_json(out_dir / "eval.json") if (out_dir / "eval.json").is_file() else None
    model_name = model_name or out_dir.resolve().name
    hub_sources = [m for m in report.models if is_hub_id(m)]
    card_data = ModelCardData(
        base_model=hub_sources or None, base_model_relation="merge" if hub_sources else None,
        library_name=library_name(report), pipeline_tag=PIPELINE_TAGS.get(report.task),
        license=report.license or None, tags=["merge", "hf-rebasin", report.method], model_name=model_name,
        eval_results=eval_results(report, evals))
    barrier_header, barrier_rows = barrier_table(report)
    eval_header, eval_rows = eval_table(evals) if evals else ([], [])
    return ModelCard.from_template(
        card_data, template_path=str(card_template()), title=model_name,
        sources=[{"label": label, "name": public_name(m)}
                 for label, m in zip(labels(len(report.models)), report.models)],
        architecture=report.architecture, method=report.method,
        method_description=CARD_DESCRIPTIONS.get(report.method, report.method_description or report.method),
        merged_point=merged_point(report),
        data={"spec": public_name(report.data.get("spec", "unknown")), "detail": data_detail(report.data)},
        self_samples=self_samples_line(report), refined=refined_text(report),
        settings=settings_rows(report.settings),
        timings=", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in report.timings.items()
                          if isinstance(v, (int, float))),
        versions=", ".join(f"{k} {v}" for k, v in report.versions.items() if v),
        barrier=barrier_text(report), barrier_lambda=number(report.barrier_lambda, 2),
        merged_loss=number(report.merged_loss),
        barrier_header=barrier_header, barrier_rows=barrier_rows, eval_header=eval_header, eval_rows=eval_rows,
        eval_fewshot=(evals or {}).get("num_fewshot", 0), eval_limit=(evals or {}).get("limit"),
        command=public_command(report.command), local_inputs=local_inputs(report),
        notes=report.notes, routing=routing_line(report.routing))


def write_card(out_dir: str | Path, *, model_name: str | None = None) -> Path:
    """Render the card and write it to out_dir/README.md atomically (temp file next to it, then rename)."""
    text = str(render_card(out_dir, model_name=model_name))
    return atomic_write(Path(out_dir) / "README.md", text)
