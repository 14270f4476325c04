"""Data-free weight matching over the full symmetry group (docs/design.md §4), by coordinate descent:

    rotation G (Procrustes)  ->  head permutations (QK/OV circuits)  ->  FFN permutations
    ->  per-head QK/OV maps and GLU scales (closed form)  ->  G again ...

Both endpoints are first brought to a canonical factorisation: every head's QK and OV circuit is
split in balanced form (both factors carry the circuit's singular values) and every GLU unit has
equal up/down norms.  Those maps are A's transform; B's transform adds the permutations, the
rotation and the orthogonal freedom left inside each balanced head, fitted to A.
"""
from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from ..core.canonical import Graph, Spec, layer_key, residual_role
from ..core.symmetry import Transform, apply, rotary_pairs, rotate_residual, transform_layer
from ..progress import conclude, tqdm
from .alignment import Alignment
from .experts import expert_glu_balance, match_expert_glu_scales, match_experts
from .linalg import (
    assignment,
    balance,
    best_permutation_matrix,
    best_signed_permutation_matrix,
    procrustes,
    procrustes_fixing_ones,
    rotation_2d,
)

# --- per-head views --------------------------------------------------------------------------

def _with_bias(p: dict, i: int, name: str) -> Tensor:
    """A read projection with its bias appended as an extra input row (the constant-1 input)."""
    w = p[layer_key(i, f"attn.{name}")]
    b = p.get(layer_key(i, f"attn.{name}_bias"))
    return w if b is None else torch.cat([w, b[None]], dim=0)


def head_factors(p: dict, i: int, spec: Spec):
    """Q (n, H, hd), K (n, Hkv, hd), V (n, Hkv, hd), O (H, hd, d) of layer i."""
    hd = spec.head_dim
    q, k, v = (_with_bias(p, i, n) for n in "qkv")
    return (q.reshape(q.shape[0], spec.n_heads, hd), k.reshape(k.shape[0], spec.n_kv_heads, hd),
            v.reshape(v.shape[0], spec.n_kv_heads, hd), p[layer_key(i, "attn.o")].reshape(spec.n_heads, hd, -1))


def head_scores(pa: dict, pb: dict, i: int, spec: Spec) -> Tensor:
    """score[a, b]: similarity of query head a of A and b of B by their QK and OV circuits
    (W_Q W_K^T and W_V W_O, invariant to the per-head maps), each term normalised by A's own size."""
    qa, ka, va, oa = head_factors(pa, i, spec)
    qb, kb, vb, ob = head_factors(pb, i, spec)
    group = torch.arange(spec.n_heads) // spec.group_size
    xq = torch.einsum("nai,nbj->abij", qa, qb)
    xk = torch.einsum("nai,nbj->abij", ka, kb)[group][:, group]
    xv = torch.einsum("nai,nbj->abij", va, vb)[group][:, group]
    xo = torch.einsum("aid,bjd->abij", oa, ob)
    qk, ov = (xq * xk).sum((2, 3)), (xv * xo).sum((2, 3))
    qk_self = (torch.einsum("nai,naj->aij", qa, qa) * torch.einsum("nai,naj->aij", ka, ka)[group]).sum((1, 2))
    ov_self = (torch.einsum("nai,naj->aij", va, va)[group] * torch.einsum("aid,ajd->aij", oa, oa)).sum((1, 2))
    return qk / qk_self.sum().clamp_min(1e-30) + ov / ov_self.sum().clamp_min(1e-30)


def match_heads(score: Tensor, spec: Spec) -> Tensor:
    """Head permutation from scores: KV groups matched whole, query heads matched inside groups."""
    gs, nkv = spec.group_size, spec.n_kv_heads
    if gs == 1:
        return assignment(score)
    blocks = score.reshape(nkv, gs, nkv, gs).permute(0, 2, 1, 3)  # (ga, gb, a, b)
    inner = [[assignment(blocks[ga, gb]) for gb in range(nkv)] for ga in range(nkv)]
    value = torch.tensor([[float(blocks[ga, gb][torch.arange(gs), inner[ga][gb]].sum()) for gb in range(nkv)]
                          for ga in range(nkv)])
    groups = assignment(value)
    return torch.cat([groups[ga] * gs + inner[ga][int(groups[ga])] for ga in range(nkv)])


# --- FFN ---------------------------------------------------------------------------------------

def _ffn_reads(p: dict, i: int, name: str) -> Tensor | None:
    w = p.get(layer_key(i, f"mlp.{name}"))
    if w is None:
        return None
    b = p.get(layer_key(i, f"mlp.{name}_bias"))
    return w if b is None else torch.cat([w, b[None]], dim=0)


