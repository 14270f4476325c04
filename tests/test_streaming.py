"""Streaming: models are read from their files one layer at a time, exported shard by shard in the sources'
dtype, and give the same results as the whole models held in memory."""
from __future__ import annotations

import json
import weakref

import pytest
import torch
from hub_server import FakeHub, use_fake_hub
from safetensors import safe_open

from hf_rebasin import tiny
from hf_rebasin.cli import main
from hf_rebasin.core.canonical import Graph, LazyGraph, interpolate
from hf_rebasin.core.symmetry import apply
from hf_rebasin.match.weight import weight_matching
from hf_rebasin.sources import models
from hf_rebasin.sources.checkpoints import CheckpointFiles


def half_copy(source, out):
    """The checkpoint re-saved in fp16, as the Hub stores Pythia."""
    model = models.load(source).model.half()
    model.save_pretrained(out, safe_serialization=True)
    tiny.tiny_tokenizer(model.config.vocab_size).save_pretrained(out)
    return out


def stored(folder) -> dict[str, torch.Tensor]:
    files = CheckpointFiles(folder)
    return {name: files[name] for name in files}


def test_streamed_merge_equals_the_whole_models_in_memory(tiny_dirs, tmp_path, text_file, monkeypatch):
    from hf_rebasin import pipeline
    from hf_rebasin.evaluation import barrier as evaluation
    a_dir, b_dir = tiny_dirs["llama_gqa_tied"], tiny.make_tiny("llama_gqa_tied", tmp_path / "b", seed=4)
    command = ["merge", str(a_dir), str(b_dir), "--method", "wm", "--data", str(text_file), "--seq-len", "32",
               "--max-eval-tokens", "1024", "--lambdas", "3"]
    assert main([*command, "--out", str(tmp_path / "in-memory")]) == 0
    monkeypatch.setattr(pipeline, "IN_MEMORY_BYTES", 0)  # the aligned models are spilled to files and streamed
    monkeypatch.setattr(evaluation, "STREAMED_EVAL_BYTES", 0)  # the path is evaluated layer by layer
    out = tmp_path / "merged"
    assert main([*command, "--out", str(out)]) == 0
    losses = [json.loads((folder / "barrier.json").read_text())["loss"] for folder in (tmp_path / "in-memory", out)]
    assert len(losses[0]) == 3 and all(abs(x - y) <= 1e-6 * max(1.0, x) for x, y in zip(*losses))
    # the same computation on graphs held whole in memory (no lazy graph anywhere)
    template = models.load(a_dir)
    whole_a, whole_b = (models.canonicalise(models.load(d)).materialise() for d in (a_dir, b_dir))
    assert isinstance(whole_a, Graph) and isinstance(whole_b, Graph)
    reference = weight_matching(whole_a, whole_b, progress=False)
    streamed = weight_matching(models.canonicalise(template), models.canonicalise(models.load(b_dir)), progress=False)
    for t_ref, t_str in zip(reference.transforms, streamed.transforms):
        for key, value in t_ref.to_tensors().items():
            assert torch.allclose(value.double(), t_str.to_tensors()[key].double(), atol=1e-6), key
    merged = interpolate([apply(whole_a, reference.transform_a), apply(whole_b, reference.transform_b)], [0.5, 0.5])
    expected = models.instantiate(merged, template).state_dict()
    exported = stored(out)
    assert set(exported) == set(expected) - {"lm_head.weight"} or set(exported) == set(expected)
    for name, value in exported.items():
        assert value.dtype == torch.float32  # the sources are fp32
        assert (value - expected[name]).abs().max() <= 1e-6, name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the spilled files are gone


