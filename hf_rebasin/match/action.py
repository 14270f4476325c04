"""A group element's action as a training step computes it: each endpoint's share w_k · t_k(theta_k) of the
point, with the tensors the element leaves alone kept apart (no gradient, combined by foreach ops).

The maths is core.symmetry's (transform_layer, rotate_residual: what exports use), in another order of the same
products, arranged so that a step launches few kernels (BENCHMARKS.md, "Launches of a learned step"):

* the scalars fold into the small matrices made once per step: reads use w G, writes w g r G (g the residual
  scale, r the write factor of PathOfEnds.eps_and_write_factor), post-norm gains w g |G|;
* the weight w rides on the residual map, so no tensor needs an elementwise product of its own, in the forward or the
  backward;
* where a layer's reads (writes) are views of one block (blocks.py, the layout path.stored gives the endpoints), the
  residual map acts on the block by one product, split back into the tensors, and their per-head maps and GLU
  scales act after it (they commute with it); elsewhere (a start with permutations, which copy) a tensor's maps act
  first and the residual map last;
* the per-head maps of all layers are built at once, stacked (L, n, hd, hd), and a tensor's head maps act as one
  batched product on a view of it (heads as the batch, no copy): O(n·hd²) memory per map, never a block-diagonal
  (n·hd)² matrix; a read's bias, which the residual map does not touch, takes the maps times w;
* the tensors the continuous part does not touch (permuted at most) are interpolated without gradient.

Equal to the plain action to fp32 rounding (tests/test_learned.py, tests/test_layered.py and the others compare
the loss with the exported point)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.canonical import Spec, layer_key, residual_role
from ..core.experts import transform_experts
from ..core.symmetry import Transform, permute_layer_heads
from .blocks import read_block, read_keys, write_block, write_keys


def heads_times(x: Tensor, maps: Tensor) -> Tensor:
    """x_h -> x_h M_h for every head h on x's last axis, x (d_in, n·hd) or a bias (n·hd,); maps (n, hd, hd).

    One batched product on views: the heads are rows of x^T, so (x M)^T = M^T x^T with x^T seen as (n, hd, d_in)
    (splitting an axis is always a view, and cuBLAS reads either order of a batch's two axes)."""
    n, hd = maps.shape[0], maps.shape[-1]
    if x.dim() == 1:
        return torch.bmm(x.view(n, 1, hd), maps).reshape(n * hd)
    return torch.bmm(maps.transpose(-1, -2), x.T.unflatten(0, (n, hd))).flatten(0, 1).T


def heads_left(maps: Tensor, x: Tensor) -> Tensor:
    """x_h -> M_h x_h for every head h on x's first axis: x (n·hd, d_out) seen as (n, hd, d_out), one product."""
    n, hd = maps.shape[0], maps.shape[-1]
    return torch.bmm(maps, x.unflatten(0, (n, hd))).flatten(0, 1)


def _layers(x: Tensor | None, n: int) -> list:
    return [None] * n if x is None else list(x.unbind(0))


def _stacked(items: list[Tensor | None]) -> Tensor | None:
    return None if any(v is None for v in items) else torch.stack(items)


@dataclass
class Action:
    """w · t for one endpoint in one step: what its tensors are multiplied by, for all layers at once."""

    t: Transform  # the element (its permutations)
    read: Tensor  # w G: a read x -> read^T x, a norm bias x -> x read
    write: Tensor  # w g r G
    gain: Tensor | None  # w g |G| (post-norm gains, a gain on the stream)
    unsigned: Tensor | None  # |G| (the right factor of a transit tensor, an MLM head's dense layer)
    right: dict[str, list]  # q, k, v and their biases: per layer, the (n, hd, hd) head maps (biases: times w)
    o_left: list  # per layer: the (n, hd, hd) inverse OV maps, o_h -> o_left_h @ o_h
    up: list  # per layer: the GLU scale s (up), w s (up_bias), 1 / s (down rows)
    up_bias: list
    down: list

    @staticmethod
    def of(t: Transform, weight: float, factor: Tensor | None, spec: Spec, dtype: torch.dtype | None = None) -> Action:
        """The action of `t` with weight `weight` and write factor `factor`; `dtype`: the autocast dtype the
        products run in, to which the matrices are cast here once (autocast would cast them at every use)."""
        if t.rotation is None:
            raise ValueError("a training step's element has a residual map")
        rotation, n, gs = t.rotation, spec.n_layers, spec.group_size
        cast = (lambda m: m) if dtype is None else (lambda m: m.to(dtype))
        scale = t.scale if factor is None else t.scale * factor
        gain = unsigned = None
        if spec.residual == "signed_permutation":
            gain, unsigned = cast(rotation.abs() * (weight * t.scale)), cast(rotation.abs())
        right, o_left = {}, [None] * n
        qk, ov = _stacked(t.qk_maps), _stacked(t.ov_maps)
        if qk is not None:
            q = qk if gs == 1 else torch.repeat_interleave(qk, gs, dim=1)
            k = torch.linalg.inv_ex(qk)[0].transpose(-1, -2)
            right.update(q=_layers(cast(q), n), k=_layers(cast(k), n), q_bias=_layers(cast(q * weight), n),
                         k_bias=_layers(cast(k * weight), n))
        if ov is not None:
            inverse = torch.linalg.inv_ex(ov)[0]
            o_left = _layers(cast(inverse if gs == 1 else torch.repeat_interleave(inverse, gs, dim=1)), n)
            right.update(v=_layers(cast(ov), n), v_bias=_layers(cast(ov * weight), n))
        glu = _stacked(t.glu_scale)  # up and down scale the products (cast once); an up bias is scaled in fp32
        return Action(t, cast(rotation * weight), cast(rotation * (scale * weight)), gain, unsigned, right, o_left,
                      _layers(None if glu is None else cast(glu), n), _layers(None if glu is None else glu * weight, n),
                      _layers(None if glu is None else cast(glu.reciprocal()), n))


def _permuted(params: dict[str, Tensor], i: int, spec: Spec, t: Transform) -> dict[str, Tensor]:
    """Layer i's tensors with the element's head and FFN permutations (core.symmetry.transform_layer's)."""
    p = dict(params)
    key = lambda name: layer_key(i, name)
    permute_layer_heads(p, i, spec, t)
    fperm = t.per_layer("ffn_perm", i)
    if fperm is not None:
        for name in ("mlp.up", "mlp.up_bias", "mlp.gate", "mlp.gate_bias"):
            if key(name) in p:
                p[key(name)] = p[key(name)].index_select(-1, fperm)
        if key("mlp.down") in p:
            p[key("mlp.down")] = p[key("mlp.down")].index_select(0, fperm)
    transform_experts(p, i, spec, t)  # the experts' permutations and (fixed) GLU scales
    return p


def _times(x: Tensor, m: Tensor) -> Tensor:
    """x @ m, a vector x by one mm (matmul would add an in-place squeeze)."""
    return x @ m if x.dim() == 2 else (x.unsqueeze(0) @ m).squeeze(0)


def _residual(key: str, x: Tensor, act: Action) -> Tensor | None:
    """w · the residual map of the tensor (None: the residual map leaves it alone)."""
    role = residual_role(key)
    if role == "read":
        return act.read.T @ x
    if role == "write":
        return _times(x, act.write)
    if role == "norm_bias":
        return _times(x, act.read)
    if role in ("gain", "transit_bias"):
        return _times(x, act.gain)
    if role == "transit":
        return act.read.T @ x @ act.unsigned
    return None


def _by_block(p: dict[str, Tensor], i: int, act: Action) -> dict[str, Tensor]:
    """w · the residual map of layer i's reads and of its writes, one product per block where they are views of one
    (blocks.py), split back into the tensors (one split: its gradient is one concatenation)."""
    out = {}
    reads = read_keys(p, i)
    block = read_block([p[k] for k in reads])
    if block is not None:
        out.update(zip(reads, (act.read.T @ block).split([p[k].shape[1] for k in reads], dim=1)))
    writes = write_keys(p, i)
    block = write_block([p[k] for k in writes])
    if block is not None:
        parts = (block @ act.write).split([p[k].shape[0] if p[k].dim() == 2 else 1 for k in writes], dim=0)
        out.update({k: part if p[k].dim() == 2 else part.squeeze(0) for k, part in zip(writes, parts)})
    return out


def outside_share(params: dict[str, Tensor], act: Action) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(w · t of the tensors outside the layers that t moves, the others as they are)."""
    moved, still = {}, {}
    for key, value in params.items():
        out = _residual(key, value, act)
        (still if out is None else moved)[key] = value if out is None else out
    return moved, still


def layer_share(params: dict[str, Tensor], i: int, spec: Spec, act: Action) -> tuple[dict[str, Tensor],
                                                                                    dict[str, Tensor]]:
    """(w · t of layer i's tensors that t's continuous part moves, the others permuted)."""
    p = _permuted(params, i, spec, act.t)
    done = _by_block(p, i, act)  # (the residual map first there: it commutes with the maps and scales below)
    suffix = lambda k: k.split(".", 2)[2]
    moved, still = {}, {}
    for key, x in p.items():
        name = suffix(key)
        role = residual_role(key)
        x = done.get(key, x)
        bare = name.removeprefix("attn.").removeprefix("mlp.")
        maps = act.right.get(bare, [None] * spec.n_layers)[i]
        if maps is not None:
            x = heads_times(x, maps)
        if name == "attn.o" and act.o_left[i] is not None:
            x = heads_left(act.o_left[i], x)
        if name == "mlp.up" and act.up[i] is not None:
            x = x * act.up[i]
        elif name == "mlp.up_bias" and act.up_bias[i] is not None:
            x, maps = x * act.up_bias[i], True
        elif name == "mlp.down" and act.down[i] is not None:
            x = x * act.down[i][:, None]
        out = x if key in done else _residual(key, x, act)
        if out is not None:
            moved[key] = out
        elif role is None and maps is not None:  # a bias the weighted maps moved
            moved[key] = x
        else:
            still[key] = x
    return moved, still


def graph_share(graph, act: Action) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(moved, still) of a whole graph held in memory (outside_share and layer_share of every layer)."""
    moved, still = outside_share(graph.outside(), act)
    for i in range(graph.spec.n_layers):
        layer_moved, layer_still = layer_share(graph.layer(i), i, graph.spec, act)
        moved.update(layer_moved)
        still.update(layer_still)
    return moved, still


def combine(shares: list[tuple[dict[str, Tensor], dict[str, Tensor]]], weights: list[float],
            factor: Tensor | None) -> dict[str, Tensor]:
    """The point sum_k w_k t_k(theta_k) from each endpoint's (moved, still) share: the moved tensors already
    carry their weight (and the write factor r, writes); the still ones take theirs here, without gradient, and
    every residual write of the point is r times the sum.  Foreach ops: a handful of launches for all tensors;
    endpoints of weight 0 add exactly nothing (they are finite) and are not read."""
    keys = list({**shares[0][0], **shares[0][1]})
    if any({**m, **s}.keys() != set(keys) for m, s in shares[1:]):
        raise ValueError("cannot interpolate canonical graphs of different structure")
    used = [(m, s, w) for (m, s), w in zip(shares, weights) if w != 0.0]
    total: dict[str, Tensor] = {}
    for moved, still, w in used:
        plain = [k for k in still if not (factor is not None and residual_role(k) == "write")]
        writes = [k for k in still if k not in plain]
        scaled = dict(zip(plain, torch._foreach_mul([still[k] for k in plain], w) if w != 1.0 and plain
                          else [still[k] for k in plain]))
        if writes:
            scaled.update(zip(writes, torch._foreach_mul([still[k] for k in writes], factor * w)))
        _accumulate(total, scaled)
        _accumulate(total, moved)
    return {k: total[k] for k in keys}


def _accumulate(total: dict[str, Tensor], add: dict[str, Tensor]) -> None:
    """total += add, key by key (one foreach sum for the keys both hold; dtypes promoted as `+` does)."""
    both = [k for k in add if k in total]
    for k in add:
        if k not in total:
            total[k] = add[k]
    if both:
        left, right = [total[k] for k in both], [add[k] for k in both]
        groups: dict = {}
        for j, (a, b) in enumerate(zip(left, right)):
            groups.setdefault((a.dtype, b.dtype), []).append(j)
        for (da, db), idx in groups.items():
            dt = torch.promote_types(da, db)
            sums = torch._foreach_add([left[j].to(dt) for j in idx], [right[j].to(dt) for j in idx])
            total.update(zip([both[j] for j in idx], sums))
