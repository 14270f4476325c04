"""Learnable parameterisations of the symmetry group (docs/design.md §3-4) and the group product.

Every parameterisation maps unconstrained tensors onto the group itself, so that the
forward pass never projects: whatever the optimiser does, the value is an exact symmetry.

    orthogonal G        D · cayley(S)   or   D · expm(S)         S skew, D a fixed ±1 diagonal
    G fixing 1 (LN)     Q R Q^T + s·11^T/d                      R orthogonal on the complement of 1
    invertible maps     polar:  Q · L L^T  (Q orthogonal, L lower-triangular, positive diagonal)
                        expm:   M0 · expm(X)   (M0 the fixed start; exp does not cover GL)
                        direct: M = X      (any matrix; invertible in practice near the start)
    RoPE pairs          r · [[cos a, sin a], [-sin a, cos a]]   per frequency pair, r = exp(rho)
    scales (g, GLU)     s0 · exp(rho)       (the sign of s0 is kept)
    permutations        straight-through: hard (Hungarian) forward, Sinkhorn gradient

Each module starts exactly at a given group element (identity for the absorbed init, the
weight-matching solution for the plain one); tests check the start is reproduced.
"""
from __future__ import annotations

import copy
import math

import torch
from torch import Tensor, nn

from ..canonical import Graph, Spec
from ..symmetry import Transform, rotary_pairs, rotate_residual, transform_layer
from .linalg import ones_complement

ORTH_KINDS = ("cayley", "expm")
INV_KINDS = ("polar", "expm", "direct")


# --- orthogonal matrices -------------------------------------------------------------------------

def cayley(s: Tensor) -> Tensor:
    """(I - S)^-1 (I + S): orthogonal with determinant +1 for skew S."""
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device).expand_as(s)
    return torch.linalg.solve(eye - s, eye + s)


