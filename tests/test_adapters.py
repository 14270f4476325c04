"""Exactness of every adapter and every symmetry (docs/design.md §2-3), and the errors users see."""
import json

import checks
import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.adapters import UnsupportedModelError
from hf_rebasin.core import symmetry
from hf_rebasin.core.symmetry import Transform
from hf_rebasin.sources import models

KINDS = tiny.kinds()  # every tiny variant of every registered adapter


@pytest.fixture(scope="module")
def loaded(tiny_dirs):
    return {kind: models.load(path) for kind, path in tiny_dirs.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_canonical_round_trip_is_exact(loaded, kind):
    checks.round_trip_is_exact(loaded[kind], kind)


@pytest.mark.parametrize("kind", KINDS)
def test_random_group_element_preserves_function(loaded, kind):
    checks.random_group_element_preserves_function(loaded[kind], kind)


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_with_stock_loader(loaded, kind, tmp_path):
    checks.export_loads_with_stock_loader(loaded[kind], kind, tmp_path)


def test_constraints_matter(loaded):
    """Elements outside the declared group break the function: the constraints are not decoration."""
    # a LayerNorm model needs G·1 = ±1
    source = loaded["gpt_neox"]
    graph = models.canonicalise(source)
    x = tiny.example_inputs("gpt_neox")
    bad = Transform.identity(graph.spec)
    bad.rotation = symmetry.random_orthogonal(graph.spec.d_model, torch.Generator().manual_seed(0)).float()
    assert checks.max_diff(source.model, models.instantiate(symmetry.apply(graph, bad), source), x) > 1e-2
    # RoPE rules out a general QK map on rotary dims
    bad = Transform.identity(graph.spec)
    bad.qk_maps = [torch.eye(graph.spec.head_dim).repeat(graph.spec.n_heads, 1, 1) for _ in range(2)]
    bad.qk_maps[0][:, 0, 1] = 0.5
    assert checks.max_diff(source.model, models.instantiate(symmetry.apply(graph, bad), source), x) > 1e-3
    # clip_qkv rules out the OV maps (the clamp is active on these weights)
    source = loaded["olmo_clip_qkv"]
    graph = models.canonicalise(source)
    assert graph.spec.head_maps is False
    bad = Transform.identity(graph.spec)
    bad.ov_maps = [2 * torch.eye(graph.spec.head_dim).repeat(graph.spec.n_heads, 1, 1) for _ in range(2)]
    assert checks.max_diff(source.model, models.instantiate(symmetry.apply(graph, bad), source), x) > 1e-3


def test_constraints_matter_in_the_new_families(loaded):
    """Phi-3's partial rotary: a QK map may act on the pass-through dims but not mix them with rotary ones.
    Gemma's GeGLU: the GLU scale is exact on `up` (the random elements use it), not on the gelu gate."""
    source = loaded["phi3_partial_rotary"]
    graph, x = models.canonicalise(source), tiny.example_inputs("phi3_partial_rotary")
    spec = graph.spec
    assert 0 < spec.rotary_dims < spec.head_dim
    r = spec.rotary_dims
    for (a, b), breaks in (((r, r + 1), False), ((0, r), True), ((r, 0), True)):
        t = Transform.identity(spec)
        t.qk_maps = [torch.eye(spec.head_dim).repeat(spec.n_kv_heads, 1, 1) for _ in range(spec.n_layers)]
        t.qk_maps[0][:, a, b] = 0.5
        diff = checks.max_diff(source.model, models.instantiate(symmetry.apply(graph, t), source), x)
        assert diff > 1e-3 if breaks else diff <= 1e-4, (a, b, diff)
    source = loaded["gemma_mqa"]
    graph, x = models.canonicalise(source).materialise(), tiny.example_inputs("gemma_mqa")
    s = torch.exp(torch.empty(graph.spec.ffn_dim).uniform_(-0.7, 0.7, generator=torch.Generator().manual_seed(0)))
    for scaled, breaks in (("mlp.up", False), ("mlp.gate", True)):
        params = dict(graph.params)
        params["layers.0." + scaled] = params["layers.0." + scaled] * s
        params["layers.0.mlp.down"] = params["layers.0.mlp.down"] / s[:, None]
        diff = checks.max_diff(source.model, models.instantiate(graph.replace(params), source), x)
        assert diff > 1e-3 if breaks else diff <= 1e-4, (scaled, diff)


@pytest.mark.parametrize("kind", ["qwen2_sliding", "mistral_sliding"])
def test_sliding_windows_are_at_work_in_the_tiny_variants(loaded, kind, tmp_path):
    """The windowed variants really mask (else their exactness tests would not cover the window)."""
    import shutil
    shutil.copytree(loaded[kind].folder, tmp_path / "full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    config.update(sliding_window=None, use_sliding_window=False, layer_types=None)
    (tmp_path / "full" / "config.json").write_text(json.dumps(config))
    full = models.load(tmp_path / "full")
    x = tiny.example_inputs(kind)
    assert checks.max_diff(loaded[kind].model, full.model, x) > 1e-3
    with pytest.raises(models.IncompatibleModelsError, match="window"):
        models.check_compatible(loaded[kind], full)


def _breaks(source, graph, t, kind) -> float:
    moved = models.instantiate(symmetry.apply(graph, t), source)
    return checks.max_diff(source.model, moved, tiny.example_inputs(kind))


def _maps(graph, draw) -> list:
    return [torch.stack([draw(i, g) for g in range(graph.spec.n_kv_heads)]).float() for i in range(graph.spec.n_layers)]


@pytest.mark.parametrize("kind", ["olmo2_gqa", "olmo2_tied_bias", "gemma2_gqa_tied"])
def test_post_norm_gains_allow_only_signed_permutations(loaded, kind):
    """A gain after a norm on every residual write: a signed permutation of the stream (gains permuted) is exact,
    a rotation is not, and neither is the signed permutation with the gains left in place."""
    source = loaded[kind]
    graph = models.canonicalise(source)
    assert graph.spec.residual == "signed_permutation" and not graph.spec.scale_exact
    gen = torch.Generator().manual_seed(0)
    signed = Transform.identity(graph.spec)
    signed.rotation = symmetry.random_signed_permutation(graph.spec.d_model, gen).float()
    assert _breaks(source, graph, signed, kind) <= 1e-4
    rotated = Transform.identity(graph.spec)
    rotated.rotation = symmetry.random_orthogonal(graph.spec.d_model, gen).float()
    assert _breaks(source, graph, rotated, kind) > 1e-2
    moved = symmetry.apply(graph, signed)
    gains_kept = moved.replace({**moved.params, **{k: v for k, v in graph.params.items() if k.endswith("post_norm")}})
    assert checks.max_diff(source.model, models.instantiate(gains_kept, source), tiny.example_inputs(kind)) > 1e-2


@pytest.mark.parametrize("kind", ["qwen3_gqa_tied", "qwen3_bias", "olmo2_gqa", "olmo2_tied_bias"])
def test_qk_norm_rules_out_qk_maps(loaded, kind):
    """QK-norm with a gain: a RoPE-compatible QK map breaks the function, an OV map does not; what is left of the QK
    maps is a sign per RoPE pair (a rotation by pi), exact but unused.  Qwen3 keeps the residual rotation."""
    source = loaded[kind]
    graph = models.canonicalise(source)
    spec = graph.spec
    assert not spec.qk_maps and spec.ov_maps and spec.qk_norm in ("head", "projection")
    qk = Transform.identity(spec)
    qk.qk_maps = _maps(graph, lambda i, g: symmetry.random_qk_map(spec, torch.Generator().manual_seed(10 * i + g)))
    assert _breaks(source, graph, qk, kind) > 1e-2
    signs = Transform.identity(spec)
    flips = [torch.diag(torch.tensor([(-1.0) ** ((j % (spec.head_dim // 2)) + i + g) for j in range(spec.head_dim)]))
             for i in range(2) for g in range(spec.n_kv_heads)]
    signs.qk_maps = _maps(graph, lambda i, g: flips[i * spec.n_kv_heads + g])
    assert _breaks(source, graph, signs, kind) <= 1e-4
    ov = Transform.identity(spec)
    ov.ov_maps = symmetry.random_transform(spec, seed=5).ov_maps
    assert all(m is not None for m in ov.ov_maps) and _breaks(source, graph, ov, kind) <= 1e-4
    rotated = Transform.identity(spec)
    rotated.rotation = symmetry.random_orthogonal(spec.d_model, torch.Generator().manual_seed(1)).float()
    assert (_breaks(source, graph, rotated, kind) <= 1e-4) == (spec.residual == "orthogonal")
    if spec.qk_norm == "projection":  # the gain per coordinate must move with its head
        perm = Transform.identity(spec)
        perm.head_perm = symmetry.random_transform(spec, seed=3).head_perm
        moved = symmetry.apply(graph, perm)
        stale = moved.replace({**moved.params, **{k: v for k, v in graph.params.items() if k.endswith(("q_norm",
                                                                                                        "k_norm"))}})
        assert checks.max_diff(source.model, models.instantiate(stale, source), tiny.example_inputs(kind)) > 1e-2


def test_soft_capping_keeps_the_qk_maps(loaded):
    """Gemma-2's attention soft-capping acts on q·k, which a QK map leaves alone; a map that is not one breaks it."""
    source = loaded["gemma2_gqa_tied"]
    graph = models.canonicalise(source)
    spec = graph.spec
    assert spec.qk_maps and spec.ov_maps
    qk = Transform.identity(spec)
    qk.qk_maps = _maps(graph, lambda i, g: symmetry.random_qk_map(spec, torch.Generator().manual_seed(10 * i + g)))
    assert _breaks(source, graph, qk, "gemma2_gqa_tied") <= 1e-4
    bad = Transform.identity(spec)
    bad.qk_maps = [m.clone() for m in qk.qk_maps]
    for m in bad.qk_maps:
        m[:, 0, 1] += 0.5  # mixes two rotary pairs' coordinates: no longer commutes with RoPE
    assert _breaks(source, graph, bad, "gemma2_gqa_tied") > 1e-3


def test_gqa_head_permutation_must_keep_groups(loaded):
    spec = models.canonicalise(loaded["llama_gqa_tied"]).spec
    assert spec.n_kv_heads == 2 and spec.group_size == 2
    assert symmetry.kv_perm_of(torch.tensor([3, 2, 1, 0]), 2).tolist() == [1, 0]
    with pytest.raises(ValueError, match="KV groups"):
        symmetry.kv_perm_of(torch.tensor([0, 2, 1, 3]), 2)


def test_random_elements_respect_declared_constraints(loaded):
    for kind in KINDS:
        spec = models.canonicalise(loaded[kind]).spec
        t = symmetry.random_transform(spec, seed=11)
        if spec.centred:
            ones = torch.ones(spec.d_model)
            assert torch.allclose((ones @ t.rotation).abs(), ones, atol=1e-5)
        assert torch.allclose(t.rotation @ t.rotation.T, torch.eye(spec.d_model), atol=1e-5)
        if spec.residual == "signed_permutation":  # one ±1 per row and column
            assert torch.equal(t.rotation.abs().sum(0), torch.ones(spec.d_model))
            assert torch.equal(t.rotation.abs().sum(1), torch.ones(spec.d_model))
        assert all((m is None) != spec.qk_maps for m in t.qk_maps)
        assert all((m is None) != spec.ov_maps for m in t.ov_maps)
        for m in t.qk_maps:
            if m is None:
                continue
            for a, b in symmetry.rotary_pairs(spec):  # scaled rotation on every rotary pair
                assert torch.allclose(m[:, a, a], m[:, b, b]) and torch.allclose(m[:, a, b], -m[:, b, a])
                assert m[:, a][:, [j for j in range(spec.head_dim) if j not in (a, b)]].abs().max() == 0


def test_transform_serialises(loaded):
    spec = models.canonicalise(loaded["llama_gqa_tied"]).spec
    t = symmetry.random_transform(spec, seed=2)
    back = Transform.from_tensors(t.to_tensors(), spec)
    assert torch.equal(back.rotation, t.rotation) and back.scale == pytest.approx(t.scale)
    assert all(torch.equal(a, b) for a, b in zip(back.head_perm, t.head_perm))
    assert all(torch.equal(a, b) for a, b in zip(back.glu_scale, t.glu_scale))


# --- errors ------------------------------------------------------------------------------------

def test_unsupported_class_says_why(tmp_path):
    import transformers
    config = transformers.Olmo3Config(hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                      intermediate_size=32, vocab_size=50, pad_token_id=1, bos_token_id=None,
                                      eos_token_id=2)
    transformers.Olmo3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="QK-norm and post-norm"):
        models.load(tmp_path)


def test_unsupported_vit_variant(tmp_path):
    import timm
    from timm.models import save_for_hf
    args = dict(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=4, num_classes=3, qk_norm=True)
    save_for_hf(timm.create_model("vit_tiny_patch16_224", pretrained=False, **args), str(tmp_path),
                model_args=args, safe_serialization=True)
    loaded_vit = models.load(tmp_path)
    with pytest.raises(UnsupportedModelError, match="q_norm"):
        models.canonicalise(loaded_vit)


def test_mismatched_configs_name_the_fields(tmp_path, tiny_dirs):
    import transformers
    kind_config = tiny.adapter_of("gpt_neox").tiny["gpt_neox"]
    other = transformers.GPTNeoXConfig(**{**kind_config, "hidden_size": 48, "vocab_size": 101})
    transformers.GPTNeoXForCausalLM(other).save_pretrained(tmp_path)
    with pytest.raises(models.IncompatibleModelsError, match="d_model: 32 vs 48.*n_out: 97 vs 101"):
        models.check_compatible(models.load(tiny_dirs["gpt_neox"]), models.load(tmp_path))
    with pytest.raises(models.IncompatibleModelsError, match="different architectures"):
        models.check_compatible(models.load(tiny_dirs["gpt_neox"]), models.load(tiny_dirs["gpt2"]))
    models.check_compatible(models.load(tiny_dirs["gpt_neox"]), models.load(tiny_dirs["gpt_neox"]))


def test_not_a_model_folder(tmp_path):
    with pytest.raises(models.ModelLoadError, match="no config.json"):
        models.load(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(models.ModelLoadError, match="is a file"):
        models.load(tmp_path / "notes.txt")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(models.ModelLoadError, match="not valid JSON"):
        models.load(tmp_path)


def test_corrupt_weights(tmp_path, tiny_dirs):
    import shutil
    shutil.copytree(tiny_dirs["gpt_neox"], tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(models.ModelLoadError, match="could not load the weights"):
        models.load(tmp_path / "m")


def test_non_finite_weights(tmp_path):
    model = tiny.build_tiny("gpt2", seed=0)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path)
    with pytest.raises(models.ModelLoadError, match="non-finite"):
        models.canonicalise(models.load(tmp_path))


def test_inspect_command(tiny_dirs, capsys):
    from hf_rebasin.cli import main
    assert main(["inspect", str(tiny_dirs["gpt_neox"])]) == 0
    out = capsys.readouterr().out
    assert "GPTNeoXForCausalLM" in out
    assert "QK maps (per head): 4 of 8 head dims free, 4 restricted by RoPE to scaled rotations" in out
    assert main(["inspect", str(tiny_dirs["olmo_clip_qkv"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "OlmoForCausalLM" and info["parameters"] > 0
    assert any("clip_qkv" in line for line in info["symmetry_group"])
    assert main(["inspect", str(tiny_dirs["olmo2_gqa"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    group = "\n".join(info["symmetry_group"])
    assert "residual: signed permutations of the 32 coordinates only" in group
    assert "QK maps: none (q_norm/k_norm normalise the whole projection" in group and "OV maps (per KV group" in group
    assert any("signed permutations" in note and "q_norm/k_norm" in note for note in info["notes"])
    assert main(["inspect", str(tiny_dirs["gpt_neox"].parent)]) == 2
    assert "not a model folder" in capsys.readouterr().err


NEW_FAMILIES = {  # variant: lines inspect must print (the group used, and why parts are as they are)
    "qwen2_sliding": ["head permutations: 4 heads per layer", "QK maps (per head): 0 of 8 head dims free",
                      "q/k/v biases move with their heads", "sliding windows (None, 4) per layer",
                      "attention_windows: (None, 4)"],
    "mistral_sliding": ["2 KV groups of 2 query heads", "sliding window of 4 positions in every layer",
                        "sliding_window: 4"],
    "phi3_partial_rotary": ["QK maps (per KV group, shared by its query heads): 4 of 8 head dims free",
                            "qkv_proj split into q, k, v", "RoPE turns 4 of 8 head dims", "rotary_fraction: 0.5",
                            "sliding_window: None"],
    "gemma_mqa": ["1 KV groups of 4 query heads", "RMSNorm gains 1 + w absorbed", "sqrt(hidden_size) = 5.65685",
                  "GLU value scaling", "hidden_act: gelu_pytorch_tanh"],
}


@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_inspect_shows_the_group_of_each_new_family(tiny_dirs, kind, capsys):
    from hf_rebasin.cli import main
    assert main(["inspect", str(tiny_dirs[kind])]) == 0
    out = capsys.readouterr().out
    assert tiny.adapter_of(kind).architecture in out
    for line in NEW_FAMILIES[kind]:
        assert line in out, line
