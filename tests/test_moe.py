"""Mixtures of experts (issue 45): both weight layouts, the expert part of the group and its constraints, expert
matching, and what is refused by name.  The round trips, random group elements, stock-loader exports and disguised
copies of every MoE class run with every adapter (test_adapters.py, test_merge.py)."""
import json

import checks
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_rebasin import tiny
from hf_rebasin.cli import main
from hf_rebasin.core import experts, symmetry
from hf_rebasin.core.symmetry import Transform
from hf_rebasin.errors import IncompatibleModelsError, UnsupportedModelError
from hf_rebasin.export import checkpoint
from hf_rebasin.match.experts import COSTS, match_experts
from hf_rebasin.sources import models

MOE_KINDS = ["mixtral_moe", "olmoe", "qwen2_moe", "qwen3_moe"]


def fused_folder(kind, path, seed=1):
    """A checkpoint folder holding the module's own (fused, 3-D) expert tensors, as transformers 5's state dict
    names them, instead of the per-expert tensors save_pretrained writes."""
    model = tiny.build_tiny(kind, seed)
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    tiny.tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path, model


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_both_layouts_are_read_and_the_export_keeps_the_source_layout(kind, tiny_dirs, tmp_path):
    hub = models.load(tiny_dirs[kind])
    assert any(".experts.0." in name for name in load_file(str(tiny_dirs[kind] / "model.safetensors")))
    folder, model = fused_folder(kind, tmp_path / "fused")
    fused = models.load(folder)
    x = tiny.example_inputs(kind, seed=2)
    assert checks.max_diff(model.eval(), fused.model, x) == 0.0  # the stock loader reads the fused files too
    for source, per_expert in ((hub, True), (fused, False)):
        graph = models.canonicalise(source)
        assert checks.max_diff(source.model, models.instantiate(graph, source), x) <= 1e-5
        moved = symmetry.apply(graph, symmetry.random_transform(graph.spec, seed=4))
        out = tmp_path / f"out-{per_expert}"
        checkpoint.export(moved, source, out)
        names = load_file(str(out / "model.safetensors")).keys()
        assert any(".experts.0." in n for n in names) == per_expert
        assert any(n.endswith("experts.gate_up_proj") for n in names) != per_expert
        import transformers
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert checks.max_diff(source.model, reloaded, x) <= 1e-4
        assert checks.max_diff(source.model, models.load(out).model, x) <= 1e-4
    # the two layouts hold the same canonical graph
    a, b = models.canonicalise(hub).params, models.canonicalise(models.load(tiny.make_tiny(kind, tmp_path / "h",
                                                                                           seed=1))).params
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = models.canonicalise(fused).params
    assert a.keys() == c.keys() and all(torch.allclose(a[k], c[k], atol=0) for k in a)


@pytest.mark.parametrize("kind", ["mixtral_moe"])  # its per-expert files name the block otherwise
def test_raw_averages_per_expert_and_fused_files(kind, tiny_dirs, tmp_path, text_file):
    """raw (the checkpoints' own average) builds the class from per-expert files as from fused ones."""
    other = tiny.make_tiny(kind, tmp_path / "b", seed=2)
    report = checks.barrier_report(tiny_dirs[kind], other, "raw", kind, text_file, None, tmp_path, "--lambdas", "3")
    assert report["loss"][0] != report["loss"][1]
    a, _ = fused_folder(kind, tmp_path / "fa", seed=1)
    b, _ = fused_folder(kind, tmp_path / "fb", seed=2)
    (tmp_path / "f").mkdir()
    fused = checks.barrier_report(a, b, "raw", kind, text_file, None, tmp_path / "f", "--lambdas", "3")
    assert fused["loss"] == pytest.approx(report["loss"], abs=1e-5)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_experts_move_with_their_router_rows(kind, tiny_dirs):
    """The expert part of the group is exact only whole: experts without their router rows, router rows without
    their experts, or units moved between experts all change the function."""
    source = models.load(tiny_dirs[kind])
    graph = models.canonicalise(source).materialise()
    spec, x = graph.spec, tiny.example_inputs(kind, seed=3)
    assert spec.n_experts == 4 and spec.top_k == 2 and spec.expert_dim == 16
    t = Transform.identity(spec)
    t.expert_perm = [torch.tensor([2, 0, 3, 1])] * spec.n_layers
    assert checks.max_diff(source.model, models.instantiate(symmetry.apply(graph, t), source), x) <= 1e-5
    moved = symmetry.apply(graph, t)
    for stale in ("moe.router", "moe.down"):  # one part left where it was
        params = dict(moved.params)
        params["layers.0." + stale] = graph.params["layers.0." + stale]
        assert checks.max_diff(source.model, models.instantiate(graph.replace(params), source), x) > 1e-3, stale
    with pytest.raises(ValueError, match="different experts"):
        experts.split_perm(torch.tensor([0, 16] + list(range(2, 16)) + [1] + list(range(17, 64))), 4, 16)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_compose_and_serialise_the_expert_part(kind, tiny_dirs):
    graph = models.canonicalise(models.load(tiny_dirs[kind])).materialise()
    t1, t2 = symmetry.random_transform(graph.spec, seed=1), symmetry.random_transform(graph.spec, seed=2)
    both = symmetry.apply(symmetry.apply(graph, t1), t2)
    composed = symmetry.apply(graph, symmetry.compose(t1, t2, graph.spec))
    assert max(float((both.params[k] - composed.params[k]).abs().max()) for k in both.params) < 1e-4
    back = Transform.from_tensors(t1.to_tensors(), graph.spec)
    assert all(torch.equal(a, b) for name in experts.FIELDS for a, b in zip(getattr(t1, name), getattr(back, name)))


