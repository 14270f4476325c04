"""Device and dtype correctness by construction, proven without a GPU: everything the canonical conversion,
the group action, the learned parameterisations and the export produce lives on the graph's device (here the
meta device, where a stray CPU tensor shows at once) and in its dtype."""
from __future__ import annotations

import pytest
import torch

from hf_rebasin.core import symmetry
from hf_rebasin.core.canonical import Graph, interpolate
from hf_rebasin.match.params import SymmetryParams
from hf_rebasin.sources import models

KINDS = ["gpt_neox", "llama_gqa_tied", "olmo_clip_qkv", "gpt2", "vit", "vit_norm_pre", "deit_distilled"]


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
        relative = b.continuous().relative_to(a.continuous())
        moved = [graph, b.apply(graph, b.element(relative))]
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


# bf16 keeps 8 significant bits (relative rounding 2^-9 per stored value and per product): the loss of the
# bf16 path stays within 1 % of the fp32 one (measured on these tiny models: at most 0.23 %)
BF16_RELATIVE_LOSS = 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_learning_stores_the_endpoints_in_bf16_and_learns_in_fp32(kind, tiny_dirs, tmp_path):
    from hf_rebasin import tiny
    from hf_rebasin.match.learned import PathLoss
    template = models.load(tiny_dirs[kind])
    a = models.canonicalise(template).materialise()
    b = models.canonicalise(models.load(tiny.make_tiny(kind, tmp_path / "b", seed=5))).materialise()
    ends = {"0": SymmetryParams(a.spec, symmetry.random_transform(a.spec, seed=4)),
            "1": SymmetryParams(b.spec, symmetry.random_transform(b.spec, seed=3))}
    x = tiny.example_inputs(kind, seed=4)
    y = None if template.task == "causal-lm" else torch.randint(0, 10, (len(x),))
    half = PathLoss([a, b], ends, template, template.task, torch.bfloat16)
    full = PathLoss([a, b], ends, template, template.task, None)
    stored = [v for g in half.graphs.values() for v in g.params.values()]
    assert {v.dtype for v in stored} == {torch.bfloat16}
    assert sum(v.nbytes for v in stored) * 2 == sum(v.nbytes for g in full.graphs.values() for v in g.params.values())
    loss = half(x, y, 0.4)
    loss.backward()
    learned = [p for p in half.parameters() if p.requires_grad]
    assert learned and all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in learned)
    assert all(torch.isfinite(p.grad).all() for p in learned) and any(p.grad.abs().max() > 0 for p in learned)
    with torch.no_grad():
        reference = float(full(x, y, 0.4))
    assert abs(float(loss.detach()) - reference) < BF16_RELATIVE_LOSS * reference


def test_a_bf16_run_returns_exact_symmetries_and_reports_its_peak_memory(tiny_dirs, tmp_path):
    from hf_rebasin import tiny
    from hf_rebasin.match import Alignment
    from hf_rebasin.match.learned import learn
    from hf_rebasin.options import MergeOptions
    from hf_rebasin.sources.eval_data import EvalData
    template = models.load(tiny_dirs["gpt_neox"])
    b_dir = tiny.make_tiny("gpt_neox", tmp_path / "b", seed=5)
    graphs = [models.canonicalise(template), models.canonicalise(models.load(b_dir))]
    data = EvalData("causal-lm", torch.randint(0, 97, (32, 16), generator=torch.Generator().manual_seed(0)))
    options = MergeOptions(method="dual", steps=3, lr=0.05, learn_batch_size=8, eval_every=0, holdout=0,
                           learn_precision="bf16",
                           device="cpu", checkpoint_dir=str(tmp_path / "ckpt"))
    start = Alignment([symmetry.Transform.identity(g.spec) for g in graphs])
    result = learn(graphs, start, template, data, None, options, progress=False)
    assert (result.transforms[1].rotation - torch.eye(graphs[1].spec.d_model)).abs().max() > 1e-3  # it learned
    x = tiny.example_inputs("gpt_neox", seed=4)
    for graph, transform, folder in zip(graphs, result.transforms, (tiny_dirs["gpt_neox"], b_dir)):
        moved = models.instantiate(symmetry.apply(graph, transform), template)
        assert (tiny.outputs(moved, x) - tiny.outputs(models.load(folder).model, x)).abs().max() < 1e-4
    peak = result.settings["peak_memory"]
    assert peak["what"] == "peak RSS of the process" and peak["GiB"] > 0.1


@pytest.mark.parametrize("kind", KINDS)
def test_the_layer_by_layer_loss_builds_every_layer_on_the_graphs_device(kind, tiny_dirs):
    """--gradient-checkpointing / --fsdp: each layer's weights and the tensors outside the layers, as the forward
    asks for them, on the endpoints' device."""
    from hf_rebasin.match.layered import LayeredPathLoss
    loaded = models.load(tiny_dirs[kind])
    graph = on_meta(models.canonicalise(loaded))
    ends = {"0": SymmetryParams(graph.spec), "1": SymmetryParams(graph.spec, symmetry.random_transform(graph.spec, 1))}
    path_loss = LayeredPathLoss([graph, graph], ends, loaded, loaded.task).to_device("meta")
    path_loss.current_weights = [0.3, 0.7]
    path_loss.elements = path_loss.current_elements("cpu")
    state = path_loss._outside_state(None)
    assert devices(state.values()) == {"meta"}
    for layer in path_loss.layers:
        assert devices(layer.state().values()) == {"meta"}
        assert devices(layer.local_state("meta").values()) == {"meta"}


def test_one_process_trains_on_the_device_the_evaluation_uses():
    """--device cuda:N: one process trains there (the Accelerator alone would pick cuda:0), where the evaluation
    runs (options.resolved_device()); under `accelerate launch` each process trains on its own device, and
    --device cuda:N is refused there."""
    from hf_rebasin.errors import OptionError
    from hf_rebasin.match.train_loop import training_device
    from hf_rebasin.options import MergeOptions
    accelerators_pick = torch.device("cuda")  # what Accelerator(cpu=False) gives one process on a GPU machine
    for device in ("cpu", "cuda", "cuda:1", "auto"):
        evaluation = MergeOptions(device=device).resolved_device()
        assert training_device(device, 1, accelerators_pick) == torch.device(evaluation)
    assert training_device("cuda:1", 1, accelerators_pick) == torch.device("cuda", 1)
    assert training_device("cuda", 2, torch.device("cuda", 1)) == torch.device("cuda", 1)  # rank 1's own GPU
    with pytest.raises(OptionError, match="under `accelerate launch` every process trains on its own"):
        MergeOptions(method="dual", device="cuda:1", learn_batch_size=8).check(2, num_processes=2)
    MergeOptions(method="dual", device="cpu", learn_batch_size=8).check(2, num_processes=2)
