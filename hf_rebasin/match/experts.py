"""Weight matching over a layer's experts (docs/design.md §4, experts): which expert of B is which expert of A, and
inside each matched pair which unit is which.

Experts of two models are an assignment problem whose cost must compare a pair of experts whatever the order of
their units (each expert's unit permutation is still free).  Three costs, each invariant to it:

* ``units``: the value of the best unit matching of the pair (the dense FFN score of weight.py, solved per pair):
  E² small assignments;
* ``router``: the overlap of the pair's router rows, in the aligned residual frame;
* ``gram``: the overlap of the pair's Gram signatures ``W Wᵀ`` of gate, up (balanced) and down over the stream.

The assignment is solved exactly (linear_sum_assignment), then the units inside every matched pair; the GLU scales
of B's units follow in closed form as in the dense path.  Which cost recovers experts: BENCHMARKS.md (MoE)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..core.canonical import Spec, layer_key
from ..errors import UnsupportedModelError
from .linalg import assignment

COSTS = ("units", "router", "gram")  # ("none": the unmatched-experts ablation, experts kept in stored order)
# the methods that align experts: weight matching, and learned matching started from it with the expert
# permutations and scales applied first (--init absorbed) and fixed; activation matching does not yet
METHODS = ("raw", "wm", "wm-perm", "lm", "dual")


def check_method(spec: Spec, method: str, init: str = "absorbed") -> None:
    """Refuse, by name, a method that does not align experts yet, for a mixture-of-experts model."""
    if spec.n_experts and method not in METHODS:
        raise UnsupportedModelError(
            f"--method {method} does not align mixture-of-experts models yet ({spec.architecture}, {spec.n_experts} "
            f"experts per layer): use --method wm (experts assigned by their weights), lm, dual, wm-perm or raw")
    if spec.n_experts and method in ("lm", "dual") and init != "absorbed":
        raise UnsupportedModelError(
            f"--method {method} --init {init} would train from weight matching's element with its expert "
            f"permutations dropped ({spec.architecture}): use --init absorbed (the default) for mixtures of experts")


def expert_tensors(p: dict, i: int, spec: Spec) -> tuple[Tensor, Tensor, Tensor]:
    """gate (E, d, F), up (E, d, F), down (E, F, d) of layer i."""
    e, f = spec.n_experts, spec.expert_dim
    split = lambda w: w.reshape(w.shape[0], e, f).transpose(0, 1)
    return (split(p[layer_key(i, "moe.gate")]), split(p[layer_key(i, "moe.up")]),
            p[layer_key(i, "moe.down")].reshape(e, f, -1))


def expert_glu_balance(p: dict, i: int, spec: Spec) -> Tensor:
    """(E, F) per-unit scales a making ||up_u a|| = ||down_u / a|| inside every expert."""
    _, up, down = expert_tensors(p, i, spec)
    return (down.norm(dim=2) / up.norm(dim=1).clamp_min(1e-30)).clamp_min(1e-30).sqrt()


def _balanced(p: dict, i: int, spec: Spec):
    gate, up, down = expert_tensors(p, i, spec)
    s = expert_glu_balance(p, i, spec)
    return gate, up * s[:, None, :], down / s[:, :, None]


def unit_scores(a, b, ea: int, eb: int) -> Tensor:
    """(F, F) similarity of the units of expert ea of A and eb of B (B balanced; a GLU unit's value sign is free)."""
    (ga, ua, da), (gb, ub, db) = a, b
    return ga[ea].T @ gb[eb] + (ua[ea].T @ ub[eb] + da[ea] @ db[eb].T).abs()


def expert_costs(pa: dict, pb: dict, i: int, spec: Spec, cost: str) -> Tensor:
    """(E, E) similarity of expert a of A and b of B, invariant to each expert's unit permutation and GLU scales."""
    if cost == "router":
        return pa[layer_key(i, "moe.router")].T @ pb[layer_key(i, "moe.router")]
    a, b = expert_tensors(pa, i, spec), _balanced(pb, i, spec)
    if cost == "gram":
        # <W_a W_aᵀ, W_b W_bᵀ> = ||W_aᵀ W_b||², over the stream, for gate, up and down (one expert of A at a time)
        pairs = zip((a[0], a[1], a[2].transpose(1, 2)), (b[0], b[1], b[2].transpose(1, 2)))
        return sum(torch.stack([torch.einsum("ij,bik->bjk", x[ea], y).square().sum((1, 2))
                                for ea in range(spec.n_experts)]) for x, y in pairs)
    if cost != "units":
        raise ValueError(f"unknown expert cost {cost!r}; choose one of {COSTS}")
    out = torch.empty(spec.n_experts, spec.n_experts, dtype=torch.float64)
    for ea in range(spec.n_experts):
        for eb in range(spec.n_experts):
            s = unit_scores(a, b, ea, eb)
            out[ea, eb] = float(s[torch.arange(s.shape[0]), assignment(s)].sum())
    return out


def match_experts(pa: dict, pb: dict, i: int, spec: Spec, cost: str = "units") -> tuple[Tensor, Tensor]:
    """(expert_perm (E,), expert_unit_perm (E, F)) taking B's layer i onto A's: the experts by an exact assignment on
    the cost, then the units inside every matched pair."""
    if cost == "none":  # the ablation: experts left in their stored order, units matched between namesakes
        expert_perm = torch.arange(spec.n_experts)
    else:
        expert_perm = assignment(expert_costs(pa, pb, i, spec, cost))
    a, b = expert_tensors(pa, i, spec), _balanced(pb, i, spec)
    units = torch.stack([assignment(unit_scores(a, b, ea, int(expert_perm[ea]))) for ea in range(spec.n_experts)])
    return expert_perm, units


def match_expert_glu_scales(pa: dict, pb: dict, i: int, spec: Spec) -> Tensor:
    """B's (already permuted) expert units' scales: balanced, with the sign that agrees with A."""
    s = expert_glu_balance(pb, i, spec)
    _, up_a, down_a = expert_tensors(pa, i, spec)
    _, up_b, down_b = _balanced(pb, i, spec)
    agree = (up_a * up_b).sum(1) + (down_a * down_b).sum(2)
    return torch.where(agree < 0, -s, s)
