"""The model card (README.md) of a merge output: Hub metadata (base models, tags, license, model-index)
and a body that says what was merged, how, the loss barrier along the path and how to reproduce it.

Everything comes from the files the merge wrote: ``barrier.json`` (required) and ``eval.json`` (optional)."""
from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .assets import card_template
from .cli import UserError

TEMPLATE = card_template()

METHODS = {
    "wm": "weight matching (data-free: residual rotation, head permutations, per-head maps, FFN permutations)",
    "wm-perm": "weight matching restricted to permutations (data-free)",
    "am": "activation matching (assignments from activation correlations on data)",
    "raw": "none: the unaligned weights are interpolated directly (baseline)",
    "lm": "learned matching (the symmetry parameters of B trained on the loss along the path)",
    "dual": "dual learned matching, LMC-DM (both endpoints carry trained symmetry parameters)",
}
REQUIRED_KEYS = ("method", "models", "lambdas", "loss", "barrier")
PIPELINE_TAGS = {"causal-lm": "text-generation", "image-classification": "image-classification"}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not valid JSON ({error}); re-run the command that wrote it") from error


def read_barrier(out_dir: str | Path) -> dict:
    path = Path(out_dir) / "barrier.json"
    if not path.is_file():
        raise UserError(f"{out_dir} is not an hf-rebasin merge output (no barrier.json)")
    barrier = read_json(path)
    missing = [key for key in REQUIRED_KEYS if key not in barrier]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: it was not written by this version of hf-rebasin "
                        "merge; re-run the merge")
    return barrier


def is_hub_id(source: str) -> bool:
    """A source that names a Hub repository (not a local folder); only those may go in base_model."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    if source.startswith((".", "/", "~")) or Path(source).expanduser().exists():
        return False
    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


def library_name(barrier: dict) -> str:
    from .adapters import REGISTRY
    adapter = REGISTRY.get(barrier.get("architecture", ""))
    if adapter is not None:
        return adapter.library
    return "timm" if barrier.get("task") == "image-classification" else "transformers"


def number(value, digits: int = 4) -> str:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return f"{value:.{digits}f}"
    return str(value)


def merged_value(barrier: dict, key: str) -> float | None:
    """The merged model's value of a per-λ metric: its entry at λ = alpha when alpha is on the grid."""
    values, lambdas = barrier.get(key), barrier.get("lambdas") or []
    if not values or barrier.get("alpha") not in lambdas:
        if key == "perplexity" and barrier.get("merged_loss") is not None and barrier.get("task") == "causal-lm":
            return math.exp(min(barrier["merged_loss"], 700.0))  # beyond that it is inf, dropped later anyway
        return None
    return values[lambdas.index(barrier["alpha"])]


def barrier_table(barrier: dict) -> tuple[list[str], list[list[str]]]:
    lambdas, losses = barrier.get("lambdas") or [], barrier.get("loss") or []
    endpoints = barrier.get("endpoint_loss") or []
    extra = [(key, label, digits) for key, label, digits in
             (("perplexity", "perplexity", 2), ("accuracy", "accuracy", 4)) if barrier.get(key)]
    with_excess = len(endpoints) == 2 and all(isinstance(lam, (int, float)) for lam in lambdas)
    header = ["λ", "loss"] + (["excess over the endpoint line"] if with_excess else []) + [e[1] for e in extra]
    rows = []
    for i, lam in enumerate(lambdas):
        row = [number(lam, 2), number(losses[i])]
        if with_excess:
            row.append(number(losses[i] - ((1 - lam) * endpoints[0] + lam * endpoints[1])))
        rows += [row + [number(barrier[key][i], digits) for key, _, digits in extra]]
    return header, rows


def metric_name(key: str) -> str:
    return key.split(",")[0]  # lm-eval writes "acc,none"; keep "acc"


def eval_metrics(task_results: dict) -> dict[str, tuple[float, float | None]]:
    """{metric: (value, stderr or None)} of one task's lm-eval results."""
    flat = {metric_name(k): v for k, v in task_results.items() if isinstance(v, (int, float))}
    return {k: (v, flat.get(f"{k}_stderr")) for k, v in flat.items() if not k.endswith("_stderr")}


