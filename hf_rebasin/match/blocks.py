"""The frozen endpoints' layout in a learned step: a layer's residual reads side by side in one tensor, its residual
writes one above the other in another, so that the residual map acts on all of a layer's reads (writes) by one
product, whose gradient is one product too (action.layer_share; BENCHMARKS.md, "Launches of a learned step").

Reads (d, c) are the columns of a (d, sum c) block, writes (r, d) the rows of a (sum r, d) block, a write bias (d,)
one row.  The canonical tensors stay views of the blocks: the graph's keys and shapes do not change, and every
other reader sees the same tensors as before."""
from __future__ import annotations

import torch
from torch import Tensor

from ..core.canonical import layer_key

READS = ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up")
WRITES = ("attn.o", "attn.o_bias", "mlp.down", "mlp.down_bias")


def read_keys(params: dict[str, Tensor], i: int) -> list[str]:
    return [k for k in (layer_key(i, name) for name in READS) if k in params]


def write_keys(params: dict[str, Tensor], i: int) -> list[str]:
    return [k for k in (layer_key(i, name) for name in WRITES) if k in params]


def _layers(params: dict[str, Tensor]) -> list[int]:
    return sorted({int(k.split(".")[1]) for k in params if k.startswith("layers.")})


def blocked(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """`params` with every layer's reads and writes copied into one block each (in the first tensor's dtype), and
    held as views of it."""
    out = dict(params)
    for i in _layers(params):
        reads = read_keys(params, i)
        if len(reads) > 1:
            block = torch.cat([params[k] for k in reads], dim=1)
            out.update(zip(reads, block.split([params[k].shape[1] for k in reads], dim=1)))
        writes = write_keys(params, i)
        if len(writes) > 1:
            block = torch.cat([params[k].reshape(-1, params[k].shape[-1]) for k in writes], dim=0)
            parts = block.split([params[k].numel() // params[k].shape[-1] for k in writes], dim=0)
            out.update({k: part if params[k].dim() == 2 else part[0] for k, part in zip(writes, parts)})
    return out


def read_block(parts: list[Tensor]) -> Tensor | None:
    """The (d, sum c) tensor whose columns the reads `parts` are, in order (a view of it), else None."""
    if len(parts) < 2 or parts[0]._base is None or any(p._base is not parts[0]._base or p.dim() != 2 for p in parts):
        return None
    d, width, offset = parts[0].shape[0], sum(p.shape[1] for p in parts), parts[0].storage_offset()
    for p in parts:
        if p.shape[0] != d or p.stride() != (width, 1) or p.storage_offset() != offset:
            return None
        offset += p.shape[1]
    return parts[0].as_strided((d, width), (width, 1), parts[0].storage_offset())


def write_block(parts: list[Tensor]) -> Tensor | None:
    """The (sum r, d) tensor whose rows the writes `parts` are, in order (a bias is one row), else None."""
    if len(parts) < 2 or parts[0]._base is None or any(p._base is not parts[0]._base for p in parts):
        return None
    d, rows, offset = parts[0].shape[-1], 0, parts[0].storage_offset()
    for p in parts:
        r = p.shape[0] if p.dim() == 2 else 1
        if p.shape[-1] != d or p.stride()[-1] != 1 or (p.dim() == 2 and r > 1 and p.stride(0) != d) \
                or p.storage_offset() != offset:
            return None
        offset, rows = offset + r * d, rows + r
    return parts[0].as_strided((rows, d), (d, 1), parts[0].storage_offset())


def view_recipe(v: Tensor) -> tuple | None:
    """(size, stride, offset in its base) of a view of a contiguous tensor, else None."""
    base = v._base
    if base is None or not base.is_contiguous():
        return None
    return tuple(v.shape), tuple(v.stride()), v.storage_offset() - base.storage_offset()


def from_recipe(base: Tensor, recipe: tuple, lead: tuple = ()) -> Tensor:
    """The view `recipe` describes, of `base` (with `lead`: (size, stride) of leading axes before it)."""
    size, stride, offset = recipe
    return base.as_strided((*[s for s, _ in lead], *size), (*[t for _, t in lead], *stride),
                           base.storage_offset() + offset)


def tiled_bases(params: dict[str, Tensor]) -> set[int]:
    """ids of the contiguous tensors that views among `params` cover exactly (blocks): only those are worth holding
    whole (a view of a larger tensor is held on its own)."""
    covered: dict[int, int] = {}
    bases: dict[int, Tensor] = {}
    for v in params.values():
        if view_recipe(v) is not None:
            covered[id(v._base)] = covered.get(id(v._base), 0) + v.numel()
            bases[id(v._base)] = v._base
    return {i for i, n in covered.items() if n == bases[i].numel()}
