"""Activation matching, closed form, from activations of the two canonical models on a few batches.

`residual="permutation"` is the baseline of Verma & Elbayad (Git Re-Basin's permutations chosen from
correlations): the residual stream, heads and FFN units permuted.  The default covers the spec's whole group,
as weight matching does:

* residual: the element of the spec's residual group (a rotation, or a signed permutation) that best maps B's
  residual stream onto A's (Procrustes of the cross-products sum x_B^T x_A over the stream entering every
  layer and the final norm; the permutation baseline: an assignment on their correlations),
* FFN permutation: correlation of the FFN hidden activations,
* head permutation: inner products of each head's contribution to the residual stream
  (head output @ W_O, which no per-head map changes), B's in A's residual basis,
* per-head QK/OV maps and GLU scales: weight matching's closed form (balance, then the best orthogonal map onto
  A's balanced heads) in the frame the activations chose.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

from ..core.canonical import Graph, layer_key
from ..core.symmetry import Transform, apply, transform_layer
from ..progress import tqdm
from ..sources.eval_data import EvalData
from .alignment import Alignment
from .linalg import assignment, best_permutation_matrix
from .weight import balance_transform, fit_continuous, match_heads, residual_cross, solve_rotation


@contextmanager
def capture_inputs(model, paths: dict[str, str]):
    """Record the first positional (or hidden_states) input of each named module on every forward."""
    seen: dict[str, Tensor] = {}
    handles = []
    for name, path in paths.items():
        def hook(module, args, kwargs, name=name):
            x = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values())))
            seen[name] = x.detach().reshape(-1, x.shape[-1]).double()
        handles.append(model.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _paths(template, spec, which: list[str]) -> dict[str, str]:
    modules = template.adapter.modules
    out = {}
    for kind in which:
        if kind == "final":
            if "final" in modules:
                out["final"] = modules["final"]
            continue
        for i in range(spec.n_layers):
            out[f"{kind}.{i}"] = modules[kind].format(i=i)
    return out


def _forward(model, x):
    with torch.no_grad():
        return model(x) if x.is_floating_point() else model(input_ids=x)


def _correlation(sum_a, sum_b, sq_a, sq_b, cross, n) -> Tensor:
    """corr[i, j] between B's unit i and A's unit j from running sums (cross = sum x_B^T x_A)."""
    mean_a, mean_b = sum_a / n, sum_b / n
    cov = cross / n - mean_b[:, None] * mean_a[None, :]
    std_a = (sq_a / n - mean_a**2).clamp_min(1e-12).sqrt()
    std_b = (sq_b / n - mean_b**2).clamp_min(1e-12).sqrt()
    return cov / (std_b[:, None] * std_a[None, :])


class _Stats:
    def __init__(self):
        self.sums: dict[str, list] = {}

    def add(self, name: str, xa: Tensor, xb: Tensor) -> None:
        terms = [xa.sum(0), xb.sum(0), (xa**2).sum(0), (xb**2).sum(0), xb.T @ xa, len(xa)]
        if name in self.sums:
            self.sums[name] = [s + t for s, t in zip(self.sums[name], terms)]
        else:
            self.sums[name] = terms

    def correlation(self, name: str) -> Tensor:
        return _correlation(*self.sums[name])

    def cross(self, name: str) -> Tensor:
        """sum x_B^T x_A."""
        return self.sums[name][4]


def activation_matching(a: Graph, b: Graph, *, data, template, batches: int = 32, batch_size: int = 8,
                        residual: str = "full", progress: bool = True):
    from ..sources.models import instantiate
    spec = a.spec
    model_a, model_b = instantiate(a, template), instantiate(b, template)
    n_batches = min(batches, max(1, len(data.inputs) // batch_size))
    inputs = [data.inputs[k * batch_size:(k + 1) * batch_size] for k in range(n_batches)]
    stats = _Stats()
    residual_paths = _paths(template, spec, ["block", "final"])
    ffn_paths = _paths(template, spec, ["ffn_hidden"])
    for x in tqdm(inputs, desc="activations (residual, FFN)", disable=not progress, leave=False):
        with capture_inputs(model_a, {**residual_paths, **ffn_paths}) as seen_a:
            _forward(model_a, x)
        with capture_inputs(model_b, {**residual_paths, **ffn_paths}) as seen_b:
            _forward(model_b, x)
        for name in residual_paths:
            stats.add("residual", seen_a[name], seen_b[name])
        for name in ffn_paths:
            stats.add(name, seen_a[name], seen_b[name])

    t = Transform.identity(spec)
    if residual == "permutation":
        t.rotation = best_permutation_matrix(stats.correlation("residual")).float()  # G[i, j] = 1: B dim i -> A dim j
    else:
        t.rotation = solve_rotation(residual_objective(stats.cross("residual"), a, b), spec, "orthogonal")
    for i in range(spec.n_layers):
        correlation = stats.correlation(f"ffn_hidden.{i}")
        if spec.glu and residual != "permutation":  # a GLU unit and its negative are one unit (glu_scale < 0)
            correlation = correlation.abs()
        t.ffn_perm[i] = assignment(correlation.T)

    # heads: contributions ctx_h @ W_O,h to the residual stream, B's rotated into A's basis
    head_paths = _paths(template, spec, ["attn_out"])
    scores = [torch.zeros(spec.n_heads, spec.n_heads, dtype=torch.float64) for _ in range(spec.n_layers)]
    hd = spec.head_dim
    for x in tqdm(inputs, desc="activations (heads)", disable=not progress, leave=False):
        with capture_inputs(model_a, head_paths) as seen_a:
            _forward(model_a, x)
        with capture_inputs(model_b, head_paths) as seen_b:
            _forward(model_b, x)
        for i in range(spec.n_layers):
            o_a = a.params[layer_key(i, "attn.o")].double().reshape(spec.n_heads, hd, -1)
            o_b = (b.params[layer_key(i, "attn.o")].double() @ t.rotation.double()).reshape(spec.n_heads, hd, -1)
            ctx_a = seen_a[f"attn_out.{i}"].reshape(-1, spec.n_heads, hd)
            ctx_b = seen_b[f"attn_out.{i}"].reshape(-1, spec.n_heads, hd)
            out_a = torch.einsum("nhi,hid->nhd", ctx_a, o_a)
            out_b = torch.einsum("nhi,hid->nhd", ctx_b, o_b)
            scores[i] += torch.einsum("nad,nbd->ab", out_a, out_b)
    for i in range(spec.n_layers):
        t.head_perm[i] = match_heads(scores[i], spec)
    settings = {"batches": n_batches, "batch_size": batch_size, "residual": residual}
    if residual == "permutation" or not (spec.head_maps or spec.glu):
        return Alignment([Transform.identity(spec), t], [], settings)
    t_a = balance_transform(a)
    return Alignment([t_a, with_fitted_maps(apply(a, t_a), b, t)], [], settings)


def residual_objective(cross: Tensor, a: Graph, b: Graph) -> Tensor:
    """solve_rotation's M for the activations' cross-products.  Where the group fixes the all-ones vector up to
    sign (LayerNorm), the stream is mean-free and says nothing of that sign: it is taken from the weights that
    both models index alike (embeddings and head, as weight matching's first guess)."""
    m = torch.stack([cross, torch.zeros_like(cross)])
    if a.spec.centred and a.spec.residual != "signed_permutation":
        ones = torch.full((cross.shape[0],), cross.shape[0] ** -0.5, dtype=cross.dtype)
        sign = 1.0 if float(ones @ residual_cross(a.outside(), b.outside())[0].to(cross.dtype) @ ones) >= 0 else -1.0
        m[0] += (sign * float(cross.norm()) - float(ones @ cross @ ones)) * torch.outer(ones, ones)
    return m


def with_fitted_maps(pa, b: Graph, t: Transform) -> Transform:
    """t with weight matching's closed-form per-head maps and GLU scales for B (its residual element and
    permutations kept), fitted to A's balanced tensors pa one layer at a time."""
    frame = Transform.identity(b.spec)  # the residual element and permutations only
    frame.rotation, frame.head_perm, frame.ffn_perm = t.rotation, list(t.head_perm), list(t.ffn_perm)
    for i in range(b.spec.n_layers):
        fit_continuous(pa.layer(i), transform_layer(b.layer(i), i, b.spec, frame), i, b.spec, t)
    return t


def evenly_spread(data: EvalData, count: int) -> EvalData:
    """`count` examples of `data` at evenly spaced positions from its first to its last."""
    rows = torch.linspace(0, len(data.inputs) - 1, min(count, len(data.inputs))).round().long()
    return EvalData(data.task, data.inputs[rows], None if data.labels is None else data.labels[rows])
