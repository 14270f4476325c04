"""Learnable parameterisations of the symmetry group (docs/design.md §3-4).

Every parameterisation maps unconstrained tensors onto the group itself, so that the
forward pass never projects: whatever the optimiser does, the value is an exact symmetry.

    orthogonal G        Q0 · cayley(S)   or   Q0 · expm(S)      S skew (zero at the start), Q0 the fixed start
    G fixing 1 (LN)     Q R Q^T + s·11^T/d                      R orthogonal on the complement of 1
    signed permutation  not trained: kept as weight matching chose it (a discrete residual group, post-norms)
    invertible maps     polar:  Q · L L^T  (Q orthogonal, L lower-triangular, positive diagonal)
                        expm:   M0 · expm(X)   (M0 the fixed start; exp does not cover GL)
                        direct: M = X      (any matrix; invertible in practice near the start)
    RoPE pairs          r · [[cos a, sin a], [-sin a, cos a]]   per frequency pair, r = exp(rho)
    scales (g, GLU)     s0 · exp(rho)       (the sign of s0 is kept)
    permutations        kept as weight matching chose them (buffers on the parameters' device)
    QK / OV maps        only the kinds the spec allows (Spec.qk_maps, Spec.ov_maps)

Each module starts exactly at a given group element (identity for the absorbed init, the
weight-matching solution for the plain one); tests check the start is reproduced.

What runs in a training step is built for a GPU: everything in fp32 (S starts at zero, so the Cayley and
exponential maps stay well conditioned: no float64), ``_ex`` linalg variants that never make the host wait
for an error check, and the per-head maps of all layers computed as one batch (a handful of launches per
step whatever the depth, not a few per head).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.canonical import Graph, Spec
from ..core.experts import FIELDS as EXPERT_FIELDS
from ..core.symmetry import Transform, kv_perm_of, rotary_pairs, rotate_residual, transform_layer
from .linalg import ones_complement

ORTH_KINDS = ("cayley", "expm")
INV_KINDS = ("polar", "expm", "direct")


# --- orthogonal matrices -------------------------------------------------------------------------

def cayley(s: Tensor) -> Tensor:
    """(I - S)^-1 (I + S): orthogonal with determinant +1 for skew S.  I - S is invertible for every skew S
    (its eigenvalues are 1 - i·θ), so no error check is needed (solve_ex without one: no host sync)."""
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device).expand_as(s)
    return torch.linalg.solve_ex(eye - s, eye + s)[0]


def nearest_orthogonal(q: Tensor) -> Tensor:
    """The orthogonal matrix nearest to q (U V^T of its SVD), in float64 on the host: a start made exact."""
    u, _, vh = torch.linalg.svd(q.detach().double().cpu())
    return u @ vh


class Orthogonal(nn.Module):
    """A batch (*batch, n, n) of orthogonal matrices Q0 · f(S), f = cayley or expm, S skew: Q0 (any
    determinant) is the start, S starts at zero."""

    def __init__(self, n: int, batch: tuple[int, ...] = (), kind: str = "cayley", start: Tensor | None = None):
        super().__init__()
        if kind not in ORTH_KINDS:
            raise ValueError(f"unknown orthogonal parameterisation {kind!r}; choose one of {ORTH_KINDS}")
        self.kind = kind
        shape = (*batch, n, n)
        base = None if start is None else nearest_orthogonal(start.reshape(shape)).float()
        self.register_buffer("base", base)
        self.raw = nn.Parameter(torch.zeros(shape))  # S = raw - raw^T

    def forward(self) -> Tensor:
        s = self.raw - self.raw.transpose(-1, -2)
        q = cayley(s) if self.kind == "cayley" else torch.linalg.matrix_exp(s)
        return q if self.base is None else self.base @ q


class OnesFixingOrthogonal(nn.Module):
    """Orthogonal (d, d) G with G·1 = s·1 (s = ±1 fixed): G = C R C^T + s·11^T/d, C the ones complement."""

    def __init__(self, d: int, kind: str = "cayley", start: Tensor | None = None):
        super().__init__()
        basis = ones_complement(d)
        self.register_buffer("basis", basis.float().clone())
        self.register_buffer("ones", torch.full((d, 1), 1 / math.sqrt(d)))
        inner, sign = None, 1.0
        if start is not None:
            g = start.detach().double().cpu()
            inner = basis.T @ g @ basis
            sign = 1.0 if float(g.sum()) >= 0 else -1.0
        self.sign = sign
        self.inner = Orthogonal(d - 1, kind=kind, start=inner)

    def forward(self) -> Tensor:
        return self.basis @ self.inner() @ self.basis.T + self.sign * (self.ones @ self.ones.T)


class FixedResidual(nn.Module):
    """The residual map of a spec whose residual group is discrete (signed permutations): chosen by weight
    matching, held fixed (a buffer, no gradient), as the head and FFN permutations are."""

    def __init__(self, d: int, start: Tensor | None = None):
        super().__init__()
        self.register_buffer("matrix", torch.eye(d) if start is None else start.detach().float().cpu().clone())

    def forward(self) -> Tensor:
        return self.matrix


# --- invertible maps -----------------------------------------------------------------------------

class GeneralLinear(nn.Module):
    """A batch (*batch, n, n) of invertible matrices, by polar factors, a matrix exponential or directly."""

    def __init__(self, n: int, batch: tuple[int, ...] = (), kind: str = "polar", orth: str = "cayley",
                 start: Tensor | None = None):
        super().__init__()
        if kind not in INV_KINDS:
            raise ValueError(f"unknown invertible-map parameterisation {kind!r}; choose one of {INV_KINDS}")
        self.kind = kind
        shape = (*batch, n, n)
        m0 = None if start is None else start.detach().double().cpu().reshape(shape)
        if kind == "polar":
            q0 = p0 = None
            if m0 is not None:  # M = U S V^T = (U V^T)(V S V^T)
                u, s, vh = torch.linalg.svd(m0)
                q0, p0 = u @ vh, vh.transpose(-1, -2) @ torch.diag_embed(s) @ vh
            self.orthogonal = Orthogonal(n, batch, orth, q0)
            if p0 is None:
                raw = torch.zeros(shape, dtype=torch.float64)
            else:
                chol = torch.linalg.cholesky((p0 + p0.transpose(-1, -2)) / 2)
                raw = torch.tril(chol, -1) + torch.diag_embed(torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)))
            self.register_buffer("lower_mask", torch.tril(torch.ones(n, n), -1))
            self.raw = nn.Parameter(raw.float())
        elif kind == "expm":
            self.register_buffer("base", (torch.eye(n).expand(shape) if m0 is None else m0).float().clone())
            self.raw = nn.Parameter(torch.zeros(shape))
        else:
            start_map = torch.eye(n, dtype=torch.float64).expand(shape) if m0 is None else m0
            self.raw = nn.Parameter(start_map.float().clone())

    def forward(self) -> Tensor:
        if self.kind == "polar":
            lower = self.raw * self.lower_mask + torch.diag_embed(torch.exp(torch.diagonal(self.raw, dim1=-2, dim2=-1)))
            return self.orthogonal() @ (lower @ lower.transpose(-1, -2))
        if self.kind == "expm":
            return self.base @ torch.linalg.matrix_exp(self.raw)
        return self.raw


class HeadMaps(nn.Module):
    """A batch (*batch, hd, hd) of head-dim maps (batch: e.g. (layers, KV groups)): a scaled 2-D rotation on
    each RoPE pair and any invertible map on the remaining (free) dims, nothing mixing the two.

    Built as one block matrix in the order (first dims of the pairs, second dims, free dims),
        [[ C,  S,  0],
         [-S,  C,  0],      C = diag(r cos a), S = diag(r sin a), F the free map,
         [ 0,  0,  F]]
    and brought to the head's own order by one fixed permutation of rows and columns."""

    def __init__(self, batch: int | tuple[int, ...], head_dim: int, pairs: list[tuple[int, int]], inv: str,
                 orth: str, start: Tensor | None = None):
        super().__init__()
        batch = (batch,) if isinstance(batch, int) else tuple(batch)
        first, second = [a for a, _ in pairs], [b for _, b in pairs]
        paired = set(first) | set(second)
        free = [j for j in range(head_dim) if j not in paired]
        order = first + second + free
        self.batch, self.n_pairs, self.n_free = batch, len(pairs), len(free)
        position = torch.empty(head_dim, dtype=torch.long)
        position[torch.tensor(order, dtype=torch.long)] = torch.arange(head_dim)
        self.register_buffer("position", None if order == list(range(head_dim)) else position)
        m0 = None if start is None else start.detach().float().cpu().reshape(*batch, head_dim, head_dim)
        if pairs:
            if m0 is None:
                rho, angle = torch.zeros(*batch, len(pairs)), torch.zeros(*batch, len(pairs))
            else:
                a, b = torch.tensor(first), torch.tensor(second)
                c, s = m0[..., a, a], m0[..., a, b]
                rho, angle = torch.log(torch.hypot(c, s)), torch.atan2(s, c)
            self.log_radius, self.angle = nn.Parameter(rho), nn.Parameter(angle)
        self.free_map = None
        if free:
            f = torch.tensor(free)
            block = None if m0 is None else m0[..., f, :][..., :, f]
            self.free_map = GeneralLinear(len(free), batch, inv, orth, block)

    def forward(self) -> Tensor:
        blocks = []
        if self.n_pairs:
            r = torch.exp(self.log_radius)
            c, s = torch.diag_embed(r * torch.cos(self.angle)), torch.diag_embed(r * torch.sin(self.angle))
            rows = [torch.cat([c, s], -1), torch.cat([-s, c], -1)]
            if self.n_free:
                zeros = c.new_zeros(*self.batch, 2 * self.n_pairs, self.n_free)
                rows = [torch.cat([torch.cat(rows, -2), zeros], -1)]
            blocks.append(torch.cat(rows, -2))
        if self.n_free:
            free = self.free_map()
            if self.n_pairs:
                free = torch.cat([free.new_zeros(*self.batch, self.n_free, 2 * self.n_pairs), free], -1)
            blocks.append(free)
        m = blocks[0] if len(blocks) == 1 else torch.cat(blocks, -2)
        if self.position is None:
            return m
        return m.index_select(-2, self.position).index_select(-1, self.position)


