"""``hf-rebasin eval``: zero-shot lm-eval scores of a merged language model (and its endpoints).

Li & Shen report PIQA, SciQ and ARC-Easy zero-shot accuracy of merged Pythia models; this command runs
those (or any lm-eval task) through lm-eval's Python API on the merged model held in memory, writes
``DIR/eval.json`` and refreshes the model card with the table."""
from __future__ import annotations

import difflib
import importlib
import json
import logging
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any
from unittest import mock

from ..errors import UserError
from ..evaluation.report import read_report
from ..export.io import atomic_write, edited_dir
from ..export.ownership import check_editable_dir, record_files
from ..options import EvalOptions, resolve_device
from ..requirements import installed_versions

DEFAULT_TASKS = ("piqa", "sciq", "arc_easy")
DEFAULT_BATCH_SIZE = 8
NUM_FEWSHOT = 0
EVAL_FILE = "eval.json"
OFFLINE_HINT = ("If you are offline, either set HF_DATASETS_OFFLINE=1 with the dataset already in the "
                "datasets cache (HF_DATASETS_CACHE), or pass --include-path with a folder of task YAMLs "
                "whose dataset_path/data_files point at local files")


@dataclass
class TaskSet:
    """Validated lm-eval tasks with their data loaded: built once, evaluated on every model."""
    names: list[str]
    manager: Any  # lm_eval.tasks.TaskManager
    objects: list = field(default_factory=list)  # top-level lm-eval Task / Group objects


@dataclass
class Outcome:
    metrics: dict[str, dict[str, float | None]]
    samples: dict[str, int]
    seconds: float


# --- tasks ----------------------------------------------------------------------------------------

def parse_task_names(text: str | Sequence[str]) -> list[str]:
    parts = text.split(",") if isinstance(text, str) else list(text)
    names = list(dict.fromkeys(p.strip() for p in parts if p.strip()))
    if not names:
        raise UserError("no task given: pass --tasks with comma-separated lm-eval task names, e.g. piqa,sciq,arc_easy")
    return names


def include_paths(include_path: str | Path | Sequence[str | Path] | None) -> tuple[str, ...]:
    if include_path is None:
        return ()
    raw = [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
    paths = []
    for path in raw:
        if not Path(path).is_dir():
            raise UserError(f"--include-path {path} is not a folder: pass the folder that holds your lm-eval "
                            "task YAMLs")
        paths.append(str(Path(path).resolve()))
    return tuple(paths)


@lru_cache(maxsize=4)
def task_manager(paths: tuple[str, ...], include_defaults: bool):
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=list(paths) or None, include_defaults=include_defaults)


def is_plain_task(manager, name: str) -> bool:
    from lm_eval.tasks._index import Kind
    entry = manager.task_index.get(name)
    return entry is not None and entry.kind in (Kind.TASK, Kind.PY_TASK)


def choose_task_manager(names: list[str], paths: tuple[str, ...]):
    """The include-path tasks alone when they cover every name (indexing lm-eval's ~15k built-in
    task files takes seconds); otherwise the built-in tasks plus the include path."""
    if paths:
        local = task_manager(paths, False)
        if all(is_plain_task(local, name) for name in names):
            return local
    return task_manager(paths, True)


def unknown_task_message(unknown: list[str], manager, paths: tuple[str, ...]) -> str:
    lines = []
    for name in unknown:
        close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.6)
        lines.append(f"unknown lm-eval task {name!r}" + (f" (did you mean: {', '.join(close)}?)" if close else ""))
    where = "lm-eval's built-in tasks" + (f" and {', '.join(paths)}" if paths else "")
    return ("; ".join(lines) + f". Searched {where}. See the available tasks with `lm-eval ls tasks`"
            + (" --include_path ..." if paths else "")
            + ", or pass --include-path with a folder of task YAMLs (files that fail to parse are skipped)")


def top_level(loaded: dict) -> list:
    """The requested objects of a TaskManager.load result: groups that are nobody's child, and tasks
    outside every group (so lm-eval still aggregates groups)."""
    children = {child for kids in loaded.get("group_map", {}).values() for child in kids}
    groups = [g for name, g in loaded.get("groups", {}).items() if name not in children]
    grouped = {t.task_name for g in loaded.get("groups", {}).values() for t in g.get_all_tasks()}
    return groups + [t for name, t in loaded["tasks"].items() if name not in grouped]


