"""Elements of the symmetry group of a canonical graph and their action (docs/design.md §3).

A :class:`Transform` holds one group element; ``None`` anywhere means the identity.
Semantics of ``apply(graph, t)``: new head ``j`` of layer ``i`` is old head
``t.head_perm[i][j]``; then the per-KV-group maps act on the permuted heads; new FFN unit
``j`` is old unit ``t.ffn_perm[i][j]``, then scaled by ``t.glu_scale[i][j]``; finally the
residual stream is rotated by G and scaled by g.  Every operation is differentiable in the
continuous parameters, so learned matching can train through it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .canonical import LazyGraph, Spec, layer_key, residual_role
from .experts import FIELDS as EXPERT_FIELDS
from .experts import compose_experts, describe_experts, random_experts, transform_experts

PER_LAYER = ("head_perm", "qk_maps", "ov_maps", "ffn_perm", "glu_scale") + EXPERT_FIELDS


@dataclass
class Transform:
    rotation: Tensor | None = None  # G, (d, d) orthogonal
    scale: Tensor | float = 1.0  # g > 0
    head_perm: list[Tensor | None] = field(default_factory=list)  # (n_heads,) per layer
    qk_maps: list[Tensor | None] = field(default_factory=list)  # (n_kv_heads, hd, hd) per layer
    ov_maps: list[Tensor | None] = field(default_factory=list)  # (n_kv_heads, hd, hd) per layer
    ffn_perm: list[Tensor | None] = field(default_factory=list)  # (ffn,) per layer
    glu_scale: list[Tensor | None] = field(default_factory=list)  # (ffn,) per layer
    expert_perm: list[Tensor | None] = field(default_factory=list)  # (experts,) per layer (core/experts.py)
    expert_unit_perm: list[Tensor | None] = field(default_factory=list)  # (experts, expert_dim) per layer
    expert_glu_scale: list[Tensor | None] = field(default_factory=list)  # (experts, expert_dim) per layer

    @staticmethod
    def identity(spec: Spec) -> Transform:
        none = [None] * spec.n_layers
        return Transform(None, 1.0, *(list(none) for _ in PER_LAYER))

    def is_identity(self) -> bool:
        """True when the element is the identity as stored (no rotation, scale 1, no per-layer part), e.g. the
        reference model's transform in weight matching."""
        return (self.rotation is None and float(self.scale) == 1.0
                and all(v is None for name in PER_LAYER for v in getattr(self, name)))

    def per_layer(self, name: str, i: int):
        items = getattr(self, name)
        return items[i] if i < len(items) else None

    # --- (de)serialisation as a flat dict of tensors (transforms.safetensors) ---
    def to_tensors(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {"scale": torch.as_tensor(self.scale, dtype=torch.float32).reshape(())}
        if self.rotation is not None:
            out["rotation"] = self.rotation
        for name in PER_LAYER:
            for i, value in enumerate(getattr(self, name)):
                if value is not None:
                    out[f"{name}.{i}"] = value
        return {k: v.detach().contiguous().cpu() for k, v in out.items()}

    @staticmethod
    def from_tensors(tensors: dict[str, Tensor], spec: Spec) -> Transform:
        t = Transform.identity(spec)
        t.rotation = tensors.get("rotation")
        t.scale = float(tensors["scale"]) if "scale" in tensors else 1.0
        for key, value in tensors.items():
            if "." in key:
                name, i = key.rsplit(".", 1)
                getattr(t, name)[int(i)] = value
        return t


def kv_perm_of(head_perm: Tensor, group_size: int) -> Tensor:
    """The KV-group permutation a query-head permutation implies; raises if it splits groups.  Checked where the
    values are on the host only (a device would make the host wait: the learned parameters check theirs once,
    on the host, when they are made)."""
    groups = head_perm.view(-1, group_size) // group_size
    if groups.device.type == "cpu" and not bool((groups == groups[:, :1]).all()):
        raise ValueError("head permutation mixes query heads of different KV groups")
    return groups[:, 0]


def _per_query_head(maps: Tensor, group_size: int) -> Tensor:
    """(KV groups, hd, hd) -> (heads, hd, hd): each group's map repeated for its query heads (no index tensor)."""
    if group_size == 1:
        return maps
    groups, hd = maps.shape[0], maps.shape[-1]
    return maps[:, None].expand(groups, group_size, hd, hd).reshape(groups * group_size, hd, hd)


def _map_heads(x: Tensor, maps: Tensor, head_dim: int) -> Tensor:
    """x: (..., n * head_dim) with heads on the last axis; maps: (n, hd, hd); x_h -> x_h M_h."""
    shape = x.shape
    xh = x.reshape(*shape[:-1], -1, head_dim)
    return torch.einsum("...hi,hij->...hj", xh, maps).reshape(shape)


def _permute_heads(x: Tensor, perm: Tensor, head_dim: int, dim: int) -> Tensor:
    """Permute whole heads of size head_dim along axis ``dim`` of x."""
    dim = dim % x.dim()
    shape = x.shape
    xh = x.reshape(*shape[:dim], -1, head_dim, *shape[dim + 1:])
    return xh.index_select(dim, perm).reshape(shape)


def permute_layer_heads(p: dict[str, Tensor], i: int, spec: Spec, t: Transform) -> None:
    """Layer i's attention tensors in `p` with t's head permutation, in place (the key/value heads of grouped-query
    attention follow their query groups)."""
    hd, gs = spec.head_dim, spec.group_size
    key = lambda name: layer_key(i, name)
    perm = t.per_layer("head_perm", i)
    if perm is not None:
        kv_perm = kv_perm_of(perm, gs)
        for name, heads in (("q", perm), ("k", kv_perm), ("v", kv_perm)):
            for suffix in ("", "_bias"):
                if key(f"attn.{name}{suffix}") in p:
                    p[key(f"attn.{name}{suffix}")] = _permute_heads(p[key(f"attn.{name}{suffix}")], heads, hd, -1)
        p[key("attn.o")] = _permute_heads(p[key("attn.o")], perm, hd, 0)
        if spec.qk_norm == "projection":  # a QK-norm gain per coordinate of the projection moves with its head
            for name, heads in (("q_norm", perm), ("k_norm", kv_perm)):
                p[key(f"attn.{name}")] = _permute_heads(p[key(f"attn.{name}")], heads, hd, -1)


def transform_layer(params: dict[str, Tensor], i: int, spec: Spec, t: Transform,
                    rotate: bool = True) -> dict[str, Tensor]:
    """The tensors of layer i under t (head/FFN permutations, per-head maps, GLU scales and, unless
    rotate=False, the residual rotation and scale).  Reads only layer i's keys of params."""
    prefix = f"layers.{i}."
    p = {k: v for k, v in params.items() if k.startswith(prefix)}
    hd, gs = spec.head_dim, spec.group_size
    key = lambda name: layer_key(i, name)
    permute_layer_heads(p, i, spec, t)

    # the maps are inverted by inv_ex: invertible by construction, and no error check that would make the host
    # wait for a GPU; the inverses are small fp32 matrices (CUDA has no bf16 linalg), applied by matmuls, which
    # autocast runs in its dtype like every other product with the weights
    m = t.per_layer("qk_maps", i)
    if m is not None:
        m_inv_t = torch.linalg.inv_ex(m)[0].transpose(-1, -2)
        for name, maps in (("q", _per_query_head(m, gs)), ("k", m_inv_t)):
            for suffix in ("", "_bias"):
                if key(f"attn.{name}{suffix}") in p:
                    p[key(f"attn.{name}{suffix}")] = _map_heads(p[key(f"attn.{name}{suffix}")], maps, hd)
    n = t.per_layer("ov_maps", i)
    if n is not None:
        for suffix in ("", "_bias"):
            if key(f"attn.v{suffix}") in p:
                p[key(f"attn.v{suffix}")] = _map_heads(p[key(f"attn.v{suffix}")], n, hd)
        o = p[key("attn.o")].reshape(spec.n_heads, hd, -1)
        if o.dtype == n.dtype:  # the more accurate solve where the operands share a dtype (no autocast cast)
            o = torch.linalg.solve_ex(_per_query_head(n, gs), o)[0]
        else:
            o = torch.matmul(_per_query_head(torch.linalg.inv_ex(n)[0], gs), o)
        p[key("attn.o")] = o.reshape(spec.n_heads * hd, -1)

    fperm = t.per_layer("ffn_perm", i)
    s = t.per_layer("glu_scale", i)
    for name in ("up", "gate"):
        for suffix in ("", "_bias"):
            k_ = key(f"mlp.{name}{suffix}")
            if k_ not in p:
                continue
            if fperm is not None:
                p[k_] = p[k_].index_select(-1, fperm)
            if s is not None and name == "up":
                p[k_] = p[k_] * s
    if fperm is not None and key("mlp.down") in p:
        p[key("mlp.down")] = p[key("mlp.down")].index_select(0, fperm)
    if s is not None and key("mlp.down") in p:
        p[key("mlp.down")] = p[key("mlp.down")] / s[:, None]
    transform_experts(p, i, spec, t)
    if rotate:
        p = {k: rotate_residual(k, v, t) for k, v in p.items()}
    return p


def rotate_residual(key: str, value: Tensor, t: Transform) -> Tensor:
    """One tensor under the residual rotation G and scale g (writes W -> W gG, reads W -> G^T W)."""
    g_rot, g = t.rotation, t.scale
    role = residual_role(key)
    if role == "write":
        value = value if g_rot is None else value @ g_rot
        return value if isinstance(g, (int, float)) and g == 1.0 else value * g
    if g_rot is not None and role == "read":
        return g_rot.T @ value
    if g_rot is not None and role == "norm_bias":
        return value @ g_rot
    if g_rot is not None and role == "transit":  # reads the stream, writes the tied space (through GELU: |G|)
        return g_rot.T @ value @ g_rot.abs()
    if g_rot is not None and role == "transit_bias":
        return value @ g_rot.abs()
    if role == "gain":
        # a norm gain w on the stream (timm's norm_pre) or on every write (post-norms): diag(w)·G = G·diag(w |G|) for
        # a signed permutation G only; a post-norm reads the write, scaled by g with eps g², so its gain carries g
        value = value if g_rot is None else value @ g_rot.abs()
        return value if isinstance(g, (int, float)) and g == 1.0 else value * g
    return value


class TransformedGraph(LazyGraph):
    """apply(graph, t) for a lazy graph: each part transformed when it is asked for."""

    def __init__(self, base, t: Transform):
        self.base, self.t, self.spec = base, t, base.spec
        self.norm_eps = base.norm_eps * float(t.scale) ** 2
        self.meta = dict(getattr(base, "meta", {}) or {})

    def outside(self) -> dict[str, Tensor]:
        return {k: rotate_residual(k, v, self.t) for k, v in self.base.outside().items()}

    def layer(self, i: int) -> dict[str, Tensor]:
        return transform_layer(self.base.layer(i), i, self.spec, self.t)


def apply(graph, t: Transform):
    """The graph transformed by the group element t (an exact function-preserving rewrite); lazy for a
    lazy graph, computed at once for a graph held in memory."""
    if isinstance(graph, LazyGraph):
        return TransformedGraph(graph, t)
    spec = graph.spec
    p = {k: rotate_residual(k, v, t) for k, v in graph.params.items() if not k.startswith("layers.")}
    for i in range(spec.n_layers):
        p.update(transform_layer(graph.params, i, spec, t))
    eps = graph.norm_eps * float(t.scale) ** 2  # norm(g x) with eps g^2 equals norm(x) with eps, exactly
    return graph.replace(p, norm_eps=eps)


# --- the group product ---------------------------------------------------------------------------

def _product(x: Tensor | None, y: Tensor | None) -> Tensor | None:
    if x is None:
        return y
    if y is None:
        return x
    return (x.double() @ y.double()).to(y.dtype)


def compose(t1: Transform, t2: Transform, spec: Spec) -> Transform:
    """The element t with apply(g, t) == apply(apply(g, t1), t2) (t1 first, then t2).

    Heads: new head j of the product is old head p1[p2[j]]; it carries t1's map of the group it
    came from, then t2's map of the group it lands in.  FFN units likewise; GLU scales multiply
    through t2's permutation.  Rotations and scales multiply: writes see W G1 G2 g1 g2."""
    out = Transform.identity(spec)
    out.rotation = _product(t1.rotation, t2.rotation)
    out.scale = float(t1.scale) * float(t2.scale)
    for i in range(spec.n_layers):
        p1, p2 = t1.per_layer("head_perm", i), t2.per_layer("head_perm", i)
        kv2 = None if p2 is None else kv_perm_of(p2, spec.group_size)
        out.head_perm[i] = p2 if p1 is None else (p1 if p2 is None else p1[p2])
        for name in ("qk_maps", "ov_maps"):
            m1, m2 = t1.per_layer(name, i), t2.per_layer(name, i)
            if m1 is not None and kv2 is not None:
                m1 = m1[kv2]
            getattr(out, name)[i] = _product(m1, m2)
        f1, f2 = t1.per_layer("ffn_perm", i), t2.per_layer("ffn_perm", i)
        out.ffn_perm[i] = f2 if f1 is None else (f1 if f2 is None else f1[f2])
        s1, s2 = t1.per_layer("glu_scale", i), t2.per_layer("glu_scale", i)
        if s1 is not None and f2 is not None:
            s1 = s1[f2]
        out.glu_scale[i] = s2 if s1 is None else (s1 if s2 is None else s1 * s2)
        if spec.n_experts:
            compose_experts(t1, t2, out, spec, i)
    return out


# --- random group elements (for tests and for disguising a model) ------------------------------

def random_orthogonal(n: int, gen: torch.Generator, dtype=torch.float64) -> Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=dtype))
    return q * torch.sign(torch.diagonal(r))  # Haar-distributed, det of either sign


