"""Mixture-of-experts layers in the canonical graph and their part of the group (docs/design.md §3, experts).

A sparse MoE block of E experts, each a SwiGLU FFN of F units, with a linear router over the normed stream:

    layers.<i>.moe.router      READ  (d, E)     the router's logits, one column per expert
    layers.<i>.moe.up|gate     READ  (d, E·F)   every expert's units side by side, expert e in columns e·F ...
    layers.<i>.moe.down        WRITE (E·F, d)   the same units' rows

The router picks the top-k experts of softmax(x W_r) and weighs their outputs by those probabilities (renormalised
or not), so the block's output is a function of the set {(logit_e, expert_e)}: permuting the experts together
with the router's columns changes nothing.  Inside an expert the units permute and take GLU scales as in a dense
FFN.  Together an expert permutation and a unit permutation per expert are one permutation of the E·F units that
moves whole blocks of F; that is how they act (``flat_perm``).  The residual rotation reaches the router like any
reader (``G^T W_r``).

Transform fields (one entry per layer, None for the identity): ``expert_perm`` (E,): new expert e is old expert
expert_perm[e]; ``expert_unit_perm`` (E, F): new unit j of new expert e is unit expert_unit_perm[e, j] of that old
expert; ``expert_glu_scale`` (E, F): then the scale of new unit (e, j)."""
from __future__ import annotations

import torch
from torch import Tensor

from .canonical import Spec, layer_key

FIELDS = ("expert_perm", "expert_unit_perm", "expert_glu_scale")


def flat_perm(expert_perm: Tensor | None, unit_perm: Tensor | None, n_experts: int, expert_dim: int) -> Tensor | None:
    """The permutation of the E·F units that the expert permutation and the per-expert unit permutations make."""
    if expert_perm is None and unit_perm is None:
        return None
    device = (expert_perm if expert_perm is not None else unit_perm).device
    if expert_perm is None:
        expert_perm = torch.arange(n_experts, device=device)
    if unit_perm is None:
        unit_perm = torch.arange(expert_dim, device=device).expand(n_experts, expert_dim)
    return (expert_perm[:, None] * expert_dim + unit_perm).reshape(-1)


def split_perm(flat: Tensor, n_experts: int, expert_dim: int) -> tuple[Tensor, Tensor]:
    """(expert_perm, expert_unit_perm) of a block permutation of the E·F units; raises if it splits an expert."""
    blocks = flat.reshape(n_experts, expert_dim)
    owner = blocks // expert_dim
    if not bool((owner == owner[:, :1]).all()):
        raise ValueError("unit permutation mixes units of different experts")
    return owner[:, 0].clone(), blocks % expert_dim


def transform_experts(p: dict[str, Tensor], i: int, spec: Spec, t) -> None:
    """Layer i's MoE tensors in p under t's expert part (in place; no-op without an MoE block)."""
    if layer_key(i, "moe.router") not in p:
        return
    ep, up, s = (t.per_layer(name, i) for name in FIELDS)
    if ep is not None:
        p[layer_key(i, "moe.router")] = p[layer_key(i, "moe.router")].index_select(-1, ep)
    flat = flat_perm(ep, up, spec.n_experts, spec.expert_dim)
    s = None if s is None else s.reshape(-1)
    for name in ("moe.up", "moe.gate"):
        if flat is not None:
            p[layer_key(i, name)] = p[layer_key(i, name)].index_select(-1, flat)
        if s is not None and name == "moe.up":
            p[layer_key(i, name)] = p[layer_key(i, name)] * s
    down = layer_key(i, "moe.down")
    if flat is not None:
        p[down] = p[down].index_select(0, flat)
    if s is not None:
        p[down] = p[down] / s[:, None]


def compose_experts(t1, t2, out, spec: Spec, i: int) -> None:
    """out's expert part of layer i: t1's, then t2's (see symmetry.compose)."""
    e, f = spec.n_experts, spec.expert_dim
    f1 = flat_perm(t1.per_layer("expert_perm", i), t1.per_layer("expert_unit_perm", i), e, f)
    f2 = flat_perm(t2.per_layer("expert_perm", i), t2.per_layer("expert_unit_perm", i), e, f)
    flat = f2 if f1 is None else (f1 if f2 is None else f1[f2])
    ep, up = (None, None) if flat is None else split_perm(flat, e, f)
    s1, s2 = t1.per_layer("expert_glu_scale", i), t2.per_layer("expert_glu_scale", i)
    if s1 is not None and f2 is not None:
        s1 = s1.reshape(-1)[f2].reshape(e, f)
    s = s2 if s1 is None else (s1 if s2 is None else s1 * s2)
    for name, value in zip(FIELDS, (ep, up, s)):
        getattr(out, name)[i] = value


def random_experts(spec: Spec, gen: torch.Generator, dtype) -> tuple[Tensor, Tensor, Tensor]:
    """A random expert permutation, unit permutation per expert and GLU scales (signs and magnitudes)."""
    e, f = spec.n_experts, spec.expert_dim
    ep = torch.randperm(e, generator=gen)
    up = torch.stack([torch.randperm(f, generator=gen) for _ in range(e)])
    signs = torch.where(torch.rand(e, f, generator=gen) < 0.5, -1.0, 1.0)
    return ep, up, (signs * torch.exp(torch.empty(e, f).uniform_(-0.7, 0.7, generator=gen))).to(dtype)


def describe_experts(spec: Spec) -> list[str]:
    if not spec.n_experts:
        return []
    lines = [f"expert permutations: {spec.n_experts} experts per layer (top-{spec.top_k} routing), permuted with "
             "the router's rows",
             f"expert FFN permutations: {spec.expert_dim} hidden units inside every expert, with GLU value scaling"]
    if spec.shared_expert:
        lines.append(f"shared expert: {spec.ffn_dim} hidden units, permuted and scaled like a dense FFN (its "
                     "sigmoid gate reads the stream and multiplies the whole output: untouched by them)")
    return lines
