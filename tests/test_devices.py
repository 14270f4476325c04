"""Device and dtype correctness by construction, proven without a GPU: everything the canonical conversion,
the group action, the learned parameterisations and the export produce lives on the graph's device (here the
meta device, where a stray CPU tensor shows at once) and in its dtype."""
from __future__ import annotations

import pytest
import torch

from hf_rebasin import models, symmetry
from hf_rebasin.canonical import Graph, interpolate
from hf_rebasin.match.params import SymmetryParams, relative_continuous

KINDS = ["gpt_neox", "llama_gqa_tied", "olmo_clip_qkv", "gpt2", "vit"]


def on_meta(graph) -> Graph:
    return Graph(graph.spec, {k: v.to("meta") for k, v in graph.params.items()}, graph.norm_eps)


def devices(tensors) -> set[str]:
    return {v.device.type for v in tensors}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["lm", "dual"])
def test_a_learned_step_builds_everything_on_the_graphs_device(kind, method, tiny_dirs):
    loaded = models.load(tiny_dirs[kind])
    graph = on_meta(models.canonicalise(loaded))
    ends = {"1": SymmetryParams(graph.spec, symmetry.random_transform(graph.spec, seed=1))}
    if method == "dual":
        ends["0"] = SymmetryParams(graph.spec)
    for end in ends.values():
        end.to("meta")
    if method == "dual":  # the single-sided image of the dual path
        a, b = ends["0"], ends["1"]
        relative = relative_continuous(a._continuous(), b._continuous(), graph.spec)
        moved = [graph, b.apply(graph, relative)]
    else:
        moved = [ends[k].apply(graph) if k in ends else graph for k in ("0", "1")]
    point = interpolate(moved, [0.3, 0.7])
    assert devices(point.params.values()) == {"meta"}
    assert all(v.dtype == torch.float32 for v in point.params.values())
    state_dict, _ = loaded.adapter.from_canonical(point, loaded.config)
    assert devices(state_dict.values()) == {"meta"}, {k for k, v in state_dict.items() if v.device.type != "meta"}


@pytest.mark.parametrize("kind", KINDS)
def test_the_group_action_and_the_export_stay_on_the_device_and_dtype(kind, tiny_dirs):
    loaded = models.load(tiny_dirs[kind])
    graph = on_meta(models.canonicalise(loaded))
    t = symmetry.random_transform(graph.spec, seed=2)
    for name in ("head_perm", "qk_maps", "ov_maps", "ffn_perm", "glu_scale"):
        setattr(t, name, [None if v is None else v.to("meta") for v in getattr(t, name)])
    t.rotation = t.rotation.to("meta")
    moved = symmetry.apply(graph, t)
    assert devices(moved.params.values()) == {"meta"}
    state_dict, _ = loaded.adapter.from_canonical(moved, loaded.config)
    assert devices(state_dict.values()) == {"meta"}
    half = Graph(graph.spec, {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in graph.params.items()},
                 graph.norm_eps)
    state_dict, _ = loaded.adapter.from_canonical(half, loaded.config)
    assert {v.dtype for v in state_dict.values() if v.is_floating_point()} == {torch.bfloat16}
