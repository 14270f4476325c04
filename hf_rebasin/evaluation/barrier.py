"""The loss barrier along the straight path between aligned models, or over the simplex of N (docs/design.md §5).

Protocol for language models: mean next-token cross-entropy over every predicted token of
non-overlapping windows (see data.token_windows), perplexity = exp(loss).  Masked LMs: the mean cross-entropy of
the original tokens at the positions a fixed, seeded masking chose (sources/masking.py), and the accuracy of their
prediction.  Classifiers: mean
cross-entropy and top-1 accuracy.  Two models: barrier = max over the λ grid of L(λ) - ((1-λ) L(0) + λ L(1)).
N models: the max over a simplex lattice (every weight vector with entries k/r) of
L(sum_i w_i θ_i) - sum_i w_i L(θ_i).  The two-model grid is the lattice of the 2-simplex.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..core.canonical import interpolate
from ..progress import tqdm
from ..sources.eval_data import EvalData
from ..sources.masking import IGNORE
from ..sources.models import Loaded, build, fill, lm_logits


def _batches(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield slice(start, min(n, start + batch_size))


@torch.no_grad()
def evaluate(model: nn.Module, data: EvalData, batch_size: int = 8, device: str = "cpu") -> dict:
    """{"loss": ..., "perplexity" | "accuracy": ...} of one model on the data."""
    model = model.to(device).eval()
    totals = [0.0, 0, 0, [], []]
    for part in _batches(len(data.inputs), batch_size):
        _add_batch(totals, model, data, part, device)
    return _metrics(totals, data.task)


def _add_batch(totals: list, model: nn.Module, data: EvalData, part: slice, device: str) -> None:
    """Add one batch's summed loss, its count and its correct predictions to totals [loss, count, correct, loss of
    each example, count of each example] (the last two for the bootstrap intervals: evaluation/intervals.py)."""
    x = data.inputs[part].to(device)
    if data.task == "causal-lm":
        logits = model(input_ids=x).logits[:, :-1].float()
        target = x[:, 1:]
        totals[0] += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"))
        totals[1] += target.numel()
        each = F.cross_entropy(logits.transpose(1, 2), target, reduction="none").double().sum(1)
        totals[4] += [target.shape[1]] * len(target)
    elif data.task == "masked-lm":  # the original tokens at the positions the fixed masking chose (sources/masking)
        logits = lm_logits(model(input_ids=x)).float()
        target = data.labels[part].to(device)
        chosen = target != IGNORE
        each = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE, reduction="none").double().sum(1)
        totals[0] += float(each.sum())
        totals[1] += int(chosen.sum())
        totals[2] += int(((logits.argmax(-1) == target) & chosen).sum())
        totals[4] += chosen.sum(1).tolist()
    else:
        logits = model(x).float()
        y = data.labels[part].to(device)
        totals[0] += float(F.cross_entropy(logits, y, reduction="sum"))
        totals[2] += int((logits.argmax(-1) == y).sum())
        totals[1] += len(y)
        each = F.cross_entropy(logits, y, reduction="none").double()
        totals[4] += [1] * len(y)
    totals[3] += each.tolist()


def _metrics(totals: list, task: str) -> dict:
    loss = totals[0] / totals[1]
    each = {"window_loss": totals[3], "window_count": totals[4]}
    if task == "causal-lm":
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), **each}
    return {"loss": loss, "accuracy": totals[2] / totals[1], **each}


def simplex_lattice(n: int, resolution: int) -> list[tuple[float, ...]]:
    """Every weight vector over n models with entries k / resolution (vertices first, as in reading order)."""
    points = [c for c in itertools.product(range(resolution + 1), repeat=n) if sum(c) == resolution]
    return [tuple(k / resolution for k in c) for c in sorted(points, reverse=True)]


def lambda_grid(points: int) -> list[float]:
    return [k / (points - 1) for k in range(points)]


STREAMED_EVAL_BYTES = 2**30  # a merged model larger than this in fp32 is evaluated layer by layer
CARRIED_BYTES = 2**30  # layer by layer: the layer outputs kept between layers, for a group of batches at most


def evaluate_points(graphs: list, weights: list[tuple[float, ...]], template: Loaded, data: EvalData,
                    batch_size: int = 8, device: str = "cpu", progress: bool = True,
                    desc: str = "barrier", streamed: bool | None = None) -> list[dict]:
    """Metrics of the merged model sum_i w_i graph_i at every weight vector.  One model is built (on the meta
    device) and refilled, part by part, for every point: one model in memory, never a copy per point.
    Streamed (default: above STREAMED_EVAL_BYTES in fp32): only the tensors outside the layers are filled; each
    decoder layer's weights are computed from the graphs once per point and run on every batch before the next
    layer is computed (layer-major: the batches' outputs between layers are kept, CARRIED_BYTES at most, in
    groups of batches beyond that), so one layer of the merged model is in memory at a time."""
    from ..sources.checkpoints import canonical_bytes
    if streamed is None:
        streamed = canonical_bytes(graphs[0]) > STREAMED_EVAL_BYTES
    if streamed:
        return _evaluate_streamed(graphs, weights, template, data, batch_size, device, progress, desc)
    results, model = [], None
    for w in tqdm(weights, desc=desc, disable=not progress, leave=False):
        point = interpolate(graphs, list(w))
        model = fill(model if model is not None else build(point, template), point, template)
        results.append(evaluate(model, data, batch_size, device))
    return results


def _evaluate_streamed(graphs, weights, template, data, batch_size, device, progress, desc) -> list[dict]:
    from types import SimpleNamespace

    from ..sources.layerwise import GraphLayer, norm_modules, swap_layers
    from ..sources.models import own_tensors
    adapter, spec = template.adapter, graphs[0].spec
    holder = SimpleNamespace(graph=None, stage=None)
    first = interpolate(graphs, list(weights[0]))  # layers are filled from canonical parts, so the canonical export's
    model = template.backend.build(template, adapter.export_config_changes(first, template.config)).eval()  # config
    layers = swap_layers(model, adapter, spec.n_layers,
                         lambda i, block, prefix: GraphLayer(i, block, prefix, holder, template))
    norms = norm_modules(adapter, model, layers) if spec.scale_exact else []
    results = []
    for w in tqdm(weights, desc=desc, disable=not progress, leave=False):
        holder.graph = point = interpolate(graphs, list(w))
        outside = adapter.outside_from_canonical(point.outside(), template.config, spec)
        model.load_state_dict(own_tensors(outside), strict=False, assign=True)
        if template.task == "masked-lm" and model.config.tie_word_embeddings:
            model.tie_weights()  # the MLM decoder is the (newly assigned) word embedding
        for module, attr in norms:
            setattr(module, attr, point.norm_eps)
        results.append(_evaluate_layer_major(model, layers, holder, data, batch_size, device))
    return results


@torch.no_grad()
def _evaluate_layer_major(model, layers, holder, data: EvalData, batch_size: int, device: str) -> dict:
    """evaluate() of a model whose layers are GraphLayers, one layer at a time over a group of batches: each
    layer's weights are computed once per group, not once per batch (the same operations on the same weights as
    evaluate(): the same result).  A group holds as many batches as fit their layer outputs in CARRIED_BYTES."""
    from ..sources.layerwise import Stage, StopForward

    def forward(part: slice) -> None:
        try:
            model(input_ids=data.inputs[part].to(device)) if data.task in ("causal-lm", "masked-lm") else \
                model(data.inputs[part].to(device))
        except StopForward:
            return
        raise AssertionError("the staged forward ran past its layer")

    model = model.to(device).eval()
    parts, totals, start = list(_batches(len(data.inputs), batch_size)), [0.0, 0, 0, [], []], 0
    try:
        while start < len(parts):
            holder.stage = stage = Stage()
            end = None  # fixed once the first batch's first layer output is measured
            for layer in layers:
                stage.layer, stage.weights = layer.i, layer.local_state(device)
                stage.batch = start
                while end is None or stage.batch < end:
                    forward(parts[stage.batch])
                    if end is None:
                        fits = CARRIED_BYTES // max(1, _bytes(stage.carried[start]))
                        end = min(len(parts), start + max(1, fits))
                    stage.batch += 1
            stage.layer, stage.weights = len(layers), None
            for stage.batch in range(start, end):
                _add_batch(totals, model, data, parts[stage.batch], device)
            start = end
    finally:
        holder.stage = None
    return _metrics(totals, data.task)


def _bytes(output) -> int:
    """Bytes of the tensors in a layer's output (a tensor, or a tuple holding tensors)."""
    if isinstance(output, torch.Tensor):
        return output.numel() * output.element_size()
    if isinstance(output, (tuple, list)):
        return sum(_bytes(x) for x in output)
    return 0