def glu_balance(p: dict, i: int) -> Tensor:
    """Per-unit scale a making ||up_u a|| = ||down_u / a|| (GLU value scaling is free)."""
    up, down = _ffn_reads(p, i, "up"), p[layer_key(i, "mlp.down")]
    return (down.norm(dim=1) / up.norm(dim=0).clamp_min(1e-30)).clamp_min(1e-30).sqrt()


def ffn_scores(pa: dict, pb: dict, i: int, spec: Spec) -> Tensor:
    up_a, up_b = _ffn_reads(pa, i, "up"), _ffn_reads(pb, i, "up")
    down_a, down_b = pa[layer_key(i, "mlp.down")], pb[layer_key(i, "mlp.down")]
    if spec.glu:  # compare B's units in balanced form; the sign of a GLU unit's value path is free
        s = glu_balance(pb, i)
        up_b, down_b = up_b * s, down_b / s[:, None]
        gate = _ffn_reads(pa, i, "gate").T @ _ffn_reads(pb, i, "gate")
        return gate + (up_a.T @ up_b + down_a @ down_b.T).abs()
    return up_a.T @ up_b + down_a @ down_b.T


def match_glu_scales(pa: dict, pb: dict, i: int) -> Tensor:
    """B's (already permuted) unit scales: balanced, with the sign that agrees with A."""
    s = glu_balance(pb, i)
    up_a, up_b = _ffn_reads(pa, i, "up"), _ffn_reads(pb, i, "up") * s
    down_a, down_b = pa[layer_key(i, "mlp.down")], pb[layer_key(i, "mlp.down")] / s[:, None]
    agree = (up_a * up_b).sum(0) + (down_a * down_b).sum(1)
    return torch.where(agree < 0, -s, s)


# --- per-head maps -------------------------------------------------------------------------------

def _map_dims(spec: Spec, for_qk: bool):
    pairs = rotary_pairs(spec) if for_qk else []
    paired = {j for pair in pairs for j in pair}
    free = torch.tensor([j for j in range(spec.head_dim) if j not in paired], dtype=torch.long)
    if pairs:
        ia, ib = (torch.tensor(x, dtype=torch.long) for x in zip(*pairs))
    else:
        ia = ib = torch.zeros(0, dtype=torch.long)
    return ia, ib, free


def constrained_balance(left: Tensor, right: Tensor, dims) -> Tensor:
    """Balance the circuit left @ right^T within the allowed maps: on RoPE pairs a scale per pair,
    on free dims the full balanced factorisation."""
    ia, ib, free = dims
    hd = left.shape[1]
    m = torch.zeros(hd, hd, dtype=left.dtype)
    if len(ia):
        norm = lambda x: (x[:, ia].pow(2) + x[:, ib].pow(2)).sum(0).sqrt()
        alpha = (norm(right) / norm(left).clamp_min(1e-30)).clamp_min(1e-30).sqrt()
        m[ia, ia], m[ib, ib] = alpha, alpha
    if len(free):
        m[free[:, None], free[None, :]] = balance(left[:, free], right[:, free])
    return m


def constrained_orthogonal(x: Tensor, dims) -> Tensor:
    """argmax tr(O^T x) over orthogonal O within the allowed maps (2-D rotations on RoPE pairs)."""
    ia, ib, free = dims
    o = torch.zeros_like(x)
    if len(ia):
        block = torch.stack([torch.stack([x[ia, ia], x[ia, ib]], -1), torch.stack([x[ib, ia], x[ib, ib]], -1)], -2)
        r = rotation_2d(block)
        o[ia, ia], o[ia, ib], o[ib, ia], o[ib, ib] = r[:, 0, 0], r[:, 0, 1], r[:, 1, 0], r[:, 1, 1]
    if len(free):
        o[free[:, None], free[None, :]] = procrustes(x[free][:, free])
    return o


def _group_circuits(factors, spec: Spec, g: int):
    """(left, right) factors of the QK and OV circuits of KV group g, query heads stacked (factors: head_factors
    of the layer, computed once per layer)."""
    q, k, v, o = factors
    heads = range(g * spec.group_size, (g + 1) * spec.group_size)
    qk = (torch.cat([q[:, h] for h in heads]), k[:, g])
    ov = (v[:, g], torch.cat([o[h].T for h in heads]))
    return qk, ov