def random_rotation_fixing_ones(d: int, gen: torch.Generator, dtype=torch.float64, sign: int = 1) -> Tensor:
    """Orthogonal G with G·1 = sign·1: a random rotation of the complement of the ones direction."""
    basis, _ = torch.linalg.qr(torch.cat([torch.ones(d, 1, dtype=dtype),
                                          torch.randn(d, d - 1, generator=gen, dtype=dtype)], 1))
    basis[:, 0] = torch.ones(d, dtype=dtype) / math.sqrt(d)
    inner = torch.block_diag(torch.tensor([[float(sign)]], dtype=dtype), random_orthogonal(d - 1, gen, dtype))
    return basis @ inner @ basis.T


def random_signed_permutation(d: int, gen: torch.Generator, dtype=torch.float64, one_sign: bool = False) -> Tensor:
    """A random permutation matrix times signs: one per channel, or one for all (one_sign: G·1 = ±1, centred)."""
    signs = torch.where(torch.rand(1 if one_sign else d, generator=gen) < 0.5, -1.0, 1.0).to(dtype)
    return torch.eye(d, dtype=dtype)[torch.randperm(d, generator=gen)] * signs[:, None]


def rotary_pairs(spec: Spec) -> list[tuple[int, int]]:
    """Index pairs (within a head) that RoPE rotates together."""
    r = spec.rotary_dims
    if r == 0:
        return []
    if spec.rotary_layout == "half":
        return [(i, i + r // 2) for i in range(r // 2)]
    if spec.rotary_layout == "interleaved":
        return [(2 * i, 2 * i + 1) for i in range(r // 2)]
    raise ValueError(f"unknown rotary layout {spec.rotary_layout!r}")


def _well_conditioned(n: int, gen: torch.Generator, dtype) -> Tensor:
    u, v = random_orthogonal(n, gen, dtype), random_orthogonal(n, gen, dtype)
    s = torch.exp(torch.empty(n, dtype=dtype).uniform_(-0.5, 0.5, generator=gen))
    return u @ torch.diag(s) @ v


def random_qk_map(spec: Spec, gen: torch.Generator, dtype=torch.float64) -> Tensor:
    """An invertible head-dim map that commutes with RoPE: scaled 2-D rotations on each rotary
    pair, any invertible map on the pass-through dimensions, no mixing between the two."""
    hd = spec.head_dim
    m = torch.zeros(hd, hd, dtype=dtype)
    for a, b in rotary_pairs(spec):
        angle = float(torch.rand((), generator=gen, dtype=dtype)) * 2 * math.pi
        radius = math.exp(float(torch.empty((), dtype=dtype).uniform_(-0.5, 0.5, generator=gen)))
        c, s = radius * math.cos(angle), radius * math.sin(angle)
        m[a, a], m[a, b], m[b, a], m[b, b] = c, s, -s, c
    free = [j for j in range(hd) if j not in {x for pair in rotary_pairs(spec) for x in pair}]
    if free:
        idx = torch.tensor(free)
        m[idx[:, None], idx[None, :]] = _well_conditioned(len(free), gen, dtype)
    return m


def random_transform(spec: Spec, seed: int = 0, dtype=torch.float32, scale: float | None = None) -> Transform:
    """A random element of the group the spec allows (every factor non-trivial where allowed)."""
    gen = torch.Generator().manual_seed(seed)
    d, L = spec.d_model, spec.n_layers
    if spec.residual == "signed_permutation":
        rotation = random_signed_permutation(d, gen, one_sign=spec.centred)
    elif spec.centred:
        sign = 1 if torch.rand((), generator=gen) < 0.5 else -1
        rotation = random_rotation_fixing_ones(d, gen, sign=sign)
    else:
        rotation = random_orthogonal(d, gen)
    if scale is None:
        scale = math.exp(float(torch.empty(()).uniform_(-0.4, 0.4, generator=gen))) if spec.scale_exact else 1.0
    t = Transform(rotation.to(dtype), scale)
    gs = spec.group_size
    for _ in range(L):
        kv = torch.randperm(spec.n_kv_heads, generator=gen)
        within = [torch.randperm(gs, generator=gen) for _ in range(spec.n_kv_heads)]
        t.head_perm.append(torch.cat([kv[j] * gs + within[j] for j in range(spec.n_kv_heads)]))
        t.qk_maps.append(torch.stack([random_qk_map(spec, gen) for _ in range(spec.n_kv_heads)]).to(dtype)
                         if spec.qk_maps else None)
        t.ov_maps.append(torch.stack([_well_conditioned(spec.head_dim, gen, torch.float64)
                                      for _ in range(spec.n_kv_heads)]).to(dtype) if spec.ov_maps else None)
        t.ffn_perm.append(torch.randperm(spec.ffn_dim, generator=gen) if spec.ffn_dim else None)
        if spec.glu and spec.ffn_dim:
            signs = torch.where(torch.rand(spec.ffn_dim, generator=gen) < 0.5, -1.0, 1.0)
            magnitude = torch.exp(torch.empty(spec.ffn_dim).uniform_(-0.7, 0.7, generator=gen))
            t.glu_scale.append((signs * magnitude).to(dtype))
        else:
            t.glu_scale.append(None)
        for name, value in zip(EXPERT_FIELDS, random_experts(spec, gen, dtype) if spec.n_experts else (None,) * 3):
            getattr(t, name).append(value)
    return t


def describe_group(spec: Spec) -> list[str]:
    """Human-readable summary of the symmetry group hf-rebasin uses for this spec."""
    d, hd = spec.d_model, spec.head_dim
    lines = []
    if spec.residual == "signed_permutation":
        sign = "times one sign (G·1 = ±1 keeps the stream centred)" if spec.centred else "with a sign per coordinate"
        lines.append(f"residual: signed permutations of the {d} coordinates only, {sign}, shared by all layers; no "
                     "rotations (a norm gain on the stream itself, timm's norm_pre and post-LN encoders such as BERT, "
                     "or after a norm on every residual write, post-norms: for generic gains no other orthogonal map "
                     "passes it)")
    elif spec.centred:
        lines.append(f"residual rotation: orthogonal {d}x{d} fixing the all-ones direction (G·1 = ±1, "
                     "LayerNorm export keeps the stream centred), shared by all layers")
    else:
        lines.append(f"residual rotation: any orthogonal {d}x{d}, shared by all layers")
    kept = spec.residual != "orthogonal" or spec.qk_norm != "none"
    lines.append("residual scale g: exact (norm eps rescaled in the exported config)" if spec.scale_exact
                 else "residual scale g: fixed to 1 (" + ("not exact with the kept norm gains: see the notes" if kept
                                                          else "the exported norm eps cannot be rescaled") + ")")
    if spec.n_kv_heads == spec.n_heads:
        lines.append(f"head permutations: {spec.n_heads} heads per layer, {spec.n_layers} layers")
    else:
        lines.append(f"head permutations: {spec.n_kv_heads} KV groups of {spec.group_size} query heads (GQA), "
                     "groups permuted whole, query heads within a group")
    owner = "per head" if spec.group_size == 1 else "per KV group, shared by its query heads"
    if not spec.qk_maps:
        why = {"none": "clip_qkv clamps q and k elementwise, which no head-dim map commutes with",
               "head": "q_norm/k_norm normalise each head and then apply a gain, which no head-dim map commutes with",
               "projection": "q_norm/k_norm normalise the whole projection and then apply a gain per coordinate, "
                             "which no head-dim map commutes with"}[spec.qk_norm]
        lines.append(f"QK maps: none ({why})")
    else:
        if spec.rotary_dims:
            lines.append(f"QK maps ({owner}): {spec.free_head_dims} of {hd} head dims free, "
                         f"{spec.rotary_dims} restricted by RoPE to scaled rotations per frequency pair "
                         f"({spec.rotary_layout} layout)")
        else:
            lines.append(f"QK maps ({owner}): any invertible {hd}x{hd} (no RoPE)")
    lines.append(f"OV maps ({owner}): any invertible {hd}x{hd}" if spec.ov_maps
                 else "OV maps: none (clip_qkv clamps v elementwise)")
    lines += describe_experts(spec)
    if spec.n_experts:
        return lines
    lines.append(f"FFN permutations: {spec.ffn_dim} hidden units per layer")
    if spec.glu:
        lines.append(f"GLU value scaling: {spec.ffn_dim} nonzero scales per layer (up times s, down rows "
                     "over s, the gate untouched: exact for any gate activation)")
    return lines
