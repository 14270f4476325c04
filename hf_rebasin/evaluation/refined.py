"""barrier.json's `refined` section (merge --refine-steps, match/refine.py): the refined model measured on the
evaluation data beside the endpoints, their ensemble and the unrefined merged model."""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from .barrier import evaluate


class Ensemble(nn.Module):
    """The endpoints' ensemble as a model for evaluation.barrier.evaluate: its logits are log Σ_k w_k softmax(f_k)
    (log-probabilities: the cross-entropy of their softmax is the ensemble's)."""

    def __init__(self, endpoints: list[nn.Module], weights: list[float], task: str):
        super().__init__()
        self.endpoints, self.mix, self.task = nn.ModuleList(endpoints), [float(w) for w in weights], task

    def forward(self, x: Tensor | None = None, input_ids: Tensor | None = None):
        inputs = input_ids if input_ids is not None else x
        mixed = sum(w * (m(input_ids=inputs).logits if self.task == "causal-lm" else m(inputs)).float().softmax(-1)
                    for w, m in zip(self.mix, self.endpoints) if w)
        logits = mixed.clamp_min(torch.finfo(torch.float32).tiny).log()
        return SimpleNamespace(logits=logits) if self.task == "causal-lm" else logits


def evaluate_refined(model: nn.Module, endpoints: list[nn.Module], weights: list[float], data, options,
                     record: dict, endpoint_loss: list[float], merged_loss: float) -> dict:
    """barrier.json's `refined` section: the refined model's loss (and perplexity / accuracy) on the evaluation data,
    the endpoints', the ensemble's and the unrefined merged model's, with the training record."""
    device = options.resolved_device()
    start = time.perf_counter()
    refined = evaluate(model, data, options.batch_size, device)
    ensemble = evaluate(Ensemble(endpoints, weights, data.task).to(device), data, options.batch_size, device)
    model.to("cpu")
    metric = "perplexity" if data.task == "causal-lm" else "accuracy"
    return {"loss": refined["loss"], metric: refined[metric], "endpoint_loss": list(endpoint_loss),
            "ensemble_loss": ensemble["loss"], f"ensemble_{metric}": ensemble[metric],
            "merged_loss": merged_loss, **{k: v for k, v in record.items() if k != "log"},
            "eval_s": time.perf_counter() - start, "log": record["log"]}


__all__ = ["Ensemble", "evaluate_refined"]