def balance_maps(p: dict, i: int, spec: Spec) -> tuple[Tensor | None, Tensor | None]:
    """The balancing QK and OV maps of layer i (None for a kind of map the spec does not allow)."""
    qk_dims, ov_dims = _map_dims(spec, True), _map_dims(spec, False)
    qk, ov = [], []
    factors = head_factors(p, i, spec)
    for g in range(spec.n_kv_heads):
        (ql, qr), (vl, vr) = _group_circuits(factors, spec, g)
        qk.append(constrained_balance(ql, qr, qk_dims))
        ov.append(constrained_balance(vl, vr, ov_dims))
    return (torch.stack(qk) if spec.qk_maps else None), (torch.stack(ov) if spec.ov_maps else None)


def fit_maps(pa: dict, pb: dict, i: int, spec: Spec) -> tuple[Tensor | None, Tensor | None]:
    """B's per-group QK and OV maps: balance, then the best orthogonal map onto A's balanced heads (None for a
    kind of map the spec does not allow)."""
    qk_dims, ov_dims = _map_dims(spec, True), _map_dims(spec, False)
    maps = {"qk": [], "ov": []}
    factors_a, factors_b = head_factors(pa, i, spec), head_factors(pb, i, spec)
    for g in range(spec.n_kv_heads):
        circuits_a, circuits_b = _group_circuits(factors_a, spec, g), _group_circuits(factors_b, spec, g)
        for name, (la, ra), (lb, rb), dims in zip(("qk", "ov"), circuits_a, circuits_b, (qk_dims, ov_dims)):
            m = constrained_balance(lb, rb, dims)
            lb_m, rb_m = lb @ m, rb @ torch.linalg.inv(m).T
            o = constrained_orthogonal(lb_m.T @ la + rb_m.T @ ra, dims)
            maps[name].append(m @ o)
    return (torch.stack(maps["qk"]) if spec.qk_maps else None), (torch.stack(maps["ov"]) if spec.ov_maps else None)


def fit_continuous(la: dict, lbp: dict, i: int, spec: Spec, t: Transform) -> None:
    """Set t's per-head maps and GLU scales of layer i in closed form, from A's balanced layer la and B's layer lbp
    already in A's frame (rotated and permuted)."""
    if spec.head_maps:
        t.qk_maps[i], t.ov_maps[i] = fit_maps(la, lbp, i, spec)
    if spec.glu and spec.ffn_dim:
        t.glu_scale[i] = match_glu_scales(la, lbp, i)
    if spec.n_experts:
        t.expert_glu_scale[i] = match_expert_glu_scales(la, lbp, i, spec)


# --- residual ------------------------------------------------------------------------------

def residual_cross(pa: dict, pb: dict) -> Tensor:
    """M (2, d, d) with tr(G^T M[0]) + tr(|G|^T M[1]) = sum of <B-tensor under G, A-tensor> over every
    residual-facing tensor: M[0] from the writes and reads (which G rotates), M[1] from the post-norm gains
    (which a signed permutation G only permutes, w -> w |G|; zero where a spec has none).

    Plain Frobenius inner products, so G maximises exactly the overlap that relative_distance
    measures.  (Normalising each tensor to count alike gave the small positional embedding and the
    final norm's bias as much say as the token embeddings, and G came out nearly unrelated to the
    rotation between the two residual streams.)  Each product in fp32, the sum in fp64."""
    m = None
    for key, a in pa.items():
        role, b = residual_role(key), pb[key]
        if role in ("write", "norm_bias", "gain", "transit_bias"):
            term = (b.reshape(-1, b.shape[-1]).T.float() @ a.reshape(-1, a.shape[-1]).float()).double()
        elif role == "read":
            term = (b.float() @ a.T.float()).double()
        else:
            continue
        if m is None:
            m = term.new_zeros(2, *term.shape)
        m[1 if role in ("gain", "transit_bias") else 0] += term
    return m


def solve_rotation(m: Tensor, spec: Spec, residual: str) -> Tensor:
    """The residual element maximising the overlap tr(G^T M[0]) + tr(|G|^T M[1]) (residual_cross): over the
    permutations for the ablation, else over the spec's residual group (signed permutations: an assignment on
    |M[0]| + M[1]; rotations: Procrustes, where M[1] is zero)."""
    if residual == "permutation":
        return best_permutation_matrix(m[0] + m[1]).float()
    if spec.residual == "signed_permutation":  # the whole residual group of the spec
        return best_signed_permutation_matrix(m[0], m[1], one_sign=spec.centred).float()
    return (procrustes_fixing_ones(m[0]) if spec.centred else procrustes(m[0])).float()


