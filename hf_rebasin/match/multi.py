"""Bringing N models into one coordinate system: weight matching to a running average.

Model 0 is put in its balanced canonical factorisation; every further model is matched to the
average of the models aligned so far; then each model is matched once more to the average of
all the others (one refinement pass), so that no model's frame is privileged by its position."""
from __future__ import annotations

from ..core.canonical import Graph, interpolate
from ..core.symmetry import apply
from ..progress import tqdm
from .alignment import Alignment
from .weight import balance_transform, weight_matching


def average(graphs: list[Graph]) -> Graph:
    return interpolate(graphs, [1.0 / len(graphs)] * len(graphs))


def align_many(graphs: list[Graph], *, max_rounds: int = 10, refine: bool = True, progress: bool = True):
    """An Alignment of every model to one common frame."""
    transforms = [balance_transform(graphs[0])]
    aligned = [apply(graphs[0], transforms[0])]
    log = []
    bar = tqdm(total=(len(graphs) - 1) + (len(graphs) if refine else 0), desc="aligning to the average",
               disable=not progress, leave=False)
    for k, graph in enumerate(graphs[1:], start=1):
        result = weight_matching(average(aligned), graph, max_rounds=max_rounds, progress=False, balance_a=False)
        transforms.append(result.transform_b)
        aligned.append(apply(graph, result.transform_b))
        log.append({"model": k, "pass": 0, "distance": result.log[-1]["distance"]})
        bar.update(1)
    if refine:
        for k, graph in enumerate(graphs):
            others = aligned[:k] + aligned[k + 1:]
            result = weight_matching(average(others), graph, max_rounds=max_rounds, progress=False, balance_a=False)
            transforms[k] = result.transform_b
            aligned[k] = apply(graph, result.transform_b)
            log.append({"model": k, "pass": 1, "distance": result.log[-1]["distance"]})
            bar.update(1)
    bar.close()
    return Alignment(transforms, log, {"max_rounds": max_rounds, "refine": refine})