class PositiveScale(nn.Module):
    """s0 · exp(rho): a scale (or a tensor of scales) that keeps the sign of its start."""

    def __init__(self, start: Tensor | float):
        super().__init__()
        s0 = torch.as_tensor(start, dtype=torch.float32).detach().cpu().clone()
        self.register_buffer("start", s0)
        self.log_scale = nn.Parameter(torch.zeros_like(s0))

    def forward(self) -> Tensor:
        return self.start * torch.exp(self.log_scale)


# --- one endpoint's learnable group element ------------------------------------------------------

@dataclass
class Continuous:
    """The continuous part of a group element, the per-layer parts batched over the layers:
    qk/ov (layers, KV groups, hd, hd), glu (layers, ffn) or None where the spec has none."""

    rotation: Tensor
    scale: Tensor | float
    qk: Tensor | None = None
    ov: Tensor | None = None
    glu: Tensor | None = None

    def relative_to(self, a: Continuous) -> Continuous:
        """a^-1 followed by this (for a WITHOUT permutations): rotation G G_a^T, scale g / g_a, maps M M_a^-1,
        GLU scales s / s_a, all differentiable.

        The group acts linearly on the weights, so the dual path (1-l) t_a(A) + l t_b(B) is t_a applied to the
        single-sided path (1-l) A + l (t_a^-1 t_b)(B): same function at every l, one transform per step."""
        def maps(mb, ma):  # X with X M_a = M_b (M_a invertible by construction: no error check, no host sync)
            return None if mb is None else torch.linalg.solve_ex(ma, mb, left=False)[0]
        return Continuous(self.rotation @ a.rotation.T, self.scale / a.scale, maps(self.qk, a.qk),
                          maps(self.ov, a.ov), None if self.glu is None else self.glu / a.glu)