@pytest.mark.parametrize("cost", COSTS)
def test_every_expert_cost_recovers_a_permuted_copy(cost, tiny_dirs):
    """On a copy with its experts, units and GLU scales disguised, every cost finds the experts and units back."""
    graph = models.canonicalise(models.load(tiny_dirs["qwen2_moe"])).materialise()
    spec = graph.spec
    t = Transform.identity(spec)
    drawn = symmetry.random_transform(spec, seed=9)
    for name in experts.FIELDS:
        setattr(t, name, getattr(drawn, name))
    twin = symmetry.apply(graph, t)
    for i in range(spec.n_layers):
        expert_perm, units = match_experts(graph.layer(i), twin.layer(i), i, spec, cost)
        # B's expert expert_perm[e] is A's expert e: the inverse of the disguise
        assert torch.equal(t.expert_perm[i][expert_perm], torch.arange(spec.n_experts))
        found = Transform.identity(spec)
        found.expert_perm[i], found.expert_unit_perm[i] = expert_perm, units
        flat = experts.flat_perm(t.expert_perm[i], t.expert_unit_perm[i], 4, spec.expert_dim)
        assert torch.equal(flat[experts.flat_perm(expert_perm, units, 4, spec.expert_dim)], torch.arange(4 * 16))


def test_inspect_shows_the_experts(tiny_dirs, capsys):
    assert main(["inspect", str(tiny_dirs["qwen2_moe"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["experts_per_layer"], info["top_k"], info["shared_experts"], info["expert_dim"]) == (4, 2, 1, 16)
    assert any(line.startswith("expert permutations: 4 experts") for line in info["symmetry_group"])
    assert any(line.startswith("shared expert: 24 hidden units") for line in info["symmetry_group"])
    assert main(["inspect", str(tiny_dirs["mixtral_moe"])]) == 0
    text = capsys.readouterr().out
    assert "top-2 routing" in text and "experts_per_layer" in text and "shared expert:" not in text


def _with_config(folder, tmp_path, name, **changes):
    import shutil
    out = tmp_path / name
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_refusals_by_name(tiny_dirs, tmp_path, text_file, capsys):
    qwen = tiny_dirs["qwen2_moe"]
    for changes, words in (({"mlp_only_layers": [1]}, "mlp_only_layers"),
                           ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
                           ({"n_group": 2, "topk_group": 1}, "grouped top-k routing")):
        with pytest.raises(UnsupportedModelError, match=words):
            loaded = models.load(_with_config(qwen, tmp_path, words.split("=")[0].replace(" ", "-"), **changes))
            loaded.adapter.spec(loaded.config)
    from hf_rebasin.adapters import get_adapter
    for name, words in (("DeepseekV3ForCausalLM", "grouped top-k routing"), ("PhimoeForCausalLM", "SparseMixer")):
        with pytest.raises(UnsupportedModelError, match=f"{name} is not supported: .*{words}"):
            get_adapter(name)
    # more experts in one model than in the other: refused, naming the field
    more = tiny.make_tiny("qwen2_moe", tmp_path / "more", seed=2)
    bigger = tmp_path / "eight"
    import transformers
    cfg = transformers.Qwen2MoeConfig(**{**tiny.adapter_of("qwen2_moe").tiny["qwen2_moe"], "num_experts": 8})
    model = transformers.Qwen2MoeForCausalLM(cfg)
    tiny.randomise_(model, 2)
    model.save_pretrained(bigger)
    tiny.tiny_tokenizer(97).save_pretrained(bigger)
    with pytest.raises(IncompatibleModelsError, match="n_experts: 8 vs 4"):
        models.check_compatible(models.load(bigger), models.load(qwen))
    assert main(["merge", str(bigger), str(qwen), "--method", "wm", "--out", str(tmp_path / "m"),
                 *checks.data_args("qwen2_moe", text_file, None)]) != 0
    assert "n_experts: 8 vs 4" in capsys.readouterr().err
    # methods that do not align experts yet, and learned matching from a start whose expert part would be dropped
    for method, extra, words in (("am", [], "--method am does not align mixture-of-experts models yet"),
                                 ("am-perm", [], "--method am-perm does not align mixture-of-experts models yet"),
                                 ("lm", ["--init", "plain"], "use --init absorbed")):
        code = main(["barrier", str(qwen), str(more), "--method", method, "--json", str(tmp_path / "r.json"),
                     *checks.data_args("qwen2_moe", text_file, None), *extra])
        assert code != 0 and not (tmp_path / "r.json").exists()
        assert words in capsys.readouterr().err


def test_routing_report_of_a_merged_disguised_copy(tiny_dirs, tmp_path, text_file):
    """barrier.json and the card report the merged model's routing; a disguised copy aligned by wm routes every
    token to the same experts all along the path, and the average of the unaligned canonical forms does not."""
    kind = "qwen2_moe"
    twin = checks.disguise(tiny_dirs[kind], tmp_path / "twin", seed=13)
    assert main(["merge", str(tiny_dirs[kind]), str(twin), "--method", "wm", "--out", str(tmp_path / "m"),
                 "--lambdas", "3", *checks.data_args(kind, text_file, None), "--max-eval-tokens", "512"]) == 0
    routing = json.loads((tmp_path / "m" / "barrier.json").read_text())["routing"]
    assert (routing["experts"], routing["top_k"], routing["merged_weights"]) == (4, 2, [0.5, 0.5])
    assert routing["top_k_changed"] == {"merged_vs_A": [0.0, 0.0], "merged_vs_B": [0.0, 0.0]}
    assert routing["load"]["merged"] == routing["load"]["A"] == routing["load"]["B"]
    assert all(sum(layer) == pytest.approx(1.0, abs=1e-3) for layer in routing["load"]["A"])
    assert "Routing at the merged point" in (tmp_path / "m" / "README.md").read_text()
    from hf_rebasin.evaluation.routing import routing_report
    from hf_rebasin.sources.eval_data import EvalData
    a, b = (models.load(f) for f in (tiny_dirs[kind], twin))
    x = tiny.example_inputs(kind, batch=4, seq=16)
    graphs = [models.canonicalise(a), models.canonicalise(b)]
    unaligned = routing_report(graphs, a, EvalData("causal-lm", x), (0.5, 0.5))
    assert max(unaligned["top_k_changed"]["merged_vs_A"]) > 0.1


def test_unmatched_experts_ablation_leaves_a_barrier(tiny_dirs):
    """expert_cost="none" (experts kept in their stored order, units matched between namesakes) cannot undo an
    expert permutation: the midpoint of wm's path is another function; with the default cost it is the model."""
    from hf_rebasin.core.canonical import interpolate
    from hf_rebasin.match.weight import weight_matching
    kind = "mixtral_moe"
    source = models.load(tiny_dirs[kind])
    graph = models.canonicalise(source).materialise()
    twin = symmetry.apply(graph, symmetry.random_transform(graph.spec, seed=13, scale=1.0))
    x = tiny.example_inputs(kind, seed=6)
    diffs = {}
    for cost in ("units", "none"):
        t_a, t_b = weight_matching(graph, twin, progress=False, expert_cost=cost).transforms
        middle = interpolate([symmetry.apply(graph, t_a), symmetry.apply(twin, t_b)], [0.5, 0.5])
        diffs[cost] = checks.max_diff(source.model, models.instantiate(middle, source), x)
    assert diffs["units"] <= 1e-4 and diffs["none"] > 0.1, diffs