def balance_transform(graph, head_maps: bool = True, glu: bool = True) -> Transform:
    """The canonical factorisation of one model (its transform in weight matching), one layer at a time."""
    spec, t = graph.spec, Transform.identity(graph.spec)
    if not ((head_maps and spec.head_maps) or (glu and spec.glu)):
        return t
    for i in range(spec.n_layers):
        p = graph.layer(i)
        if head_maps and spec.head_maps:
            t.qk_maps[i], t.ov_maps[i] = balance_maps(p, i, spec)  # None where the spec allows no such map
        if glu and spec.glu and spec.ffn_dim:
            t.glu_scale[i] = glu_balance(p, i)
        if glu and spec.n_experts:
            t.expert_glu_scale[i] = expert_glu_balance(p, i, spec)
    return t


def _sq(tensors: dict) -> float:
    # fp32 products, torch's cascade summation per tensor (relative error ~1e-7), tensors summed in fp64
    return sum(float(v.float().square().sum()) for v in tensors.values())


def _dot(pa: dict, pb: dict, only_unrotated: bool = False) -> float:
    return sum(float((a.float() * pb[k].float()).sum()) for k, a in pa.items()
               if not only_unrotated or residual_role(k) is None)


def relative_distance(pa, b, t: Transform) -> float:
    """sum ||A - t(B)||^2 / sum ||A||^2 over all tensors (A a graph or a dict of its tensors), layer by layer."""
    a = pa if hasattr(pa, "layer") else Graph(b.spec, pa, b.norm_eps)
    num = den = 0.0
    def groups():  # one layer pair at a time
        yield a.outside(), {k: rotate_residual(k, v, t) for k, v in b.outside().items()}
        for i in range(b.spec.n_layers):
            yield a.layer(i), transform_layer(b.layer(i), i, b.spec, t)
    for ga, gb in groups():
        for k, x in ga.items():
            num += float((x - gb[k]).pow(2).sum(dtype=torch.float64))
            den += float(x.pow(2).sum(dtype=torch.float64))
    return num / max(den, 1e-30)


class _Round:
    """One round of coordinate descent, streamed layer by layer.  The FFN assignment of a layer (the costly
    exact solve) runs in a worker thread while the next layer's scores are computed."""

    def __init__(self, pa, b, t: Transform, full: bool, pool: ThreadPoolExecutor, first: bool, expert_cost: str):
        self.pa, self.b, self.t, self.full, self.pool, self.first = pa, b, t, full, pool, first
        self.expert_cost = expert_cost
        self.spec = b.spec
        self.rotated_only = Transform.identity(self.spec)
        self.rotated_only.rotation, self.rotated_only.scale = t.rotation, t.scale
        self.norm_a = self.norm_b_raw = self.overlap_start = 0.0  # for the distance of the start (round 1 only)
        self.norm_b = self.unrotated = 0.0
        self.m = None

    def prepare(self, i: int) -> dict:
        spec = self.spec
        la, lb_raw = self.pa.layer(i), self.b.layer(i)
        lb = transform_layer(lb_raw, i, spec, self.rotated_only)
        if self.first:
            self.norm_a += _sq(la)
            self.norm_b_raw += _sq(lb_raw)
            self.overlap_start += _dot(la, lb)
        head_perm = match_heads(head_scores(la, lb, i, spec), spec)
        ffn = self.pool.submit(assignment, ffn_scores(la, lb, i, spec)) if spec.ffn_dim else None
        experts = self.pool.submit(match_experts, la, lb, i, spec, self.expert_cost) if spec.n_experts else None
        return {"i": i, "la": la, "lb": lb, "lb_raw": lb_raw, "head_perm": head_perm, "ffn": ffn, "experts": experts}

    def finish(self, job: dict) -> None:
        i, spec, t = job["i"], self.spec, self.t
        perms = Transform.identity(spec)
        perms.head_perm[i], perms.ffn_perm[i] = job["head_perm"], job["ffn"] and job["ffn"].result()
        if job["experts"] is not None:
            perms.expert_perm[i], perms.expert_unit_perm[i] = job["experts"].result()
        lbp = transform_layer(job["lb"], i, spec, perms, rotate=False)
        for name in ("head_perm", "ffn_perm", "expert_perm", "expert_unit_perm"):
            getattr(t, name)[i] = getattr(perms, name)[i]
        if self.full:
            fit_continuous(job["la"], lbp, i, spec, t)
        b_prime = transform_layer(job["lb_raw"], i, spec, t, rotate=False)
        cross = residual_cross(job["la"], b_prime)
        self.m = cross if self.m is None else self.m + cross
        self.norm_b += _sq(b_prime)
        self.unrotated += _dot(job["la"], b_prime, only_unrotated=True)

    def run(self, bar) -> None:
        pending = self.prepare(0)
        for i in range(self.spec.n_layers):
            following = self.prepare(i + 1) if i + 1 < self.spec.n_layers else None
            self.finish(pending)
            pending = following
            bar.update(1)


