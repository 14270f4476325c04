"""Models of different widths (docs/design.md §7, Theus et al. Fig. 3c): a narrow model written EXACTLY into a wider
configuration of its class, after which it is an ordinary model of the wide class and every matching method
applies to it unchanged.  Plain functions of the canonical graph and the two Specs; no adapter is consulted.

Residual stream: x_wide = g · x_narrow E, with E (d_n x d_w) semi-orthogonal (E E^T = I; for LayerNorm models
the rows of E are orthogonal to the all-ones vector, so the wide stream stays centred).  RMSNorm0 over d_w sees
mean(x_w^2) = g^2 (d_n/d_w) mean(x_n^2), so with g^2 = (d_w/d_n)(eps_w/eps_n) the wide norm (eps_w) outputs
sqrt(d_w/d_n) · norm_n(x_n) E exactly.  Hence writes W -> g W E, reads W -> sqrt(d_n/d_w) E^T W, and the final
norm's bias (added after the norm) b -> sqrt(d_w/d_n) b E.  The scale g is a choice of the embedding, not a
rescaled config eps, so this is exact also where the class fixes its eps (OLMo-1, timm ViT): the embedded
graph's eps IS the wide model's eps.

Heads: narrow head h goes to a wide query head of a wide KV group that holds (a copy of) its KV head; the
remaining wide heads are zero-output heads (zero Q/K/V columns, zero O rows).  Narrow head dims go to wide head
dims; RoPE pairs only to wide pairs of the same frequency theta^(-2i/r) (the rotary base and scaling must be
the same: settings the adapters resolve by meaning, checked when models are loaded), pass-through dims to wide
pass-through dims; the unused dims are zero.  The softmax scale 1/sqrt(head_dim) changes by sqrt(hd_w/hd_n),
absorbed into Q (a QK map, so refused where qk_maps is False, i.e. OLMo's clip_qkv clamp).  FFN: extra units
have zero in- and out-weights and zero biases.  Clamps (clip_qkv) keep zeros at zero, so padding stays exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import IncompatibleModelsError, UnsupportedModelError
from .canonical import LazyGraph, Spec, residual_role
from .symmetry import random_rotation_fixing_ones, rotary_pairs

# fields that must be equal (what no embedding can bridge), and sizes the narrow model may not exceed
SAME = ("architecture", "n_layers", "n_out", "glu", "embeddings", "token_embedding", "centred", "scale_exact",
        "qk_maps", "ov_maps", "residual", "qk_norm", "n_experts", "top_k", "shared_expert")
NOT_LARGER = ("d_model", "ffn_dim", "head_dim")
WHY_SAME = {"n_out": " (vocabulary size or number of classes)", "qk_maps": " (clip_qkv set in one model only)",
            "n_experts": " (experts per MoE layer: experts are matched one to one, none is added or dropped)"}


def no_exact_embedding(spec: Spec) -> str | None:
    """Why no width embedding of this structure is exact (None where the one above is): kept norm gains."""
    if spec.residual != "orthogonal":
        return (f"residual: {spec.residual!r}: {spec.architecture} has a kept norm gain on the residual stream itself "
                "(timm's norm_pre, post-LN encoders) or after a norm on every residual write (post-sublayer norms): "
                "only signed permutations of the stream are exact, and a wider stream would need the narrow "
                "coordinates spread over the wide ones by a map that a per-coordinate gain cannot follow; merge "
                "models of one width")
    if spec.n_experts:
        return (f"{spec.architecture} is a mixture of experts: embedding a narrower MoE (wider experts or stream) is "
                "not implemented; merge models of one width")
    if spec.qk_norm != "none":
        return (f"{spec.architecture} normalises q and k with a kept gain (QK-norm): a wider head_dim changes that "
                "norm's mean and the head's dims cannot be padded exactly here; merge models of one width")
    return None


@dataclass(frozen=True)
class Plan:
    """Where each narrow part goes in the wide model."""

    head_slot: tuple[int, ...]  # wide query head of each narrow query head
    kv_source: tuple[int | None, ...]  # narrow KV head copied into each wide KV head (None: a zero head)
    dims: tuple[int, ...]  # wide head dim of each narrow head dim (q, k, v and the rows of o alike)
    q_scale: float  # sqrt(hd_w / hd_n): the softmax-scale ratio, absorbed into Q


def _head_dims(n: Spec, w: Spec) -> tuple[int, ...]:
    """Map narrow head dims to wide ones: each RoPE pair to the wide pair of the same frequency, the
    pass-through (non-rotary) dims to wide pass-through dims."""
    dims: list[int | None] = [None] * n.head_dim
    wide_pairs = rotary_pairs(w)
    if n.rotary_dims and n.rotary_layout != w.rotary_layout:
        raise UnsupportedModelError(f"rotary_layout: {n.rotary_layout!r} vs {w.rotary_layout!r}")
    for i, (a, b) in enumerate(rotary_pairs(n)):
        # pair i turns at theta^(-2i/r_n); wide pair k at theta^(-2k/r_w): equal iff k = i r_w / r_n
        k, rest = divmod(i * w.rotary_dims, n.rotary_dims)
        if rest or k >= len(wide_pairs):
            raise UnsupportedModelError(
                f"rotary_dims: {n.rotary_dims} vs {w.rotary_dims}: the narrow rotary pair {i} turns at frequency "
                f"theta^(-2*{i}/{n.rotary_dims}), which no wide pair has (a pair may only map to a pair of the same "
                "frequency, so the wide rotary_dims must be a multiple of the narrow one)")
        dims[a], dims[b] = wide_pairs[k]
    rotary_w = {j for pair in wide_pairs for j in pair}
    free_n = [j for j in range(n.head_dim) if dims[j] is None]
    free_w = [j for j in range(w.head_dim) if j not in rotary_w]
    if len(free_n) > len(free_w):
        raise UnsupportedModelError(
            f"head dims without RoPE: {len(free_n)} vs {len(free_w)} (head_dim {n.head_dim} vs {w.head_dim}, "
            f"rotary_dims {n.rotary_dims} vs {w.rotary_dims}): a dim RoPE does not turn cannot map to one it turns")
    for j, k in zip(free_n, free_w):
        dims[j] = k
    return tuple(dims)


def _heads(n: Spec, w: Spec) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
    """Narrow query heads onto wide query heads, KV groups kept: a narrow KV head whose group is larger than
    the wide group size is copied into as many wide KV heads as its query heads need."""
    gn, gw = n.group_size, w.group_size
    copies = -(-gn // gw)  # wide KV heads per narrow KV head
    if n.n_kv_heads * copies > w.n_kv_heads:
        raise UnsupportedModelError(
            f"heads: n_heads {n.n_heads} vs {w.n_heads}, n_kv_heads {n.n_kv_heads} vs {w.n_kv_heads} (query heads "
            f"per KV head {gn} vs {gw}): the narrow heads need {n.n_kv_heads * copies} wide KV heads, "
            f"the wide model has {w.n_kv_heads}")
    slot, source = [], [None] * w.n_kv_heads
    for group in range(n.n_kv_heads):
        for c in range(copies):
            source[group * copies + c] = group
        for j in range(gn):
            slot.append((group * copies + j // gw) * gw + j % gw)
    return tuple(slot), tuple(source)


def plan(narrow: Spec, wide: Spec) -> Plan:
    """Where each narrow part goes in the wide model; raises IncompatibleModelsError for what no embedding can
    bridge and UnsupportedModelError for what this exact embedding cannot do, naming the field and values."""
    for name in SAME:
        a, b = getattr(narrow, name), getattr(wide, name)
        if a != b:
            raise IncompatibleModelsError(f"{name}: {a} vs {b}{WHY_SAME.get(name, '')}: the narrow model cannot be "
                                          f"embedded in the wide one (the two must agree in {name})")
    why = no_exact_embedding(wide)
    if why:
        raise UnsupportedModelError(why)
    for name in NOT_LARGER:
        a, b = getattr(narrow, name), getattr(wide, name)
        if a > b:
            raise IncompatibleModelsError(f"{name}: {a} vs {b}: the model to embed is wider than the target")
    dims = _head_dims(narrow, wide)
    slot, source = _heads(narrow, wide)
    if narrow.head_dim != wide.head_dim and not wide.qk_maps:
        raise UnsupportedModelError(
            f"head_dim: {narrow.head_dim} vs {wide.head_dim}: the softmax scale changes by "
            f"sqrt({wide.head_dim}/{narrow.head_dim}), which must be absorbed into Q (a QK map), and this model "
            "allows no QK maps (qk_maps=False: clip_qkv clamps q elementwise). Keep head_dim, add heads instead")
    return Plan(slot, source, dims, math.sqrt(wide.head_dim / narrow.head_dim))


def can_embed(narrow_spec: Spec, wide_spec: Spec) -> str | None:
    """Why a model of narrow_spec cannot be written exactly into wide_spec, or None if it can."""
    try:
        plan(narrow_spec, wide_spec)
    except (IncompatibleModelsError, UnsupportedModelError) as error:
        return str(error)
    return None


def residual_map(narrow: Spec, wide: Spec, gen: torch.Generator) -> Tensor:
    """A random E (d_n x d_w, fp64) with E E^T = I; rows orthogonal to the ones vector for centred streams
    (for equal widths: a rotation G with G·1 = 1, the residual group of the centred case)."""
    if wide.centred and narrow.d_model == wide.d_model:
        return random_rotation_fixing_ones(wide.d_model, gen)
    a = torch.randn(wide.d_model, narrow.d_model, generator=gen, dtype=torch.float64)
    if wide.centred:
        a = a - a.mean(0)  # columns in the complement of 1; QR keeps their span
    return torch.linalg.qr(a)[0].T.contiguous()


def _heads_last(x: Tensor, slots: Tensor, sources: Tensor, n_in: int, n_out: int, dims: Tensor, hd_out: int,
                scale: float = 1.0) -> Tensor:
    """x (..., n_in * hd_n) with heads on the last axis -> (..., n_out * hd_w): narrow head sources[j] to slots[j]."""
    xh = x.reshape(*x.shape[:-1], n_in, -1)
    out = x.new_zeros(*x.shape[:-1], n_out, hd_out)
    out[..., slots[:, None], dims[None, :]] = xh[..., sources, :] * scale
    return out.reshape(*x.shape[:-1], n_out * hd_out)


class EmbeddedGraph(LazyGraph):
    """The narrow graph written into the wide spec, computed part by part (one layer at a time)."""

    def __init__(self, narrow, wide_spec: Spec, *, seed: int = 0, norm_eps: float | None = None):
        n, w = narrow.spec, wide_spec
        self.narrow, self.spec, self.plan = narrow, wide_spec, plan(n, w)
        eps_n = float(narrow.norm_eps)
        self.norm_eps = eps_n if norm_eps is None else float(norm_eps)
        if (eps_n > 0) != (self.norm_eps > 0):
            raise UnsupportedModelError(f"norm_eps: {eps_n} vs {self.norm_eps}: a zero eps can only match a zero eps")
        # the stream scale g that makes the wide norm (eps_w) see the narrow one's eps: g^2 eps_n d_n/d_w = eps_w
        ratio = self.norm_eps / eps_n if eps_n > 0 else 1.0
        self.scale = math.sqrt(w.d_model / n.d_model * ratio)
        self.read_scale = math.sqrt(n.d_model / w.d_model)
        self.e = residual_map(n, w, torch.Generator().manual_seed(seed))
        self.meta = dict(getattr(narrow, "meta", {}) or {})
        p = self.plan
        kv = [k for k, s in enumerate(p.kv_source) if s is not None]
        self._q = (torch.tensor(p.head_slot), torch.arange(n.n_heads), n.n_heads, w.n_heads)
        self._kv = (torch.tensor(kv, dtype=torch.long), torch.tensor([p.kv_source[k] for k in kv], dtype=torch.long),
                    n.n_kv_heads, w.n_kv_heads)
        self._dims = torch.tensor(p.dims)

    def _residual(self, key: str, v: Tensor) -> Tensor:
        role = residual_role(key)
        e = self.e.to(v.dtype) if role else None  # drawn in fp64, applied in the weights' dtype (fp32)
        if role == "write":
            return (v @ e) * self.scale
        if role == "read":
            return (e.T @ v) * self.read_scale
        if role == "norm_bias":  # added after the norm, whose output is sqrt(d_w/d_n) norm_n(x_n) E
            return (v @ e) / self.read_scale
        return v

    def _shape(self, key: str, shape: tuple) -> tuple:
        w, s = self.spec, list(shape)
        name = key.split(".", 2)[2] if key.startswith("layers.") else key
        if name.startswith(("attn.q", "attn.k", "attn.v")):
            s[-1] = (w.n_heads if name.startswith("attn.q") else w.n_kv_heads) * w.head_dim
        elif name in ("attn.o", "mlp.down"):
            s[0] = w.n_heads * w.head_dim if name == "attn.o" else w.ffn_dim
        elif name.startswith(("mlp.up", "mlp.gate")):
            s[-1] = w.ffn_dim
        role = residual_role(key)
        if role in ("write", "norm_bias"):
            s[-1] = w.d_model
        elif role == "read":
            s[0] = w.d_model
        return tuple(s)

    @property
    def shapes(self) -> dict[str, tuple]:
        """The canonical shapes, known without computing a tensor (models.check_same_structure reads them)."""
        base = getattr(self.narrow, "shapes", None) or {k: tuple(v.shape) for k, v in self.narrow.params.items()}
        return {k: self._shape(k, shape) for k, shape in base.items()}

    def _pad(self, name: str, v: Tensor) -> Tensor:
        """Heads, head dims and FFN units of one layer tensor, padded to the wide sizes (before the residual map)."""
        w, p, dims = self.spec, self.plan, self._dims
        if name in ("attn.q", "attn.q_bias"):
            return _heads_last(v, *self._q, dims, w.head_dim, p.q_scale)
        if name in ("attn.k", "attn.k_bias", "attn.v", "attn.v_bias"):
            return _heads_last(v, *self._kv, dims, w.head_dim)
        if name == "attn.o":  # heads on the rows
            return _heads_last(v.T, *self._q, dims, w.head_dim).T
        if name.startswith(("mlp.up", "mlp.gate")):
            return torch.cat([v, v.new_zeros(*v.shape[:-1], w.ffn_dim - v.shape[-1])], dim=-1)
        if name == "mlp.down":
            return torch.cat([v, v.new_zeros(w.ffn_dim - v.shape[0], v.shape[1])], dim=0)
        return v

    def outside(self) -> dict[str, Tensor]:
        return {k: self._residual(k, v) for k, v in self.narrow.outside().items()}

    def layer(self, i: int) -> dict[str, Tensor]:
        return {k: self._residual(k, self._pad(k.split(".", 2)[2], v)) for k, v in self.narrow.layer(i).items()}


def embed(narrow_graph, wide_spec: Spec, *, seed: int = 0, norm_eps: float | None = None):
    """The narrow model's canonical graph written exactly into wide_spec (same function, wide shapes).

    norm_eps: the wide model's norm eps (default: the narrow model's); the stream scale absorbs the ratio, so
    the embedding is exact for any pair of positive eps, also where the class fixes its eps.  seed draws the
    semi-orthogonal residual map E.  A lazy graph (e.g. a checkpoint's SourceGraph) gives a lazy graph,
    computed one layer at a time; a Graph held in memory gives a Graph."""
    out = EmbeddedGraph(narrow_graph, wide_spec, seed=seed, norm_eps=norm_eps)
    return out if isinstance(narrow_graph, LazyGraph) else out.materialise()


__all__ = ["EmbeddedGraph", "Plan", "can_embed", "embed", "plan", "residual_map"]