def test_export_keeps_the_sources_dtype_in_shards(tiny_dirs, tmp_path, text_file):
    a_dir = half_copy(tiny_dirs["gpt_neox"], tmp_path / "a16")
    b_dir = half_copy(tiny.make_tiny("gpt_neox", tmp_path / "b", seed=3), tmp_path / "b16")
    source_bytes = CheckpointFiles(a_dir).nbytes
    out = tmp_path / "merged"
    assert main(["merge", str(a_dir), str(b_dir), "--method", "wm", "--out", str(out), "--data", str(text_file),
                 "--seq-len", "32", "--max-eval-tokens", "1024", "--lambdas", "3", "--max-shard-size", "8kB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and all((out / name).is_file() for name in shards)
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for name in shards:
        with safe_open(str(out / name), "pt") as handle:
            keys = list(handle.keys())
            assert {handle.get_slice(k).get_dtype() for k in keys} == {"F16"}
            assert all(index["weight_map"][k] == name for k in keys)
            assert len(keys) == 1 or (out / name).stat().st_size <= 8000 + 4096
    assert index["metadata"]["total_size"] == source_bytes == CheckpointFiles(out).nbytes  # same size as a source
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    import transformers
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)  # the stock loader reads the shards
    assert reloaded.dtype == torch.float16
    report = json.loads((out / "barrier.json").read_text())
    merged_fp32 = reloaded.float()
    from hf_rebasin.evaluation.barrier import evaluate
    from hf_rebasin.sources.data import load_token_windows
    from hf_rebasin.sources.eval_data import EvalData
    windows, _ = load_token_windows(str(text_file), models.load(out).backend.tokenizer(out), 32, 1024)
    assert evaluate(merged_fp32, EvalData("causal-lm", windows))["loss"] == pytest.approx(report["merged_loss"],
                                                                                         abs=2e-2)  # fp16 rounding
    assert main(["merge", str(a_dir), str(b_dir), "--method", "raw", "--out", str(tmp_path / "m32"), "--data",
                 str(text_file), "--seq-len", "32", "--max-eval-tokens", "1024", "--lambdas", "3",
                 "--dtype", "float32"]) == 0
    assert {v.dtype for v in stored(tmp_path / "m32").values()} == {torch.float32}
    with safe_open(str(tmp_path / "m32" / "transforms.safetensors"), "pt") as handle:
        assert "b.rotation" not in handle.keys() and "b.scale" in handle.keys()  # raw: identity transforms


def test_a_source_with_only_bin_weights_is_read_memory_mapped(tiny_dirs, tmp_path, text_file):
    model = models.load(tiny_dirs["gpt2"]).model
    (tmp_path / "bin").mkdir()
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")  # what older checkpoints hold
    tiny.tiny_tokenizer(model.config.vocab_size).save_pretrained(tmp_path / "bin")
    assert not list((tmp_path / "bin").glob("*.safetensors")) and list((tmp_path / "bin").glob("*.bin"))
    loaded = models.load(tmp_path / "bin")
    assert loaded.files.files[0].suffix == ".bin"
    graph, reference = models.canonicalise(loaded), models.canonicalise(models.load(tiny_dirs["gpt2"]))
    for key, value in reference.params.items():
        assert torch.equal(graph.params[key], value), key
    assert main(["barrier", str(tmp_path / "bin"), str(tiny_dirs["gpt2"]), "--method", "wm", "--data",
                 str(text_file), "--seq-len", "32", "--max-eval-tokens", "1024", "--lambdas", "3"]) == 0


def test_hub_download_fetches_only_the_safetensors(tiny_dirs, tmp_path, monkeypatch):
    folder = tmp_path / "repo"
    model = models.load(tiny_dirs["gpt_neox"]).model
    model.save_pretrained(folder, safe_serialization=True)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")  # the duplicate .bin weights some repos carry
    tiny.tiny_tokenizer(97).save_pretrained(folder)
    with FakeHub(lifetime_s=120) as hub:
        home = use_fake_hub(monkeypatch, hub, tmp_path / "home")
        hub.add_folder("someuser/neox-both", folder)
        loaded = models.load("someuser/neox-both")
        downloaded = {p.name for p in loaded.folder.iterdir()}
        assert "model.safetensors" in downloaded and "pytorch_model.bin" not in downloaded
        assert not list(home.rglob("pytorch_model.bin"))
        x = tiny.example_inputs("gpt_neox")
        exported = models.instantiate(models.canonicalise(loaded), loaded)
        assert (tiny.outputs(exported, x) - tiny.outputs(model, x)).abs().max() <= 1e-5


# --- the path evaluated layer by layer ------------------------------------------------------------------

@pytest.mark.parametrize("kind", tiny.kinds())
def test_layer_by_layer_path_evaluation_equals_the_filled_model(kind, tmp_path):
    from hf_rebasin.core.symmetry import random_transform
    from hf_rebasin.evaluation.barrier import evaluate_points
    from hf_rebasin.sources.eval_data import EvalData
    template = models.load(tiny.make_tiny(kind, tmp_path / "a", seed=1))
    a = models.canonicalise(template)
    b = models.canonicalise(models.load(tiny.make_tiny(kind, tmp_path / "b", seed=5)))
    aligned = [a, apply(b, random_transform(b.spec, seed=2))]
    x = tiny.example_inputs(kind, seed=3)
    generator = torch.Generator().manual_seed(0)
    if template.task == "causal-lm":
        data = EvalData("causal-lm", torch.cat([x, torch.randint(0, a.spec.n_out, x.shape, generator=generator)]))
    else:
        data = EvalData(template.task, x, tiny.example_labels(template.task, x, a.spec.n_out, generator))
    weights = [(1.0, 0.0), (0.5, 0.5), (0.25, 0.75)]
    filled = evaluate_points(aligned, weights, template, data, batch_size=2, progress=False, streamed=False)
    streamed = evaluate_points(aligned, weights, template, data, batch_size=2, progress=False, streamed=True)
    for whole, layered in zip(filled, streamed):
        assert whole.keys() == layered.keys()
        assert abs(whole["loss"] - layered["loss"]) <= 1e-6 * max(1.0, whole["loss"])
        if "accuracy" in whole:
            assert whole["accuracy"] == layered["accuracy"]


@pytest.mark.parametrize("kind", ["gpt_neox", "vit"])
def test_layer_by_layer_evaluation_computes_each_layer_once_per_group_of_batches(kind, tmp_path, monkeypatch):
    """Layer-major: every layer's weights are computed once per point for all the batches whose outputs fit in
    CARRIED_BYTES (not once per batch), in groups beyond that; the losses are those of the filled model."""
    from hf_rebasin.evaluation import barrier as evaluation
    from hf_rebasin.sources.layerwise import GraphLayer
    template = models.load(tiny.make_tiny(kind, tmp_path / "a", seed=1))
    a = models.canonicalise(template)
    b = models.canonicalise(models.load(tiny.make_tiny(kind, tmp_path / "b", seed=5)))
    x = torch.cat([tiny.example_inputs(kind, seed=s) for s in range(3)])
    generator = torch.Generator().manual_seed(0)
    labels = tiny.example_labels(template.task, x, a.spec.n_out, generator)
    data = evaluation.EvalData(template.task, x, labels)
    weights, batches = [(1.0, 0.0), (0.5, 0.5)], len(x)  # batches of one
    filled = evaluation.evaluate_points([a, b], weights, template, data, batch_size=1, progress=False, streamed=False)
    built = []
    original = GraphLayer.state
    monkeypatch.setattr(GraphLayer, "state", lambda self: built.append(self.i) or original(self))
    for carried, groups in ((1 << 30, 1), (1, batches)):  # everything in one group; one batch a group
        monkeypatch.setattr(evaluation, "CARRIED_BYTES", carried)
        built.clear()
        streamed = evaluation.evaluate_points([a, b], weights, template, data, batch_size=1, progress=False,
                                              streamed=True)
        assert batches >= 3 and built == list(range(a.spec.n_layers)) * groups * len(weights)
        for whole, layered in zip(filled, streamed):
            assert abs(whole["loss"] - layered["loss"]) <= 1e-6 * max(1.0, whole["loss"])
            assert whole.get("accuracy") == layered.get("accuracy")


def test_only_rotated_models_are_spilled_and_only_with_disk_room(tiny_dirs, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from hf_rebasin import pipeline
    from hf_rebasin.core.symmetry import Transform, TransformedGraph, random_transform
    from hf_rebasin.sources.checkpoints import SpilledGraph
    monkeypatch.setattr(pipeline, "IN_MEMORY_BYTES", 0)
    graph = models.canonicalise(models.load(tiny_dirs["gpt_neox"]))
    rotated = random_transform(graph.spec, seed=1)
    maps_only = random_transform(graph.spec, seed=2)
    maps_only.rotation = None
    aligned = [graph, apply(graph, rotated), apply(graph, maps_only)]
    assert Transform.identity(graph.spec).is_identity() and not maps_only.is_identity()
    with pipeline.held(aligned, tmp_path / "out") as held:
        assert held[0] is graph and isinstance(held[1], SpilledGraph) and held[2] is aligned[2]
        assert isinstance(held[2], TransformedGraph)
        for i in range(graph.spec.n_layers):  # the spilled copy holds what the transform computes
            for key, value in aligned[1].layer(i).items():
                assert torch.equal(held[1].layer(i)[key], value), key
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1, 1, 0))
    with pipeline.held(aligned, tmp_path / "out") as held:  # no room: nothing spilled, recomputed where read
        assert [h is g for h, g in zip(held, aligned)] == [True, True, True]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_size_of_a_lazy_graph_is_known_without_holding_it(tiny_dirs, tmp_path):
    from hf_rebasin.core.canonical import LazyGraph
    from hf_rebasin.core.symmetry import random_transform
    from hf_rebasin.sources.checkpoints import SpilledGraph, canonical_bytes
    source = models.canonicalise(models.load(tiny_dirs["gpt_neox"]))
    whole = 4 * sum(v.numel() for v in source.materialise().params.values())
    moved = apply(source, random_transform(source.spec, seed=1))
    graphs = [source, moved, SpilledGraph(moved, tmp_path / "spill"), interpolate([moved, source], [0.5, 0.5])]
    for graph in graphs:
        assert isinstance(graph, LazyGraph)
        assert canonical_bytes(graph) == whole
        assert "_materialised" not in graph.__dict__  # sized from shapes: nothing held whole