def load_task(manager, name: str) -> dict:
    from ..sources.hub_access import cache_only, hub_unreachable
    try:
        with cache_only():  # the Hub unreachable: lm-eval's datasets from the cache, no retries
            return manager.load([name])
    except OSError as error:  # ConnectionError, FileNotFoundError, DatasetNotFoundError, timeouts
        why = hub_unreachable()
        detail = " ".join(str(error).split())
        raise UserError(f"the data of lm-eval task {name!r} could not be fetched ({type(error).__name__}: {detail})"
                        + (f"; {why}" if why else "") + f". {OFFLINE_HINT}") from error
    except UserError:
        raise
    except Exception as error:  # a broken task config is the user's input
        raise UserError(f"could not build lm-eval task {name!r}: {type(error).__name__}: {error}") from error


def prepare_tasks(tasks: str | Sequence[str], include_path=None) -> TaskSet:
    """Check the task names and load their data, before any model is loaded."""
    names = parse_task_names(tasks)
    paths = include_paths(include_path)
    manager = choose_task_manager(names, paths)
    unknown = [n for n in names
               if n not in manager.all_tasks and not (n.endswith((".yaml", ".yml")) and Path(n).is_file())]
    if unknown:
        raise UserError(unknown_task_message(unknown, manager, paths))
    objects, owner = [], {}
    for name in names:
        loaded = load_task(manager, name)
        for leaf in loaded["tasks"]:
            if leaf in owner:
                raise UserError(f"lm-eval task {leaf!r} is requested twice (through {owner[leaf]!r} and {name!r}); "
                                "drop one of them from --tasks")
            owner[leaf] = name
        objects += top_level(loaded)
    return TaskSet(names, manager, objects)


# --- models ---------------------------------------------------------------------------------------

MASKED_LM_EVAL = ("lm-eval's zero-shot tasks score the log-likelihood a causal LM gives each continuation, which a "
                  "masked LM does not define (a pseudo-log-likelihood would be another protocol, not implemented); "
                  "masked-LM merges are scored by the masked-LM loss and accuracy in barrier.json")


def check_language_model(source: str) -> None:
    from ..architectures import masked_lm_architectures
    from ..sources.backends import backend_of, read_config_json
    config = read_config_json(source)
    if backend_of(config).task != "causal-lm":
        raise UserError(f"{source} is a timm image model; lm-eval is for language models (causal LMs) only. "
                        "Image merges are scored by their accuracy in barrier.json")
    architecture = (config.get("architectures") or [None])[0]
    if architecture in masked_lm_architectures():
        raise UserError(f"{source} is a masked LM ({architecture}): {MASKED_LM_EVAL}")


def pick_device(device: str | None) -> str:
    from ..options import device_problems
    problems = device_problems(device, "--device")
    if problems:
        raise UserError(problems[0])
    return resolve_device(device or "auto")


def load_language_model(source: str, device: str):
    from transformers import AutoTokenizer

    from ..sources.models import load
    check_language_model(source)
    model = load(source).model
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as error:
        raise UserError(f"{source} has no usable tokenizer ({type(error).__name__}: {error}); lm-eval needs one: "
                        "save the tokenizer of the source models into the folder") from error
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise UserError(f"the tokenizer of {source} has {len(tokenizer)} tokens but the model's embedding only {rows} "
                        "rows: the folder holds a tokenizer of a different model")
    return model.to(device).eval(), tokenizer


class _DropPretrainedWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "`pretrained` model kwarg is not of type `str`" not in record.getMessage()


def clean_metrics(task_results: dict) -> dict[str, float | None]:
    """lm-eval's 'acc,none' keys as 'acc' (other filters keep their suffix); numbers only, 'N/A' as None.
    (The example count, lm-eval's 'sample_len', goes to eval.json's "samples" instead.)"""
    metrics: dict[str, float | None] = {}
    for key, value in task_results.items():
        if key in ("alias", "sample_len"):
            continue
        name = key[: -len(",none")] if key.endswith(",none") else key
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[name] = float(value)
        elif name.endswith("_stderr"):
            metrics[name] = None
    return metrics


