"""Matching methods: a registry from the --method name to a function (graph_a, graph_b, **opts) -> MatchResult."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..canonical import Graph
from ..symmetry import Transform


@dataclass
class MatchResult:
    transform_a: Transform
    transform_b: Transform
    log: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)


def raw(a: Graph, b: Graph, **_) -> MatchResult:
    """No alignment: the plain average of the two checkpoints."""
    return MatchResult(Transform.identity(a.spec), Transform.identity(b.spec))


def wm(a: Graph, b: Graph, progress: bool = True, **opts) -> MatchResult:
    from .weight import weight_matching
    return weight_matching(a, b, progress=progress, **opts)


def wm_perm(a: Graph, b: Graph, progress: bool = True, **opts) -> MatchResult:
    from .weight import weight_matching
    return weight_matching(a, b, residual="permutation", head_maps=False, progress=progress, **opts)


def am(a: Graph, b: Graph, progress: bool = True, **opts) -> MatchResult:
    from .activation import activation_matching
    return activation_matching(a, b, progress=progress, **opts)


def lm(a: Graph, b: Graph, **opts) -> MatchResult:
    from .learned import lm as learned_lm
    return learned_lm(a, b, **opts)


def dual(a: Graph, b: Graph, **opts) -> MatchResult:
    from .learned import dual as learned_dual
    return learned_dual(a, b, **opts)


METHODS: dict[str, Callable[..., MatchResult]] = {"raw": raw, "wm": wm, "wm-perm": wm_perm, "am": am,
                                                  "lm": lm, "dual": dual}
NEEDS_DATA = {"am", "lm", "dual"}  # methods that get data=EvalData, template=Loaded (model A), batches, batch_size
LEARNED: set[str] = {"lm", "dual"}  # methods that also get cli_args (the argparse namespace) and eval_data
DESCRIPTIONS = {
    "raw": "no alignment (plain weight average)",
    "wm": "data-free weight matching over the full group: residual rotation, head permutations, "
          "per-head QK/OV maps, FFN permutations, GLU scales",
    "wm-perm": "permutations only, residual stream treated as a permutation (Git Re-Basin ablation)",
    "am": "activation matching: assignments from activation correlations on a few batches",
    "lm": "learned matching (Theus et al.): B's continuous symmetries trained on the path loss, "
          "started from weight matching",
    "dual": "dual learned matching (LMC-DM, Li & Shen): both endpoints' symmetries trained on the path loss, "
            "started from weight matching (absorbed init)",
}