def _stacked(items: list[Tensor | None], default: Tensor) -> Tensor | None:
    """The per-layer tensors stacked over the layers (`default` where a layer has none); None if none has one."""
    if all(v is None for v in items):
        return None
    return torch.stack([default if v is None else v.detach().cpu().to(default.dtype) for v in items])


class SymmetryParams(nn.Module):
    """The learnable group element of one endpoint, started at `start` (a Transform)."""

    def __init__(self, spec: Spec, start: Transform | None = None, *, orth: str = "cayley", inv: str = "polar"):
        super().__init__()
        start = start or Transform.identity(spec)
        self.spec = spec
        n_layers, groups, hd = spec.n_layers, spec.n_kv_heads, spec.head_dim
        if spec.residual == "signed_permutation":
            self.rotation = FixedResidual(spec.d_model, start.rotation)
        elif spec.centred:
            self.rotation = OnesFixingOrthogonal(spec.d_model, orth, start.rotation)
        else:
            self.rotation = Orthogonal(spec.d_model, (), orth, start.rotation)
        self.scale = PositiveScale(float(start.scale)) if spec.scale_exact else None
        self.fixed_scale = float(start.scale)
        self.qk = self.ov = self.glu = None
        eye = torch.eye(hd).expand(groups, hd, hd)
        if spec.qk_maps:
            self.qk = HeadMaps((n_layers, groups), hd, rotary_pairs(spec), inv, orth, _stacked(start.qk_maps, eye))
        if spec.ov_maps:
            self.ov = HeadMaps((n_layers, groups), hd, [], inv, orth, _stacked(start.ov_maps, eye))
        if spec.glu and spec.ffn_dim:  # (a MoE without a shared expert has no dense FFN)
            s0 = _stacked(start.glu_scale, torch.ones(spec.ffn_dim))
            self.glu = PositiveScale(torch.ones(n_layers, spec.ffn_dim) if s0 is None else s0)
        # permutations stay as they start (discrete; weight matching chooses them), held on the parameters' device;
        # a head permutation is checked here, on the host, to move query heads with their KV group
        head_perm = _stacked(start.head_perm, torch.arange(spec.n_heads))
        if head_perm is not None:
            for perm in head_perm:
                kv_perm_of(perm, spec.group_size)
        self.register_buffer("head_perm", head_perm)
        self.register_buffer("ffn_perm", _stacked(start.ffn_perm, torch.arange(spec.ffn_dim)))
        e, f = spec.n_experts, spec.expert_dim  # the expert part stays as it starts (fixed, like the permutations)
        for name, default in zip(EXPERT_FIELDS, (torch.arange(e), torch.arange(f).repeat(e, 1), torch.ones(e, f))):
            self.register_buffer(name, _stacked(getattr(start, name), default))

    def continuous(self) -> Continuous:
        """The continuous part of the element (differentiable), batched over the layers."""
        scale = self.scale() if self.scale is not None else self.fixed_scale
        return Continuous(self.rotation(), scale, None if self.qk is None else self.qk(),
                          None if self.ov is None else self.ov(), None if self.glu is None else self.glu())

    def has_permutations(self) -> bool:
        return (self.head_perm is not None or self.ffn_perm is not None or self.expert_perm is not None
                or self.expert_unit_perm is not None)

    def element(self, continuous: Continuous | None = None) -> Transform:
        """This group element as a Transform: `continuous` (default: its own continuous part, differentiable)
        with its fixed permutations; per-layer parts are views of the batched tensors."""
        c = self.continuous() if continuous is None else continuous
        n = self.spec.n_layers

        def layers(x: Tensor | None) -> list:
            return [None] * n if x is None else list(x.unbind(0))

        return Transform(c.rotation, c.scale, layers(self.head_perm), layers(c.qk), layers(c.ov),
                         layers(self.ffn_perm), layers(c.glu), *(layers(getattr(self, name)) for name in EXPERT_FIELDS))

    @staticmethod
    def apply_outside(params: dict[str, Tensor], t: Transform) -> dict[str, Tensor]:
        """The tensors outside the layers under the element t (from `element`)."""
        return {k: rotate_residual(k, v, t) for k, v in params.items()}

    def apply_layer(self, params: dict[str, Tensor], i: int, t: Transform) -> dict[str, Tensor]:
        """Layer i's tensors under the element t (from `element`)."""
        return transform_layer(params, i, self.spec, t)

    def apply(self, graph: Graph, t: Transform | None = None) -> Graph:
        """The graph's tensors under the element t (from `element`; default this element), differentiable in the
        parameters.  The norm eps is left as it is: the residual scale's effect on it is the caller's
        (PathOfEnds.eps_and_write_factor)."""
        t = self.element() if t is None else t
        params = self.apply_outside({k: v for k, v in graph.params.items() if not k.startswith("layers.")}, t)
        for i in range(self.spec.n_layers):
            params.update(self.apply_layer(graph.layer(i), i, t))
        return graph.replace(params)

    @torch.no_grad()
    def export(self) -> Transform:
        """The current group element as a plain Transform (detached, on the CPU, permutations as indices)."""
        t = self.element()
        out = Transform.identity(self.spec)
        out.rotation = t.rotation.detach().float().cpu()
        out.scale = float(t.scale)
        for name in ("head_perm", "qk_maps", "ov_maps", "ffn_perm", "glu_scale", *EXPERT_FIELDS):
            setattr(out, name, [None if v is None else v.detach().cpu().clone() for v in getattr(t, name)])
        return out