def quiet_git_hash() -> str | None:
    """lm-eval's record of the working folder's git commit, without the "fatal: not a git repository" that its
    `git describe` prints on stderr outside a repository (once per evaluated model)."""
    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL, text=True).strip()
    except (subprocess.CalledProcessError, OSError):
        return None


def evaluate_model(model, tokenizer, task_set: TaskSet, *, limit: int | None, batch_size: int | str) -> Outcome:
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.models.huggingface import HFLM
    start = time.perf_counter()
    hf_logger = logging.getLogger("lm_eval.models.huggingface")
    quiet = _DropPretrainedWarning()
    hf_logger.addFilter(quiet)
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    finally:
        hf_logger.removeFilter(quiet)
    with mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", quiet_git_hash):
        results = lm_eval.simple_evaluate(model=lm, tasks=list(task_set.objects), num_fewshot=NUM_FEWSHOT,
                                          limit=limit, task_manager=task_set.manager, log_samples=False)
    metrics = {task: clean_metrics(values) for task, values in results["results"].items()}
    samples = {task: int(n.get("effective", n.get("original", 0))) for task, n in results.get("n-samples", {}).items()}
    return Outcome(metrics, samples, time.perf_counter() - start)


def evaluate_source(source: str, task_set: TaskSet, *, limit=None, batch_size=DEFAULT_BATCH_SIZE,
                    device=None) -> Outcome:
    model, tokenizer = load_language_model(source, pick_device(device))
    return evaluate_model(model, tokenizer, task_set, limit=limit, batch_size=batch_size)


def run_eval(model_dir_or_source: str | Path, tasks: str | Sequence[str] | TaskSet = DEFAULT_TASKS, *,
             limit: int | None = None, batch_size: int | str = DEFAULT_BATCH_SIZE, device: str | None = None,
             include_path=None) -> dict[str, dict[str, float | None]]:
    """Zero-shot lm-eval metrics {task: {"acc": ..., "acc_stderr": ..., ...}} of one causal LM
    (a local folder or a Hub id)."""
    source = str(model_dir_or_source)
    check_language_model(source)
    task_set = tasks if isinstance(tasks, TaskSet) else prepare_tasks(tasks, include_path)
    return evaluate_source(source, task_set, limit=limit, batch_size=batch_size, device=device).metrics


# --- a merge output folder ------------------------------------------------------------------------------

def read_merge_output(out_dir: Path):
    if not out_dir.is_dir() or not (out_dir / "barrier.json").is_file():
        raise UserError(f"{out_dir} is not an hf-rebasin merge output (it has no barrier.json): pass the folder "
                        "written by `hf-rebasin merge`, or use the Python API hf_rebasin.hub.evals.run_eval for any "
                        "model")
    report = read_report(out_dir)
    if report.task == "masked-lm":
        raise UserError(f"{out_dir} holds a masked-LM merge ({report.architecture}): {MASKED_LM_EVAL}")
    if report.task != "causal-lm":
        raise UserError(f"{out_dir} holds a {report.task or 'non-language'} merge ({report.architecture}); "
                        "lm-eval is for language models (causal LMs) only")
    return report


def endpoint_labels(sources: list) -> list[str]:
    return [chr(ord("A") + i) if i < 26 else f"M{i}" for i in range(len(sources))]


def format_value(metrics: dict, metric: str) -> str:
    value = metrics.get(metric)
    if value is None:
        return "-"
    stderr = metrics.get(f"{metric}_stderr")
    return f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")


def results_table(results: dict[str, dict]) -> str:
    labels = list(results)
    tasks = list(dict.fromkeys(t for label in labels for t in results[label]))
    rows = [["task", "metric"] + labels]
    for task in tasks:
        metrics = list(dict.fromkeys(m for label in labels for m in results[label].get(task, {})
                                     if not m.endswith("_stderr")))
        for metric in metrics:
            rows.append([task, metric] + [format_value(results[label].get(task, {}), metric) for label in labels])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def parse_batch_size(text: str) -> int | str:
    return text if text == "auto" or text.startswith("auto:") else int(text)