def inverse_cayley(q: Tensor) -> Tensor:
    """S with cayley(S) = Q, for Q in SO(n) without eigenvalue -1."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype).expand_as(q)
    s = torch.linalg.solve(eye + q, q - eye)
    return (s - s.transpose(-1, -2)) / 2


def _real_logm(q: Tensor) -> Tensor:
    import scipy.linalg
    flat = q.reshape(-1, *q.shape[-2:]).double().numpy()
    import numpy as np
    logs = np.stack([np.real(scipy.linalg.logm(m)) for m in flat])
    out = torch.from_numpy(logs).to(torch.float64).reshape(q.shape)
    return (out - out.transpose(-1, -2)) / 2


def sign_factor(q: Tensor) -> Tensor:
    """Signs d with det(diag(d) Q) = +1 and diag(d) Q mostly positive on its diagonal, so that
    D·cayley(S) can start at Q (any determinant) with a small S."""
    diag = torch.diagonal(q, dim1=-2, dim2=-1)
    d = torch.where(diag < 0, -1.0, 1.0).to(torch.float64)
    det = torch.linalg.det(q.double()) * d.prod(-1)
    weakest = diag.abs().argmin(-1, keepdim=True)
    flip = torch.where(det < 0, -1.0, 1.0).to(torch.float64)[..., None]
    return d.scatter(-1, weakest, d.gather(-1, weakest) * flip)


class Orthogonal(nn.Module):
    """A batch (*batch, n, n) of orthogonal matrices D · f(S), f = cayley or expm, S skew."""

    def __init__(self, n: int, batch: tuple[int, ...] = (), kind: str = "cayley", start: Tensor | None = None):
        super().__init__()
        if kind not in ORTH_KINDS:
            raise ValueError(f"unknown orthogonal parameterisation {kind!r}; choose one of {ORTH_KINDS}")
        self.kind = kind
        shape = (*batch, n, n)
        if start is None:
            signs, skew = torch.ones(*batch, n, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
        else:
            q = start.detach().double().cpu().reshape(shape)
            signs = sign_factor(q)
            q = signs[..., :, None] * q
            skew = inverse_cayley(q) if kind == "cayley" else _real_logm(q)
        self.register_buffer("signs", signs.float())
        self.raw = nn.Parameter((skew / 2).float())  # S = raw - raw^T

    def forward(self) -> Tensor:
        # in float64: a start with eigenvalues near -1 has a large S, and fp32 would lose orthogonality
        s = (self.raw - self.raw.transpose(-1, -2)).double()
        q = cayley(s) if self.kind == "cayley" else torch.linalg.matrix_exp(s)
        return self.signs[..., :, None] * q.to(self.raw.dtype)


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
            return self.base @ torch.linalg.matrix_exp(self.raw.double()).to(self.raw.dtype)
        return self.raw


class HeadMaps(nn.Module):
    """Per-KV-group head-dim maps (groups, hd, hd): a scaled 2-D rotation on each RoPE pair and any
    invertible map on the remaining (free) dims, nothing mixing the two."""

    def __init__(self, groups: int, head_dim: int, pairs: list[tuple[int, int]], inv: str, orth: str,
                 start: Tensor | None = None):
        super().__init__()
        paired = {j for pair in pairs for j in pair}
        free = [j for j in range(head_dim) if j not in paired]
        self.groups, self.head_dim = groups, head_dim
        self.register_buffer("pair_a", torch.tensor([a for a, _ in pairs], dtype=torch.long))
        self.register_buffer("pair_b", torch.tensor([b for _, b in pairs], dtype=torch.long))
        self.register_buffer("free", torch.tensor(free, dtype=torch.long))
        m0 = None if start is None else start.detach().float().cpu()
        if pairs:
            if m0 is None:
                rho, angle = torch.zeros(groups, len(pairs)), torch.zeros(groups, len(pairs))
            else:
                c, s = m0[:, self.pair_a, self.pair_a], m0[:, self.pair_a, self.pair_b]
                rho, angle = torch.log(torch.hypot(c, s)), torch.atan2(s, c)
            self.log_radius, self.angle = nn.Parameter(rho), nn.Parameter(angle)
        self.free_map = None
        if free:
            block = None if m0 is None else m0[:, self.free][:, :, self.free]
            self.free_map = GeneralLinear(len(free), (groups,), inv, orth, block)

    def forward(self) -> Tensor:
        hd = self.head_dim
        ref = self.free_map.raw if self.free_map is not None else self.angle
        m = torch.zeros(self.groups, hd, hd, dtype=ref.dtype, device=ref.device)
        g = torch.arange(self.groups, device=ref.device)
        if len(self.pair_a):
            r = torch.exp(self.log_radius)
            c, s = r * torch.cos(self.angle), r * torch.sin(self.angle)
            a, b, gg = self.pair_a[None, :], self.pair_b[None, :], g[:, None]
            for rows, cols, value in ((a, a, c), (a, b, s), (b, a, -s), (b, b, c)):
                m = m.index_put((gg.expand_as(value), rows.expand_as(value), cols.expand_as(value)), value)
        if self.free_map is not None:
            block = self.free_map()
            f = self.free
            index = (g[:, None, None].expand_as(block), f[None, :, None].expand_as(block),
                     f[None, None, :].expand_as(block))
            m = m.index_put(index, block)
        return m


class PositiveScale(nn.Module):
    """s0 · exp(rho): a scale that keeps the sign of its start."""

    def __init__(self, start: Tensor | float):
        super().__init__()
        s0 = torch.as_tensor(start, dtype=torch.float32).detach().cpu().clone()
        self.register_buffer("start", s0)
        self.log_scale = nn.Parameter(torch.zeros_like(s0))

    def forward(self) -> Tensor:
        return self.start * torch.exp(self.log_scale)


def relative_continuous(t_a: Transform, t_b: Transform, spec: Spec) -> Transform:
    """The continuous part of t_b followed by the inverse of t_a, for t_a WITHOUT permutations:
    rotation G_b G_a^T, scale g_b / g_a, maps M_b M_a^-1, GLU scales s_b / s_a (all differentiable).

    The group acts linearly on the weights, so the dual path (1-l) t_a(A) + l t_b(B) is t_a applied to
    the single-sided path (1-l) A + l (t_a^-1 t_b)(B): same function at every l, one transform per step."""
    out = Transform.identity(spec)
    out.rotation = t_b.rotation @ t_a.rotation.T
    out.scale = t_b.scale / t_a.scale
    for i in range(spec.n_layers):
        for name in ("qk_maps", "ov_maps"):
            mb, ma = t_b.per_layer(name, i), t_a.per_layer(name, i)
            getattr(out, name)[i] = None if mb is None else torch.linalg.solve(ma, mb, left=False)
        sb, sa = t_b.per_layer("glu_scale", i), t_a.per_layer("glu_scale", i)
        out.glu_scale[i] = None if sb is None else sb / sa
    return out


# --- one endpoint's learnable group element ------------------------------------------------------

class LayerSymmetry(nn.Module):
    def __init__(self, spec: Spec, start: Transform, i: int, inv: str, orth: str):
        super().__init__()
        self.qk = self.ov = self.glu = None
        if spec.head_maps:
            self.qk = HeadMaps(spec.n_kv_heads, spec.head_dim, rotary_pairs(spec), inv, orth,
                               start.per_layer("qk_maps", i))
            self.ov = HeadMaps(spec.n_kv_heads, spec.head_dim, [], inv, orth, start.per_layer("ov_maps", i))
        if spec.glu:
            s0 = start.per_layer("glu_scale", i)
            self.glu = PositiveScale(torch.ones(spec.ffn_dim) if s0 is None else s0)
        # permutations are kept as they start (discrete; weight matching chooses them)
        self.fixed_head_perm = start.per_layer("head_perm", i)
        self.fixed_ffn_perm = start.per_layer("ffn_perm", i)


class SymmetryParams(nn.Module):
    """The learnable group element of one endpoint, started at `start` (a Transform)."""

    def __init__(self, spec: Spec, start: Transform | None = None, *, orth: str = "cayley", inv: str = "polar"):
        super().__init__()
        start = start or Transform.identity(spec)
        self.spec = spec
        if spec.centred:
            self.rotation = OnesFixingOrthogonal(spec.d_model, orth, start.rotation)
        else:
            self.rotation = Orthogonal(spec.d_model, (), orth, start.rotation)
        self.scale = PositiveScale(float(start.scale)) if spec.scale_exact else None
        self.fixed_scale = float(start.scale)
        self.layers = nn.ModuleList(LayerSymmetry(spec, start, i, inv, orth) for i in range(spec.n_layers))

    def _continuous(self) -> Transform:
        """The transform without permutations (differentiable tensors)."""
        t = Transform.identity(self.spec)
        t.rotation = self.rotation()
        t.scale = self.scale() if self.scale is not None else self.fixed_scale
        for i, layer in enumerate(self.layers):
            t.qk_maps[i] = None if layer.qk is None else layer.qk()
            t.ov_maps[i] = None if layer.ov is None else layer.ov()
            t.glu_scale[i] = None if layer.glu is None else layer.glu()
        return t

    def has_permutations(self) -> bool:
        return any(layer.fixed_head_perm is not None or layer.fixed_ffn_perm is not None
                   for layer in self.layers)

    def element(self, continuous: Transform | None = None, device=None) -> Transform:
        """This group element as a Transform: `continuous` (default: its own continuous part, differentiable)
        with its fixed permutations (on `device`)."""
        t = self._continuous() if continuous is None else copy.copy(continuous)
        move = lambda perm: None if perm is None else perm.to(device)
        t.head_perm = [move(layer.fixed_head_perm) for layer in self.layers]
        t.ffn_perm = [move(layer.fixed_ffn_perm) for layer in self.layers]
        return t

    @staticmethod
    def apply_outside(params: dict[str, Tensor], t: Transform) -> dict[str, Tensor]:
        """The tensors outside the layers under the element t (from `element`)."""
        return {k: rotate_residual(k, v, t) for k, v in params.items()}

    def apply_layer(self, params: dict[str, Tensor], i: int, t: Transform) -> dict[str, Tensor]:
        """Layer i's tensors under the element t (from `element`)."""
        return transform_layer(params, i, self.spec, t)

    @staticmethod
    def scaled_eps(norm_eps: float, t: Transform) -> float:
        """The norm eps under t: the residual scale g is exact only with eps scaled by g^2."""
        if isinstance(t.scale, Tensor):  # a plain number (a device tensor has no value on meta)
            scale = float(t.scale.detach()) if t.scale.device.type != "meta" else float("nan")
        else:
            scale = float(t.scale)
        return norm_eps * scale ** 2

    def apply(self, graph: Graph, continuous: Transform | None = None) -> Graph:
        """apply(graph, this element), differentiable in the parameters.  `continuous` replaces this
        element's continuous part (rotation, scale, maps, GLU scales); its permutations stay."""
        t = self.element(continuous, graph.params["layers.0.attn.o"].device)
        params = self.apply_outside({k: v for k, v in graph.params.items() if not k.startswith("layers.")}, t)
        for i in range(self.spec.n_layers):
            prefix = f"layers.{i}."
            params.update(self.apply_layer({k: v for k, v in graph.params.items() if k.startswith(prefix)}, i, t))
        return graph.replace(params, norm_eps=self.scaled_eps(graph.norm_eps, t))

    @torch.no_grad()
    def export(self) -> Transform:
        """The current group element as a plain Transform (detached, on the CPU, permutations as indices)."""
        t = self._continuous()
        out = Transform.identity(self.spec)
        out.rotation = t.rotation.detach().float().cpu()
        out.scale = float(t.scale)
        for i, layer in enumerate(self.layers):
            for name in ("qk_maps", "ov_maps", "glu_scale"):
                value = getattr(t, name)[i]
                getattr(out, name)[i] = None if value is None else value.detach().float().cpu()
            out.head_perm[i] = layer.fixed_head_perm
            out.ffn_perm[i] = layer.fixed_ffn_perm
        return out
