"""The routing of a merged mixture of experts (issue 45): how the experts' load and each token's top-k set move
from the aligned endpoints to the merged point.  Experts are compared by index, which alignment makes meaningful:
expert e of the aligned B is the one matched to A's expert e."""
from __future__ import annotations

import math

import torch

from ..core.canonical import interpolate
from ..sources.eval_data import EvalData

MAX_WINDOWS = 16  # the routing is read on the first windows of the evaluation data
MAX_BYTES = 2**30  # the three models are built whole (fp32): only for models up to this size


def _shape_bytes(graph) -> int:
    shapes = getattr(graph, "shapes", None) or {k: tuple(v.shape) for k, v in graph.params.items()}
    return 4 * sum(math.prod(s) for s in shapes.values())


@torch.no_grad()
def _chosen(graph, template, inputs, top_k: int) -> list[torch.Tensor]:
    """Per MoE layer, the sorted top-k experts of every token (tokens, k)."""
    from ..sources.models import instantiate
    out = instantiate(graph, template)(input_ids=inputs, output_router_logits=True)
    return [logits.float().topk(top_k, dim=-1).indices.sort(dim=-1).values for logits in out.router_logits]


def routing_report(aligned: list, template, data: EvalData, weights: tuple[float, ...]) -> dict:
    """Load per expert (share of routed slots) at endpoint A, the merged point and endpoint B, layer by layer, and the
    share of tokens whose top-k set at the merged point differs from each endpoint's."""
    spec = aligned[0].spec
    if _shape_bytes(aligned[0]) > MAX_BYTES:
        return {"skipped": f"models above {MAX_BYTES // 2**20} MiB in fp32: the routing report builds them whole"}
    inputs = data.inputs[:MAX_WINDOWS]
    points = {"A": (1.0, 0.0), "merged": tuple(weights), "B": (0.0, 1.0)}
    chosen = {name: _chosen(interpolate(aligned, list(w)), template, inputs, spec.top_k)
              for name, w in points.items()}
    load = {name: [[round(float(x), 4) for x in torch.bincount(c.reshape(-1), minlength=spec.n_experts) / c.numel()]
                   for c in layers] for name, layers in chosen.items()}
    changed = {f"merged_vs_{end}": [round(float((m != e).any(-1).float().mean()), 4)
                                    for m, e in zip(chosen["merged"], chosen[end])] for end in ("A", "B")}
    return {"merged_weights": list(weights), "tokens": int(inputs.numel()), "experts": spec.n_experts,
            "top_k": spec.top_k, "load": load, "top_k_changed": changed}

