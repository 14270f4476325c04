"""Closed-form pieces of matching: Procrustes, linear assignment, balanced factorisations."""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor


def procrustes(m: Tensor) -> Tensor:
    """argmax over orthogonal G of tr(G^T m)."""
    u, _, vh = torch.linalg.svd(m.double())
    return (u @ vh).to(m.dtype)


@lru_cache(maxsize=8)
def ones_complement(d: int) -> Tensor:
    """An orthonormal basis (d, d-1) of the subspace orthogonal to the all-ones vector."""
    basis, _ = torch.linalg.qr(torch.cat([torch.ones(d, 1, dtype=torch.float64),
                                          torch.eye(d, dtype=torch.float64)[:, : d - 1]], dim=1))
    return basis[:, 1:]


def _reflect_both_sides(x: Tensor, v: Tensor) -> Tensor:
    """H x H for the Householder reflection H = I - 2 v v^T / v^T v, in O(d^2)."""
    c = 2.0 / float(v @ v)
    x = x - c * torch.outer(v, v @ x)
    return x - c * torch.outer(x @ v, v)


def procrustes_fixing_ones(m: Tensor) -> Tensor:
    """argmax over orthogonal G with G·1 = ±1 of tr(G^T m) (the LayerNorm-export constraint).

    The reflection H swapping 1/sqrt(d) and e_1 turns the constraint into G' = H G H = diag(±1, R): R is the
    Procrustes solution of the trailing (d-1, d-1) block of H m H, and the sign that of 1^T m 1."""
    d = m.shape[0]
    m64 = m.double()
    ones = torch.full((d,), 1 / math.sqrt(d), dtype=torch.float64)
    sign = 1.0 if float(ones @ m64 @ ones) >= 0 else -1.0
    if d == 1:
        return torch.full((1, 1), sign, dtype=m.dtype)
    v = ones.clone()
    v[0] -= 1.0
    inner = torch.zeros(d, d, dtype=torch.float64)
    inner[0, 0] = sign
    inner[1:, 1:] = procrustes(_reflect_both_sides(m64, v)[1:, 1:])
    return _reflect_both_sides(inner, v).to(m.dtype)


try:  # an exact Jonker-Volgenant solver, about twice as fast as scipy's on 8192 x 8192 (BENCHMARKS.md)
    from lapjv import lapjv as _lapjv
except ImportError:  # optional: `pip install hf-rebasin[fast]`
    _lapjv = None

SOLVER = "lapjv" if _lapjv is not None else "scipy"
LAPJV_FROM = 256  # below this size scipy is as fast


def assignment(score: Tensor) -> Tensor:
    """perm maximising sum_j score[j, perm[j]]: row j of A is matched with column perm[j] of B (exact: scipy's
    shortest augmenting path, or lapjv's Jonker-Volgenant for large square problems when installed)."""
    cost = score.detach().double().cpu().numpy()
    if SOLVER == "lapjv" and cost.shape[0] == cost.shape[1] >= LAPJV_FROM:
        return torch.from_numpy(np.asarray(_lapjv(np.ascontiguousarray(-cost))[0], dtype=np.int64))
    rows, cols = linear_sum_assignment(cost, maximize=True)
    perm = np.empty(len(rows), dtype=np.int64)
    perm[rows] = cols
    return torch.from_numpy(perm)


def best_permutation_matrix(score: Tensor) -> Tensor:
    """The permutation matrix P maximising tr(P^T score) (Git Re-Basin's residual permutation)."""
    perm = assignment(score)
    p = torch.zeros_like(score)
    p[torch.arange(len(perm)), perm] = 1.0
    return p


def balance(left: Tensor, right: Tensor) -> Tensor:
    """The map M (f, f) that balances the factorisation left @ right^T of a circuit:
    left M and right M^-T become U S^½ and V S^½ (an SVD of the circuit), so that both factors carry
    the same singular values.  Computed from thin QRs, never forming the (n, n) circuit.  A rank-deficient
    factor (a zero head, zero-padded head dims of an embedded narrower model) keeps its null directions: any
    invertible M is exact there, so the zero pivots are replaced by the largest before solving."""
    _, rl = torch.linalg.qr(left.double(), mode="r")
    _, rr = torch.linalg.qr(right.double(), mode="r")
    pivots = torch.diagonal(rl).abs()
    top = float(pivots.max()) if pivots.numel() else 0.0
    if top == 0.0:
        return torch.eye(rl.shape[-1], dtype=left.dtype)
    rl = rl + torch.diag(torch.where(pivots <= top * 1e-6, top, 0.0).to(rl.dtype))
    u, s, _ = torch.linalg.svd(rl @ rr.T)
    s = s.clamp_min(float(s.max()) * 1e-12 if float(s.max()) > 0 else 1.0)
    m = torch.linalg.solve_triangular(rl, u * s.sqrt(), upper=True)
    return m.to(left.dtype)


def rotation_2d(x: Tensor) -> Tensor:
    """argmax over 2-D rotations R = [[c, s], [-s, c]] of tr(R^T x), for a batch of (2, 2) x."""
    angle = torch.atan2(x[..., 0, 1] - x[..., 1, 0], x[..., 0, 0] + x[..., 1, 1])
    c, s = torch.cos(angle), torch.sin(angle)
    return torch.stack([torch.stack([c, s], -1), torch.stack([-s, c], -1)], -2)


def best_signed_permutation_matrix(signed: Tensor, unsigned: Tensor | None = None, one_sign: bool = False) -> Tensor:
    """The signed permutation G maximising tr(G^T signed) + tr(|G|^T unsigned).  Per channel (G[i, π(i)] = s_i)
    the best s_i is the sign of signed[i, π(i)], so π is the assignment on |signed| + unsigned; with one sign for
    all channels (one_sign: G = ±P, a centred stream) the better of +P and -P, each assigned on ±signed + unsigned."""
    extra = torch.zeros_like(signed) if unsigned is None else unsigned
    if one_sign:
        plus, minus = best_permutation_matrix(signed + extra), best_permutation_matrix(extra - signed)
        value = lambda p, s: float((p * (s * signed + extra)).sum())
        return plus if value(plus, 1.0) >= value(minus, -1.0) else -minus
    p = best_permutation_matrix(signed.abs() + extra)
    return p * torch.where(signed < 0, -1.0, 1.0).to(p.dtype)

