"""The checks every adapter and every tiny variant must pass (test_adapters.py runs them over the registry;
test_registry.py runs them on an adapter registered by the test itself)."""
import json

import torch

from hf_rebasin import tiny
from hf_rebasin.cli import main
from hf_rebasin.core import symmetry
from hf_rebasin.core.symmetry import Transform
from hf_rebasin.export import checkpoint
from hf_rebasin.sources import models


def max_diff(model_a, model_b, inputs):
    return (tiny.outputs(model_a, inputs) - tiny.outputs(model_b, inputs)).abs().max().item()


def round_trip_is_exact(source, kind):
    x = tiny.example_inputs(kind)
    assert tiny.outputs(source.model, x).abs().max() > 1.0  # the comparison below is not of near-zero logits
    exported = models.instantiate(models.canonicalise(source), source)
    assert max_diff(source.model, exported, x) <= 1e-5


def random_group_element_preserves_function(source, kind):
    graph = models.canonicalise(source)
    t = symmetry.random_transform(graph.spec, seed=7)
    moved = symmetry.apply(graph, t)
    # the element really moves the weights (else the test could not fail)
    head = "head.weight" if "head.weight" in graph.params else "embed.tok"  # a tied MLM decoder is the embedding
    ffn = ("layers.1.moe.down", "layers.1.moe.router") if graph.spec.n_experts else ("layers.1.mlp.down",)
    for key in ("layers.0.attn.q", *ffn, head):
        assert (moved.params[key] - graph.params[key]).abs().max() > 0.1
    x = tiny.example_inputs(kind, seed=3)
    # g != 1 is exact because the exported norm eps is rescaled by g^2; classes with a fixed eps get g = 1
    assert max_diff(source.model, models.instantiate(moved, source), x) <= 1e-4


def export_loads_with_stock_loader(source, kind, tmp_path):
    graph = symmetry.apply(models.canonicalise(source), symmetry.random_transform(models.canonicalise(source).spec, 3))
    checkpoint.export(graph, source, tmp_path / "out")
    if source.adapter.backend == "timm":
        import timm
        reloaded = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
        assert type(reloaded).__name__ == source.adapter.architecture
    else:
        import transformers
        auto = transformers.AutoModelForMaskedLM if source.task == "masked-lm" else transformers.AutoModelForCausalLM
        if source.adapter.architecture == "BertForPreTraining":
            auto = transformers.AutoModelForPreTraining
        reloaded = auto.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
        assert type(reloaded) is type(source.model)
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert config["architectures"] == [source.adapter.architecture]
        # decoders whose norm gain is folded into them are untied; an encoder's tied decoder stays tied
        assert config["tie_word_embeddings"] is (source.task == "masked-lm" and source.config.tie_word_embeddings)
        assert "auto_map" not in config  # no custom code
    x = tiny.example_inputs(kind, seed=5)
    assert max_diff(source.model, reloaded, x) <= 1e-4
    adapter = source.adapter
    for name, param in reloaded.named_parameters():  # every absorbed norm gain is 1: the canonical form was exported
        if any(kept in name for kept in adapter.kept_gains):
            continue
        if "norm" in name and name.endswith("weight") or ".ln_" in name and name.endswith("weight"):
            assert torch.equal(param, torch.full_like(param, adapter.unit_gain)), name


def data_args(kind, text_file, image_file):
    if tiny.is_image_model(kind):
        return ["--data", str(image_file)]
    return ["--data", str(text_file), "--seq-len", "32", "--max-eval-tokens", "2048"]


def disguise(source_dir, out_dir, seed, permutation_only=False):
    """Export a random group element of the model (same class) to out_dir."""
    loaded = models.load(source_dir)
    graph = models.canonicalise(loaded)
    t = symmetry.random_transform(graph.spec, seed=seed, scale=1.0)
    if permutation_only:
        perm = torch.randperm(graph.spec.d_model, generator=torch.Generator().manual_seed(seed))
        t = Transform(torch.eye(graph.spec.d_model)[perm], 1.0, t.head_perm, [None] * len(t.head_perm),
                      [None] * len(t.head_perm), t.ffn_perm, [None] * len(t.head_perm))
    checkpoint.export(symmetry.apply(graph, t), loaded, out_dir)
    return out_dir


def weight_matching_recovers_a_disguised_copy(kind, original, tmp_path, text_file, image_file):
    """A model and a copy disguised by a random group element: wm finds a flat path and the merge is the model."""
    twin = disguise(original, tmp_path / "twin", seed=13)
    x = tiny.example_inputs(kind, seed=4)
    reference = tiny.outputs(models.load(original).model, x)
    assert (tiny.outputs(models.load(twin).model, x) - reference).abs().max() < 1e-4  # same function ...
    raw = barrier_report(original, twin, "raw", kind, text_file, image_file, tmp_path, "--lambdas", "3")
    assert abs(raw["loss"][1] - raw["loss"][0]) > 1e-2  # ... different weights: the plain average is another model
    assert main(["merge", str(original), str(twin), "--method", "wm", "--out", str(tmp_path / "merged"),
                 *data_args(kind, text_file, image_file)]) == 0
    report = json.loads((tmp_path / "merged" / "barrier.json").read_text())
    assert report["barrier"] < 1e-3
    assert max(abs(loss - report["loss"][0]) for loss in report["loss"]) < 1e-4  # flat path
    merged = models.load(tmp_path / "merged").model
    assert (tiny.outputs(merged, x) - reference).abs().max() < 1e-4


def barrier_report(a, b, method, kind, text_file, image_file, tmp_path, *extra):
    out = tmp_path / f"{method}.json"
    assert main(["barrier", str(a), str(b), "--method", method, "--json", str(out),
                 *data_args(kind, text_file, image_file), *extra]) == 0
    return json.loads(out.read_text())