def evaluate_merge(out_dir: str | Path, options: EvalOptions | None = None, *, announce=print) -> dict:
    """Score a merge output folder (and with options.endpoints its sources) with lm-eval; write eval.json and
    refresh the card, both through a staging copy of the folder swapped in at the end (nothing is changed if
    anything fails).  Returns the eval.json content."""
    options = options or EvalOptions()
    options.check()
    out_dir = Path(out_dir)
    report = read_merge_output(out_dir)
    check_task_data_reachable(options)  # before torch
    check_editable_dir(out_dir, "DIR")  # eval.json is written into it through a copy staged beside it
    device = pick_device(options.device)
    batch_size = parse_batch_size(options.batch_size)
    models = {"merged": str(out_dir)}
    if options.endpoints:
        if not report.models:
            raise UserError(f"{out_dir}/barrier.json lists no source models, so --endpoints has nothing to evaluate")
        models.update(zip(endpoint_labels(report.models), map(str, report.models)))
    for source in models.values():
        check_language_model(source)

    start = time.perf_counter()
    task_set = prepare_tasks(options.tasks, options.include_path)
    timings = {"tasks_s": round(time.perf_counter() - start, 3)}
    results, samples = {}, {}
    for label, source in models.items():
        announce(f"hf-rebasin eval: {label} ({source}) on {', '.join(task_set.names)}")
        outcome = evaluate_source(source, task_set, limit=options.limit, batch_size=batch_size, device=device)
        results[label], samples[label] = outcome.metrics, outcome.samples
        timings[f"{label}_s"] = round(outcome.seconds, 3)
    evaluation = {"tasks": task_set.names, "num_fewshot": NUM_FEWSHOT, "limit": options.limit, "results": results,
                  "models": models, "samples": samples,
                  "settings": {"batch_size": batch_size, "device": device, "include_path": options.include_path},
                  "versions": installed_versions(("lm-eval", "hf-rebasin", "torch", "transformers", "datasets")),
                  "timings": timings}
    evaluation = with_earlier(evaluation, out_dir / EVAL_FILE, announce)
    with edited_dir(out_dir) as stage:
        atomic_write(stage / EVAL_FILE, json.dumps(evaluation, indent=2) + "\n")
        refresh_card(stage, out_dir.name)
        record_files(stage, [name for name in (EVAL_FILE, "README.md") if (stage / name).is_file()])
    return evaluation


def check_task_data_reachable(options: EvalOptions) -> None:
    """lm-eval's built-in tasks read their data from the Hub: with the Hub unreachable and no dataset in any cache,
    refused now, in one line (lm-eval would index its tasks and retry the Hub for most of a minute first)."""
    from ..sources.hub_access import any_cached_dataset, hub_unreachable
    why = None if options.include_path else hub_unreachable()
    if why and not any_cached_dataset():
        raise UserError(f"--tasks {options.tasks}: lm-eval reads the tasks' data from the Hub, {why}, and no "
                        "dataset is in the Hub or datasets cache: connect (or fill the cache), or pass --include-path "
                        "with task YAMLs whose data are local files")


def with_earlier(evaluation: dict, path: Path, announce=print) -> dict:
    """The new evaluation merged into the eval.json already there: models and tasks not evaluated now keep their
    scores (an `eval --endpoints` then a plain `eval` keeps the endpoint columns); scores of another protocol
    (--limit, few-shot) are not mixed in but replaced."""
    try:
        earlier = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        earlier = None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("results"), dict):
        return evaluation
    protocol = ("limit", "num_fewshot")
    if any(earlier.get(key) != evaluation[key] for key in protocol):
        announce(f"hf-rebasin eval: the earlier {path.name} (limit {earlier.get('limit')}) is replaced: scores under "
                 f"another --limit are not mixed")
        return evaluation
    merged = dict(evaluation)
    for key in ("results", "samples"):
        old = earlier.get(key) if isinstance(earlier.get(key), dict) else {}
        merged[key] = {label: {**(old.get(label) or {}), **evaluation[key].get(label, {})}
                       for label in [*old, *(k for k in evaluation[key] if k not in old)]}
    merged["models"] = {**(earlier.get("models") or {}), **evaluation["models"]}
    merged["tasks"] = list(dict.fromkeys([*(earlier.get("tasks") or []), *evaluation["tasks"]]))
    merged["timings"] = {**(earlier.get("timings") or {}), **evaluation["timings"]}
    return merged


def refresh_card(out_dir: Path, model_name: str) -> None:
    cards = importlib.import_module("hf_rebasin.hub.cards")  # looked up at call time: tests record the call
    cards.write_card(out_dir, model_name=model_name)