class WatchedGraph(LazyGraph):
    """A lazy graph that records, each time a part is read, which earlier parts still have a tensor alive."""

    def __init__(self, base):
        self.base, self.spec, self.norm_eps, self.meta = base, base.spec, base.norm_eps, {}
        self.alive, self.held_while_reading = {}, []

    def _watch(self, index: int, part: dict) -> dict:
        self.held_while_reading.append({j for j, tensors in self.alive.items() if len(tensors)})
        self.alive[index] = weakref.WeakSet(part.values())
        return part

    def outside(self):
        return self._watch(-1, self.base.outside())

    def layer(self, i):
        return self._watch(i, self.base.layer(i))


def test_walking_a_lazy_graph_holds_one_part_at_a_time(tiny_dirs, tmp_path):
    """Spilling, digesting and sizing a lazy graph read it part by part: when a part is computed, no part before
    the previous one is still held (a 7B model held whole is 27.6 GB)."""
    from hf_rebasin.core.symmetry import random_transform
    from hf_rebasin.match.learned import digest_graph
    from hf_rebasin.sources.checkpoints import SpilledGraph, canonical_bytes
    source = models.canonicalise(models.load(tiny_dirs["gpt_neox"]))
    moved = apply(source, random_transform(source.spec, seed=1))
    assert moved.spec.n_layers >= 2
    order = [-1, *range(moved.spec.n_layers)]  # the outside part, then the layers
    walks = {"spill": lambda g: SpilledGraph(g, tmp_path / "spill"), "digest": digest_graph, "size": canonical_bytes}
    for name, walk in walks.items():
        watched = WatchedGraph(moved)
        walk(watched)
        reads = watched.held_while_reading
        assert len(reads) == len(order), name  # every part read once
        for k, held in enumerate(reads):
            assert held <= set(order[max(0, k - 1):k]), (name, order[k], held)
    spilled = SpilledGraph(moved, tmp_path / "again")
    for i in range(moved.spec.n_layers):  # and the spill still holds what the transform computes
        for key, value in moved.layer(i).items():
            assert torch.equal(spilled.layer(i)[key], value), key
