"""Models of different widths (docs/design.md §7): a narrow model embedded exactly into the wide configuration of its
class, for every adapter and tiny variant; refusals name the field and both values."""
import dataclasses
import math

import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.core import symmetry, widths
from hf_rebasin.core.canonical import Graph, LazyGraph
from hf_rebasin.errors import IncompatibleModelsError, UnsupportedModelError
from hf_rebasin.match.weight import weight_matching
from hf_rebasin.sources import models

KINDS = tiny.kinds()
WIDTH_KEYS = ("hidden_size", "n_embd", "embed_dim", "intermediate_size", "n_inner",  # halved (GPT-2, ViT: FFN follows)
              "moe_intermediate_size", "shared_expert_intermediate_size")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")  # halved where even, so that head_dim stays


def narrower(args: dict) -> dict:
    """The sibling config with half the residual and FFN width (vocabulary, layers, RoPE, ... kept)."""
    out = dict(args)
    for key in WIDTH_KEYS:
        if out.get(key):
            out[key] //= 2
    for key in HEAD_KEYS:
        if key in out and out[key] % 2 == 0:
            out[key] //= 2
            if (out.get("num_key_value_heads") or 0) > 1:
                out["num_key_value_heads"] //= 2
    return out


def save_model(kind: str, args: dict, path, seed: int) -> models.Loaded:
    """make_tiny with other config arguments: a random model of kind's class, saved in its Hub layout."""
    adapter = tiny.adapter_of(kind)
    torch.manual_seed(seed)
    if adapter.backend == "timm":
        import timm
        from timm.models import save_for_hf
        model = timm.create_model(adapter.timm_name, pretrained=False, **args)
        tiny.randomise_(model, seed)
        save_for_hf(model.eval(), str(path), model_args=args, safe_serialization=True)
    else:
        model = tiny.model_from_config(adapter, type(adapter.tiny_config(kind))(**args))
        tiny.randomise_(model, seed, getattr(adapter, "unit_gain", 1.0))
        model.save_pretrained(path, safe_serialization=True)
        tiny.tiny_tokenizer(model.config.vocab_size, mask=adapter.task == "masked-lm").save_pretrained(path)
    return models.load(path)


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    """make(kind, narrow_args=None, seed) -> Loaded, each model built once per module."""
    root, cache = tmp_path_factory.mktemp("widths"), {}

    def get(kind, args=None, seed=1):
        args = dict(tiny.adapter_of(kind).tiny[kind] if args is None else args)
        key = (kind, repr(sorted(args.items())), seed)
        if key not in cache:
            cache[key] = save_model(kind, args, root / f"{kind}-{len(cache)}", seed)
        return cache[key]
    return get


def wide_eps(loaded) -> float:
    return loaded.adapter.norm_eps(loaded.config)


def max_diff(model, reference, x) -> float:
    return (tiny.outputs(model, x) - reference).abs().max().item()


def check_embedding(kind, wide, narrow, seed=0):
    """The embedded narrow model is a model of the wide class with the narrow one's function, before and after
    a random element of the wide model's symmetry group."""
    assert widths.can_embed(narrow.spec, wide.spec) is None
    graph = widths.embed(models.canonicalise(narrow), wide.spec, seed=seed, norm_eps=wide_eps(wide))
    assert isinstance(graph, LazyGraph)  # streamed from a checkpoint, layer by layer
    assert graph.spec == wide.spec and graph.norm_eps == wide_eps(wide)
    shapes = models.canonical_shapes(models.canonicalise(wide))
    assert graph.shapes == shapes  # known before any tensor is computed
    assert models.canonical_shapes(graph.materialise()) == shapes
    models.check_same_structure(models.canonicalise(wide), graph)
    x = tiny.example_inputs(kind)
    reference = tiny.outputs(narrow.model, x)
    assert reference.abs().max() > 1.0  # not a comparison of near-zero logits
    embedded = models.instantiate(graph, wide)
    wide_export = models.instantiate(models.canonicalise(wide), wide)  # (the export unties embeddings)
    assert sum(p.numel() for p in embedded.parameters()) == sum(p.numel() for p in wide_export.parameters())
    exact = max_diff(embedded, reference, x)
    assert exact <= 1e-4
    assert max_diff(wide.model, reference, x) > 0.1  # (the wide model itself is another function)
    t = symmetry.random_transform(wide.spec, seed=7)
    moved = symmetry.apply(graph, t)
    assert (moved.params["head.weight"] - graph.params["head.weight"]).abs().max() > 0.1
    x = tiny.example_inputs(kind, seed=3)
    assert max_diff(models.instantiate(moved, wide), tiny.outputs(narrow.model, x), x) <= 1e-4
    return graph, exact