def weight_matching(a, b, *, residual: str = "orthogonal", head_maps: bool = True, max_rounds: int = 10,
                    tol: float = 1e-4, progress: bool = True, balance_a: bool = True, expert_cost: str = "units"):
    """Find (t_a, t_b) with apply(b, t_b) close to apply(a, t_a) in weight space, reading the models one layer
    at a time (a and b may be lazy graphs over their checkpoint files).

    residual="orthogonal" is the full group the spec declares (its residual part a signed permutation where the
    spec says so); residual="permutation" with head_maps=False is the
    permutation-only ablation (Git Re-Basin's treatment of the residual stream).  balance_a=False keeps
    a as it is (t_a = identity): used when a is the running average of several aligned models.

    The distance sum ||A - t(B)||^2 / sum ||A||^2 of each round is computed without another pass: the group
    acts orthogonally on the residual-facing tensors, so ||t(B)||^2 is the norm of B after the permutations and
    maps, and the overlap of the rotated tensors is tr(G^T M) with M the cross-products the round accumulated."""
    spec = a.spec
    full = head_maps
    t_a = balance_transform(a, head_maps=full and balance_a, glu=full and balance_a)
    pa = apply(a, t_a)
    out_a, out_b = pa.outside(), b.outside()
    m_out = residual_cross(out_a, out_b)
    norm_a_out, norm_b_out, unrotated_out = _sq(out_a), _sq(out_b), _dot(out_a, out_b, only_unrotated=True)
    t = Transform.identity(spec)
    # Seed G from what both models index alike: embeddings (tokens, positions, patches) and the head.
    t.rotation = solve_rotation(m_out, spec, residual)
    log, best, best_distance, norm_a = [], None, None, None
    bar = tqdm(total=max_rounds * spec.n_layers, desc="weight matching", disable=not progress, leave=False)
    with ThreadPoolExecutor(max_workers=1) as pool:
        for round_ in range(1, max_rounds + 1):
            start, started = copy.deepcopy(t), time.perf_counter()
            step = _Round(pa, b, t, full, pool, first=round_ == 1, expert_cost=expert_cost)
            step.run(bar)
            if round_ == 1:
                norm_a = norm_a_out + step.norm_a
                overlap = (_trace(start.rotation, m_out) + unrotated_out + step.overlap_start
                           + _transit_overlap(out_a, out_b, start.rotation))
                distance = (norm_a + norm_b_out + step.norm_b_raw - 2 * overlap) / max(norm_a, 1e-30)
                log.append({"round": 0, "step": "init", "distance": distance})
                best, best_distance = start, distance
            m = m_out + step.m
            t.rotation = solve_rotation(m, spec, residual)
            overlap = (_trace(t.rotation, m) + unrotated_out + step.unrotated
                       + _transit_overlap(out_a, out_b, t.rotation))
            distance = (norm_a + norm_b_out + step.norm_b - 2 * overlap) / max(norm_a, 1e-30)
            log.append({"round": round_, "distance": distance, "seconds": time.perf_counter() - started})
            bar.set_postfix(distance=f"{distance:.4f}")
            if distance < best_distance:
                best, best_distance = copy.deepcopy(t), distance
            previous = log[-2]["distance"]
            if previous - distance <= tol * max(previous, 1e-12):
                conclude(bar, f"converged after {round_} round{'s' * (round_ > 1)} (at most {max_rounds})")
                break
        else:
            conclude(bar, f"{max_rounds} rounds, the most allowed (not converged to within {tol:g})")
    settings = {"residual": residual, "head_maps": full, "max_rounds": max_rounds, "tol": tol}
    if spec.n_experts:
        settings["expert_cost"] = expert_cost
    return Alignment([t_a, best], log, settings)  # the steps are not all exact minimisers: keep the best round


def _transit_overlap(out_a: dict, out_b: dict, rotation: Tensor) -> float:
    """<A, G^T B |G|> of the transit tensors (an MLM head's dense layer): quadratic in G, so not in residual_cross's
    objective (G is chosen by everything else), but counted in the distance."""
    g = rotation.float()
    return sum(float((a.float() * (g.T @ out_b[k].float() @ g.abs())).sum()) for k, a in out_a.items()
               if residual_role(k) == "transit")


def _trace(rotation: Tensor, m: Tensor) -> float:
    """tr(G^T M[0]) + tr(|G|^T M[1]): the overlap of the residual-facing tensors under G (residual_cross)."""
    g = rotation.double()
    return float((g * m[0]).sum() + (g.abs() * m[1]).sum())