def eval_table(evals: dict) -> tuple[list[str], list[list[str]]]:
    columns = [c for c in ("merged", "A", "B") if c in evals.get("results", {})]
    header = ["task", "metric"] + [f"{c} (`{evals.get('models', {}).get(c, c)}`)" if c != "merged" else c
                                   for c in columns]
    rows = []
    for task in evals.get("tasks") or list(evals["results"].get("merged", {})):
        for metric in eval_metrics(evals["results"].get("merged", {}).get(task, {})):
            cells = [eval_metrics(evals["results"][c].get(task, {})).get(metric, (None, None)) for c in columns]
            rows.append([task, metric] + [score(value, stderr) for value, stderr in cells])
    return header, rows


def score(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "–"
    return number(value) + (f" ± {number(stderr)}" if stderr is not None else "")


def eval_results(barrier: dict, evals: dict | None) -> list[EvalResult]:
    task_type = PIPELINE_TAGS.get(barrier.get("task"), "text-generation")
    spec = (barrier.get("data") or {}).get("spec", "unknown")
    where = f"at λ = {barrier.get('alpha')}"
    results = [EvalResult(task_type=task_type, dataset_type=spec, dataset_name=spec, metric_type="loss_barrier",
                          metric_name="loss barrier (max over λ)", metric_value=barrier["barrier"])]
    for key, value in (("loss", barrier.get("merged_loss")), ("perplexity", merged_value(barrier, "perplexity")),
                       ("accuracy", merged_value(barrier, "accuracy"))):
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
    if "tokens" in data:
        return f"{data['tokens']:,} tokens" + (f" in sequences of {data['seq_len']}" if data.get("seq_len") else "")
    if "examples" in data:
        return f"{data['examples']:,} examples"
    return ""


def merged_point(barrier: dict) -> str:
    alpha = barrier.get("alpha")
    if len(barrier.get("models", [])) == 2 and isinstance(alpha, (int, float)):
        return f"λ = {alpha} on the path from A (λ = 0) to B (λ = 1)"
    return f"weights {alpha} of the aligned models"


def render_card(out_dir: str | Path, *, model_name: str | None = None) -> ModelCard:
    """The model card of a merge output folder (read from its barrier.json and, if present, eval.json)."""
    out_dir = Path(out_dir)
    barrier = read_barrier(out_dir)
    evals = read_json(out_dir / "eval.json") if (out_dir / "eval.json").is_file() else None
    model_name = model_name or out_dir.resolve().name
    method = barrier.get("method", "unknown")
    hub_sources = [str(m) for m in barrier.get("models", []) if is_hub_id(str(m))]
    card_data = ModelCardData(
        base_model=hub_sources or None,
        base_model_relation="merge" if hub_sources else None,
        library_name=library_name(barrier),
        pipeline_tag=PIPELINE_TAGS.get(barrier.get("task")),
        license=barrier.get("license") or None,
        tags=["merge", "hf-rebasin", method],
        model_name=model_name,
        eval_results=eval_results(barrier, evals),
    )
    barrier_header, barrier_rows = barrier_table(barrier)
    eval_header, eval_rows = eval_table(evals) if evals else ([], [])
    timings, data = barrier.get("timings") or {}, barrier.get("data") or {}
    return ModelCard.from_template(
        card_data, template_path=str(TEMPLATE),
        title=model_name,
        sources=[{"label": chr(ord("A") + i), "name": m} for i, m in enumerate(barrier.get("models", []))],
        architecture=barrier.get("architecture", "unknown"),
        method=method, method_description=METHODS.get(method, method),
        merged_point=merged_point(barrier),
        data={"spec": data.get("spec", "unknown"), "detail": data_detail(data)},
        settings=[f"{k}={v}" for k, v in (barrier.get("settings") or {}).items()],
        timings=", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in timings.items()
                          if isinstance(v, (int, float))),
        versions=", ".join(f"{k} {v}" for k, v in (barrier.get("versions") or {}).items() if v),
        barrier=number(barrier["barrier"]), barrier_lambda=number(barrier.get("barrier_lambda"), 2),
        merged_loss=number(barrier.get("merged_loss")),
        barrier_header=barrier_header, barrier_rows=barrier_rows,
        eval_header=eval_header, eval_rows=eval_rows,
        eval_fewshot=(evals or {}).get("num_fewshot", 0), eval_limit=(evals or {}).get("limit"),
        command=barrier.get("command", ""),
        notes=barrier.get("notes") or [],
    )


def write_card(out_dir: str | Path, *, model_name: str | None = None) -> Path:
    """Render the card and write it to out_dir/README.md atomically (temp file next to it, then rename)."""
    out_dir = Path(out_dir)
    text = str(render_card(out_dir, model_name=model_name))
    target = out_dir / "README.md"
    tmp = target.with_name(f".README.md.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8", newline="")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target
