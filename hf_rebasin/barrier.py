"""The loss barrier along the straight path between aligned models (DESIGN §5).

Protocol for language models: mean next-token cross-entropy over every predicted token of
non-overlapping windows (see data.token_windows), perplexity = exp(loss).  Classifiers:
mean cross-entropy and top-1 accuracy.  barrier = max over the grid of
L(λ) - ((1-λ) L(0) + λ L(1)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from .canonical import Graph, interpolate
from .models import Loaded, instantiate


@dataclass
class EvalData:
    task: str  # "causal-lm" or "image-classification"
    inputs: Tensor  # token windows (n, seq_len) or images (n, C, H, W)
    labels: Tensor | None = None  # class labels for images
    info: dict | None = None


def _batches(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield slice(start, min(n, start + batch_size))


@torch.no_grad()
def evaluate(model: nn.Module, data: EvalData, batch_size: int = 8, device: str = "cpu") -> dict:
    """{"loss": ..., "perplexity" | "accuracy": ...} of one model on the data."""
    model = model.to(device).eval()
    total_loss, total_count, correct = 0.0, 0, 0
    for part in _batches(len(data.inputs), batch_size):
        x = data.inputs[part].to(device)
        if data.task == "causal-lm":
            logits = model(input_ids=x).logits[:, :-1].float()
            target = x[:, 1:]
            total_loss += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                reduction="sum"))
            total_count += target.numel()
        else:
            logits = model(x).float()
            y = data.labels[part].to(device)
            total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
            total_count += len(y)
    loss = total_loss / total_count
    if data.task == "causal-lm":
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}
    return {"loss": loss, "accuracy": correct / total_count}


def barrier_of(lambdas: list[float], losses: list[float]) -> tuple[float, float]:
    """(barrier, λ where it is reached) for a path whose endpoints are the first and last points."""
    l0, l1 = losses[0], losses[-1]
    excess = [loss - ((1 - lam) * l0 + lam * l1) for lam, loss in zip(lambdas, losses)]
    k = max(range(len(excess)), key=excess.__getitem__)
    return excess[k], lambdas[k]


def evaluate_path(a: Graph, b: Graph, template: Loaded, data: EvalData, lambdas: list[float],
                  batch_size: int = 8, device: str = "cpu", progress: bool = True) -> dict:
    """Metrics at every λ of the path (1-λ) a + λ b, and the barrier."""
    metric = "perplexity" if data.task == "causal-lm" else "accuracy"
    losses, metrics = [], []
    for lam in tqdm(lambdas, desc="barrier", disable=not progress, leave=False):
        result = evaluate(instantiate(interpolate([a, b], [1 - lam, lam]), template), data, batch_size, device)
        losses.append(result["loss"])
        metrics.append(result[metric])
    barrier, where = barrier_of(lambdas, losses)
    return {"lambdas": list(lambdas), "loss": losses, metric: metrics, "endpoint_loss": [losses[0], losses[-1]],
            "barrier": barrier, "barrier_lambda": where}


def plot_path(results: dict[str, dict], path, title: str) -> None:
    """barrier.png: loss against λ for one or more methods (dict name -> evaluate_path result)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for name, result in results.items():
        ax.plot(result["lambdas"], result["loss"], marker="o", ms=3, label=f"{name} (barrier {result['barrier']:.3f})")
    ends = next(iter(results.values()))
    ax.plot([0, 1], ends["endpoint_loss"], ls="--", c="grey", lw=1, label="linear between endpoints")
    ax.set_xlabel("λ  (0 = model A, 1 = aligned model B)")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
