"""barrier.json: the report a merge writes and that cards, evals, push and recipes read.

One typed object, versioned.  Schema 2 (this version) adds ``schema_version`` and, for two models too,
``excess`` (the signed excess over the endpoint line at every point) and ``n_models``; a file without
``schema_version`` is schema 1 and still reads (the missing fields are derived).  Schema 3 adds the bootstrap
intervals (``loss_interval``, ``barrier_interval`` and how they were drawn, ``bootstrap``: evaluation/intervals.py);
a schema 1 or 2 file reads with them empty."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

SCHEMA_VERSION = 3
REPORT_FILE = "barrier.json"
REQUIRED = ("method", "models", "lambdas", "loss", "barrier")


@dataclass
class Report:
    method: str
    models: list[str]
    lambdas: list  # two models: λ values; N models: weight vectors (lists of N floats)
    loss: list[float]
    barrier: float
    architecture: str = "unknown"
    task: str = "causal-lm"  # or "masked-lm" (loss and accuracy on the masked tokens), "image-classification"
    n_models: int = 2
    alpha: float | list[float] | None = None
    perplexity: list[float] | None = None
    accuracy: list[float] | None = None
    excess: list[float] = field(default_factory=list)
    endpoint_loss: list[float] = field(default_factory=list)
    barrier_lambda: float | list[float] | None = None
    merged_loss: float | None = None
    raw_barrier: float | None = None  # two models: the plain average's barrier at the same points, for reference
    method_description: str = ""
    data: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    match_log: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    command: str = ""
    notes: list[str] = field(default_factory=list)
    license: str | None = None
    hf_rebasin_version: str = ""
    loss_interval: list = field(default_factory=list)  # [low, high] of every point's loss (percentile bootstrap)
    barrier_interval: list[float] = field(default_factory=list)  # [low, high] of the barrier
    bootstrap: dict = field(default_factory=dict)  # resamples, seed, level, unit, units
    routing: dict = field(default_factory=dict)  # a mixture of experts: load per expert, top-k changes (routing.py)
    # merge --refine-steps: the refined model's loss, the endpoints', the ensemble's, steps, tokens, time
    # (match/refine.py); the barrier and the path above stay those of the alignment
    refined: dict | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def metric(self) -> str:
        return "perplexity" if self.task == "causal-lm" else "accuracy"

    @property
    def metric_values(self) -> list[float]:
        return getattr(self, self.metric) or []

    def weights(self) -> list[list[float]]:
        """Every evaluated point as interpolation weights over the models."""
        return [[1.0 - lam, lam] if self.n_models == 2 else list(lam) for lam in self.lambdas]

    def merged_metric(self) -> float | None:
        """The merged model's perplexity or accuracy (its grid entry, or exp(loss) for an off-grid LM)."""
        values = self.metric_values
        if values and self.alpha in self.lambdas:
            return values[self.lambdas.index(self.alpha)]
        if self.task == "causal-lm" and self.merged_loss is not None:
            return math.exp(min(self.merged_loss, 700.0))
        return None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        optional = ("perplexity", "accuracy", "raw_barrier", "refined")
        return {k: v for k, v in out.items() if not (k in optional and v is None)}

    @classmethod
    def from_dict(cls, data: dict) -> Report:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values.setdefault("schema_version", 1)
        values.setdefault("n_models", len(data.get("models") or []) or 2)
        report = cls(**values)
        if not report.excess and report.endpoint_loss and report.n_models == len(report.endpoint_loss):
            report.excess = excess_over_endpoints(report.weights(), report.loss, report.endpoint_loss)
        return report


def excess_over_endpoints(weights: list[list[float]], losses: list[float], endpoint_loss: list[float]) -> list[float]:
    """L(point) - sum_i w_i L(model_i): positive above the plane of the endpoint losses, negative below."""
    return [loss - sum(w * e for w, e in zip(ws, endpoint_loss)) for ws, loss in zip(weights, losses)]


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path} is not valid JSON ({error}); re-run the command that wrote it") from error


def read_report(folder: str | Path) -> Report:
    """The report of a merge output folder (schema 1, 2 or 3)."""
    path = Path(folder) / REPORT_FILE
    if not path.is_file():
        raise UserError(f"{folder} is not an hf-rebasin merge output (no {REPORT_FILE}): pass the folder written by "
                        "`hf-rebasin merge`")
    data = read_json(path)
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a merge report (a JSON object was expected)")
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: it was not written by hf-rebasin merge; re-run the merge")
    if data.get("schema_version", 1) > SCHEMA_VERSION:
        raise UserError(f"{path} has schema version {data['schema_version']}, newer than this hf-rebasin reads "
                        f"({SCHEMA_VERSION}): upgrade hf-rebasin")
    return Report.from_dict(data)


def report_text(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"