def worst_excess(weights: list[tuple[float, ...]], losses: list[float], endpoint_loss: list[float]):
    """(excess at every point, index of the largest): excess = L(w) - sum_i w_i L(model_i)."""
    excess = [loss - sum(wi * li for wi, li in zip(w, endpoint_loss)) for w, loss in zip(weights, losses)]
    return excess, max(range(len(excess)), key=excess.__getitem__)


# --- plots ----------------------------------------------------------------------------------------

def plot_path(results: dict[str, dict], path, title: str) -> None:
    """barrier.png of two models: loss against λ for one or more methods (name -> report dict)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for name, result in results.items():
        line, = ax.plot(result["lambdas"], result["loss"], marker="o", ms=3,
                        label=f"{name} (barrier {result['barrier']:.3f}{interval_label(result)})")
        if result.get("loss_interval"):  # the bootstrap interval of every point's loss, shaded
            low, high = zip(*result["loss_interval"])
            ax.fill_between(result["lambdas"], low, high, color=line.get_color(), alpha=0.2, lw=0)
    ends = next(iter(results.values()))
    ax.plot([0, 1], ends["endpoint_loss"], ls="--", c="grey", lw=1, label="linear between endpoints")
    end = "model B" if set(results) == {"raw"} else "aligned model B"  # raw aligns nothing
    ax.set_xlabel(f"λ  (0 = model A, 1 = {end})")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def interval_label(result: dict) -> str:
    interval = result.get("barrier_interval")
    return f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""


def plot_simplex(report: dict, path, names: list[str]) -> None:
    """barrier.png of N models: a ternary heat map of the excess loss for three, the excess per point otherwise."""
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
        for (px, py), name in zip([(0, 0), (1, 0), (0.5, math.sqrt(3) / 2)], names):
            ax.annotate(Path(name).name, (px, py), ha="center", va="top" if py == 0 else "bottom", fontsize=8)
        ax.set_aspect("equal")
        ax.axis("off")
    else:
        ax.plot(report["excess"], marker="o")
        ax.set_xlabel("simplex lattice point")
        ax.set_ylabel("excess loss (nats)")
    ax.set_title(f"{report['n_models']}-way merge ({report['method']}), barrier {report['barrier']:.3f}", fontsize=9,
                 pad=16)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