@pytest.mark.parametrize("kind", KINDS)
def test_narrow_model_embeds_exactly(make, kind):
    """Half the residual width, half the FFN, half the heads (head_dim kept), every tiny variant (refused, naming
    the reason, where a norm gain on the stream leaves only signed permutations of it)."""
    wide = make(kind)
    narrow = make(kind, narrower(tiny.adapter_of(kind).tiny[kind]), seed=2)
    if wide.spec.residual != "orthogonal":
        for smaller in (narrow.spec, dataclasses.replace(wide.spec, ffn_dim=wide.spec.ffn_dim // 2)):
            with pytest.raises(UnsupportedModelError, match="residual: 'signed_permutation'.*norm_pre"):
                widths.plan(smaller, wide.spec)
        return
    assert narrow.spec.d_model * 2 == wide.spec.d_model and narrow.spec.ffn_dim * 2 == wide.spec.ffn_dim
    if refused_by_name(narrow, wide):
        return
    check_embedding(kind, wide, narrow)


def refused_by_name(narrow, wide) -> bool:
    """Families with kept norm gains (post-norms, QK-norm) and mixtures of experts have no exact embedding here:
    refused, naming the class and the reason, before any tensor is read."""
    why = widths.no_exact_embedding(wide.spec)
    if why is None:
        return False
    assert wide.spec.architecture in why and ("mixture of experts" if wide.spec.n_experts else "gain") in why
    assert widths.can_embed(narrow.spec, wide.spec) == why
    with pytest.raises(UnsupportedModelError, match=wide.spec.architecture):
        widths.embed(Graph(narrow.spec, {}, 1e-5), wide.spec)
    return True


CASES = {  # other layouts: larger head_dim (softmax scale in Q; RoPE pairs onto the same frequencies), GQA
    "gpt_neox-head_dim": ("gpt_neox", dict(hidden_size=16, intermediate_size=32)),  # hd 4 -> 8, rotary 2 -> 4
    "llama-head_dim": ("llama_untied_bias", dict(hidden_size=16, intermediate_size=24, head_dim=8)),
    "vit-head_dim": ("vit", dict(embed_dim=16)),
    "gpt2-head_dim": ("gpt2", dict(n_embd=16)),
    "llama-group_4_to_2": ("llama_gqa_tied", dict(hidden_size=16, intermediate_size=24, num_key_value_heads=1)),
    "llama-mha_to_gqa": ("llama_gqa_tied", dict(hidden_size=16, intermediate_size=24, num_attention_heads=2,
                                                num_key_value_heads=2)),
    "llama-same_width": ("llama_gqa_tied", dict(intermediate_size=24)),
    "gpt_neox-same_width": ("gpt_neox", dict(intermediate_size=32)),
    # Phi-3: partial rotary in a fused qkv_proj, hd 4 -> 8 (rotary 2 -> 4); Gemma: explicit head_dim 8 -> 16, MQA,
    # the sqrt(d) embedding factor of each width (4 vs sqrt(32))
    "phi3-head_dim": ("phi3_partial_rotary", dict(hidden_size=16, intermediate_size=24)),
    "gemma-head_dim": ("gemma_mqa", dict(hidden_size=16, intermediate_size=24, head_dim=8)),
    "qwen2-group_2_to_2": ("qwen2_gqa_tied", dict(hidden_size=16, intermediate_size=24, num_attention_heads=2,
                                                  num_key_value_heads=1)),
}


@pytest.mark.parametrize("case", CASES)
def test_other_layouts_embed_exactly(make, case):
    kind, changes = CASES[case]
    wide = make(kind)
    narrow = make(kind, {**tiny.adapter_of(kind).tiny[kind], **changes}, seed=2)
    check_embedding(kind, wide, narrow, seed=3)
    plan = widths.plan(narrow.spec, wide.spec)
    n, w = narrow.spec, wide.spec
    assert plan.q_scale == pytest.approx(math.sqrt(w.head_dim / n.head_dim))
    if case == "llama-group_4_to_2":  # one KV head serving 4 query heads, copied into both wide KV heads
        assert plan.kv_source == (0, 0) and plan.head_slot == (0, 1, 2, 3)
    if case == "llama-mha_to_gqa":  # each narrow head keeps its own KV head: one per wide group
        assert plan.kv_source == (0, 1) and plan.head_slot == (0, 2)
    if case == "gpt_neox-head_dim":  # rotate_half pairs (0, 1) of r=2 -> pairs 0 and 2 of r=4: same frequencies
        assert n.rotary_dims == 2 and w.rotary_dims == 4 and plan.dims[:2] == (0, 2)


@pytest.mark.parametrize("method", ["wm", "wm-perm"])
@pytest.mark.parametrize("kind", KINDS)
def test_weight_matching_with_an_embedded_model(make, kind, method, request):
    """Weight matching of the wide model A with the embedded narrow B: its transforms are exact symmetries."""
    wide = make(kind)
    narrow = make(kind, narrower(tiny.adapter_of(kind).tiny[kind]), seed=2)
    if refused_by_name(narrow, wide):
        return
    graph_b = widths.embed(models.canonicalise(narrow), wide.spec, norm_eps=wide_eps(wide))
    kwargs = {} if method == "wm" else dict(residual="permutation", head_maps=False)
    graph_a = models.canonicalise(wide)
    alignment = weight_matching(graph_a, graph_b, max_rounds=2, progress=False, **kwargs)
    x = tiny.example_inputs(kind, seed=4)
    t_a, t_b = alignment.transforms
    assert max_diff(models.instantiate(symmetry.apply(graph_b, t_b), wide), tiny.outputs(narrow.model, x), x) <= 1e-4
    assert max_diff(models.instantiate(symmetry.apply(graph_a, t_a), wide), tiny.outputs(wide.model, x), x) <= 1e-4
    assert (t_b.rotation - torch.eye(wide.spec.d_model)).abs().max() > 0.1  # B was moved, not left alone


def test_norm_eps_is_the_wide_models(make):
    """A narrow eps of 0.05 written into a wide model of eps 1e-5: the stream scale absorbs the ratio, the export
    carries the wide eps, and the eps matters (the same weights with the narrow eps are another function)."""
    args = tiny.adapter_of("gpt_neox").tiny["gpt_neox"]
    wide = make("gpt_neox")
    narrow = make("gpt_neox", {**narrower(args), "layer_norm_eps": 0.05}, seed=2)
    assert wide_eps(wide) == 1e-5 and wide_eps(narrow) == 0.05
    graph = widths.embed(models.canonicalise(narrow).materialise(), wide.spec, norm_eps=1e-5)
    assert isinstance(graph, Graph) and graph.norm_eps == 1e-5
    assert wide.adapter.export_config_changes(graph, wide.config)["layer_norm_eps"] == 1e-5
    x = tiny.example_inputs("gpt_neox")
    reference = tiny.outputs(narrow.model, x)
    assert max_diff(models.instantiate(graph, wide), reference, x) <= 1e-4
    assert max_diff(models.instantiate(graph.replace(norm_eps=0.05), wide), reference, x) > 1e-3


def test_residual_map(make):
    gen = torch.Generator().manual_seed(0)
    for kind in ("gpt2", "llama_gqa_tied"):
        w = make(kind).spec
        for d in (w.d_model // 2, w.d_model):
            e = widths.residual_map(dataclasses.replace(w, d_model=d), w, gen)
            assert e.shape == (d, w.d_model)
            assert torch.allclose(e @ e.T, torch.eye(d, dtype=e.dtype), atol=1e-12)
            if w.centred and d < w.d_model:  # rows orthogonal to the ones vector: the wide stream stays centred
                assert (e.sum(1)).abs().max() < 1e-12
            elif w.centred:  # equal widths: a rotation of the centred residual group (G·1 = 1)
                assert torch.allclose(e @ torch.ones(d, dtype=e.dtype), torch.ones(d, dtype=e.dtype), atol=1e-12)


def test_refusals_name_the_field_and_values(make):
    neox, llama, olmo_clip = make("gpt_neox").spec, make("llama_gqa_tied").spec, make("olmo_clip_qkv").spec
    half = lambda spec, **changes: dataclasses.replace(
        spec, **{"d_model": spec.d_model // 2, "ffn_dim": spec.ffn_dim // 2, **changes})
    refused = {
        "n_out: 101 vs 97 (vocabulary size": (half(neox, n_out=101), neox, IncompatibleModelsError),
        "n_layers: 3 vs 2": (half(neox, n_layers=3), neox, IncompatibleModelsError),
        "architecture: LlamaForCausalLM vs GPTNeoXForCausalLM": (half(llama), neox, IncompatibleModelsError),
        "d_model: 64 vs 32": (dataclasses.replace(neox, d_model=64), neox, IncompatibleModelsError),
        "ffn_dim: 128 vs 64": (half(neox, d_model=32, ffn_dim=128), neox, IncompatibleModelsError),
        "glu: False vs True": (half(llama, glu=False), llama, IncompatibleModelsError),
        # RoPE: LLaMA pairs of head_dim 6 turn at theta^(-2i/6); a head_dim-8 model has theta^(-2k/8) only
        "rotary_dims: 6 vs 8": (half(llama, head_dim=6, rotary_dims=6), llama, UnsupportedModelError),
        # GPT-NeoX rotary_pct: 6 pass-through dims cannot go where the wide model has 4
        "head dims without RoPE: 6 vs 4": (half(neox, rotary_dims=2), neox, UnsupportedModelError),
        # GQA: 4 narrow KV heads (MHA) need 4 wide KV heads; the wide model has 2 (groups of 2)
        "n_kv_heads 4 vs 2": (half(llama, n_kv_heads=4, head_dim=4, rotary_dims=4), llama, UnsupportedModelError),
        # clip_qkv: the softmax-scale ratio of a larger head_dim cannot be absorbed into a clamped q
        "head_dim: 4 vs 8": (half(olmo_clip, head_dim=4, rotary_dims=4), olmo_clip, UnsupportedModelError),
        "qk_maps: False vs True (clip_qkv set in one model only)": (half(olmo_clip), dataclasses.replace(
            olmo_clip, qk_maps=True, ov_maps=True), IncompatibleModelsError),
    }
    for message, (narrow, wide, error) in refused.items():
        assert message in (widths.can_embed(narrow, wide) or ""), message
        with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
            widths.embed(Graph(narrow, {}, 1e-5), wide)  # refused before any tensor is read
    assert widths.can_embed(half(llama), llama) is None and widths.can_embed(llama, llama) is None
    with pytest.raises(UnsupportedModelError, match="norm_eps: 0.0 vs 1e-05"):
        widths.embed(Graph(half(llama), {}, 0.0), llama, norm_eps=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa_tied", "vit"])
def test_merge_of_a_wide_and_a_narrow_model(make, kind, tmp_path):
    """`hf-rebasin merge WIDE NARROW`: the narrow model is embedded, every method runs, the output is the wide
    class, and the path's end (λ = 1) is the narrow model itself (the embedding is exact)."""
    import json

    import corpus
    import numpy as np

    from hf_rebasin.cli import main
    from hf_rebasin.evaluation.barrier import evaluate
    from hf_rebasin.sources.eval_data import load_eval_data
    wide = make(kind)
    narrow = make(kind, narrower(tiny.adapter_of(kind).tiny[kind]), seed=2)
    if tiny.is_image_model(kind):
        data = tmp_path / "images.npz"
        gen = np.random.default_rng(0)
        np.savez(data, images=gen.standard_normal((24, 3, 16, 16)).astype(np.float32), labels=gen.integers(0, 10, 24))
        extra = ["--data", str(data)]
    else:
        data = tmp_path / "heldout.txt"
        data.write_text(corpus.heldout_text(8000))
        extra = ["--data", str(data), "--seq-len", "32", "--max-eval-tokens", "512"]
    for method in ("raw", "wm"):
        out = tmp_path / method
        assert main(["merge", str(wide.folder), str(narrow.folder), "--method", method, "--lambdas", "3",
                     "--out", str(out), *extra]) == 0
        report = json.loads((out / "barrier.json").read_text())
        own = evaluate(narrow.model, load_eval_data(str(data), narrow, seq_len=32 if extra[2:] else None,
                                                     max_tokens=512, max_examples=None))["loss"]
        assert report["endpoint_loss"][1] == pytest.approx(own, abs=1e-4)  # B at λ = 1 is the narrow model
        assert any("embedded exactly" in note for note in report["notes"])
        merged = models.load(out)
        assert merged.spec.d_model == wide.spec.d_model
    assert main(["merge", str(narrow.folder), str(wide.folder), "--method", "wm", "--out", str(tmp_path / "x"),
                 *extra]) == 2  # the wider model must come first
    assert not (tmp_path / "x").exists()



def test_phi3_rotary_fraction_that_no_embedding_bridges(make):
    """A narrow Phi-3 that turns all 8 of its head dims cannot go into a wide one that turns 4 of 8: refused by
    name, both by the exact embedding (the Spec) and by the facts two models of one class must share."""
    wide = make("phi3_partial_rotary")
    narrow = make("phi3_partial_rotary", {**tiny.adapter_of("phi3_partial_rotary").tiny["phi3_partial_rotary"],
                                          "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
                                          "intermediate_size": 24, "partial_rotary_factor": 1.0}, seed=2)
    assert narrow.spec.head_dim == wide.spec.head_dim == 8
    assert "rotary_dims: 8 vs 4" in widths.can_embed(narrow.spec, wide.spec)
    with pytest.raises(IncompatibleModelsError, match="rotary_fraction: 0.5 vs 1.0"):
        models.check_compatible(wide, narrow, shapes=False)
