"""timm's ViT family beyond the registry's tiny variants (which test_adapters / test_merge / test_widths run over):
options people use, each exact or refused by name; the exported checkpoint loading strictly with timm's own
create_model + load_state_dict; the groups the norm_pre and distillation-token variants declare, shown to be
no larger than the function allows (elements outside them break the function)."""
import json

import checks
import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.adapters import UnsupportedModelError, get_adapter
from hf_rebasin.adapters.vit import VisionTransformer
from hf_rebasin.core import symmetry
from hf_rebasin.core.symmetry import Transform
from hf_rebasin.export import checkpoint
from hf_rebasin.sources import models

BASE = VisionTransformer.base
TIMM_KINDS = [k for k in tiny.kinds() if tiny.adapter_of(k).backend == "timm"]

# options beyond the registry variants: (timm model name, create_model arguments)
OPTIONS = {
    "no_pos_embed": ("vit_tiny_patch16_224", dict(BASE, pos_embed="none", init_values=0.5)),
    "avg_norm_before_pool": ("vit_tiny_patch16_224", dict(BASE, class_token=False, global_pool="avg", fc_norm=False,
                                                          qkv_bias=False)),
    "avg_with_prefix_tokens": ("vit_tiny_patch16_224", dict(BASE, global_pool="avg", pool_include_prefix=True,
                                                            reg_tokens=1)),
    "class_token_avg_fc_norm": ("vit_tiny_patch16_224", dict(BASE, global_pool="avg", fc_norm=True)),
    "dynamic_img_size": ("vit_tiny_patch16_224", dict(BASE, dynamic_img_size=True, reg_tokens=1)),
    "norm_pre_avg_fc_norm": ("vit_tiny_patch16_224", dict(BASE, pre_norm=True, class_token=False, global_pool="avg",
                                                          no_embed_class=True, reg_tokens=1)),
    "deit_no_proj_bias": ("deit_tiny_distilled_patch16_224", dict(BASE, proj_bias=False, init_values=0.5)),
}


def save_timm(name: str, args: dict, path, seed: int = 1) -> models.Loaded:
    import timm
    from timm.models import save_for_hf
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, **args)
    tiny.randomise_(model, seed)
    with torch.no_grad():  # logits well above 1 also where the head reads an average of normalised tokens
        model.head.weight.mul_(3.0)
    save_for_hf(model.eval(), str(path), model_args=args, safe_serialization=True)
    return models.load(path)


def images(size: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed))


def diff(a, b, x) -> float:
    with torch.no_grad():
        return (a(x) - b(x)).abs().max().item()


def strict_reload(out_dir):
    """The export as timm's own constructor builds it from the exported config, weights loaded strictly."""
    import timm
    from safetensors.torch import load_file
    config = json.loads((out_dir / "config.json").read_text())
    model = timm.create_model(config["architecture"], pretrained=False, **config.get("model_args", {}))
    model.load_state_dict(load_file(out_dir / "model.safetensors"), strict=True)
    return model.eval(), config


def check_exact(source: models.Loaded, tmp_path, sizes=(16,)) -> None:
    """Round trip <= 1e-5, a random group element <= 1e-4, its export loads strictly and computes the same."""
    graph = models.canonicalise(source)
    for size in sizes:
        x = images(size)
        with torch.no_grad():
            assert source.model(x).abs().max() > 1.0
        assert diff(source.model, models.instantiate(graph, source), x) <= 1e-5
    t = symmetry.random_transform(graph.spec, seed=5)
    moved = symmetry.apply(graph, t)
    assert (moved.params["head.weight"] - graph.params["head.weight"]).abs().max() > 0.1
    checkpoint.export(moved, source, tmp_path / "out")
    reloaded, _ = strict_reload(tmp_path / "out")
    for size in sizes:
        assert diff(source.model, reloaded, images(size, seed=1)) <= 1e-4


@pytest.mark.parametrize("kind", TIMM_KINDS)
def test_export_loads_strictly_with_timm_and_keeps_the_model_args(kind, tiny_dirs, tmp_path):
    """LayerScale exported as gamma = 1 (init_values kept: the stock constructor builds it), missing biases switched
    on in model_args (the folded LayerNorm biases live there), every other model_arg as the source wrote it."""
    source = models.load(tiny_dirs[kind])
    check_exact(source, tmp_path)
    reloaded, config = strict_reload(tmp_path / "out")
    source_args = source.hub_config["model_args"]
    changes = {k: True for k in ("qkv_bias", "proj_bias") if source_args.get(k) is False}
    assert config["model_args"] == {**source_args, **changes}
    assert config["architecture"] == source.hub_config["architecture"]
    for name, value in reloaded.state_dict().items():
        if name.endswith(".gamma"):
            assert torch.equal(value, torch.ones_like(value)), name
    if changes:  # the export has the biases, and they are not zero (the folded LayerNorm biases)
        assert reloaded.blocks[0].attn.qkv.bias.abs().max() > 1e-3 and reloaded.blocks[0].mlp.fc1.bias is not None


@pytest.mark.parametrize("option", OPTIONS)
def test_other_options_are_exact(option, tmp_path):
    name, args = OPTIONS[option]
    source = save_timm(name, args, tmp_path / "model")
    # dynamic_img_size: the position embedding is resampled for other image sizes, along the token axis only
    check_exact(source, tmp_path, sizes=(16, 24) if args.get("dynamic_img_size") else (16,))
    if args.get("pre_norm"):
        assert source.spec.residual == "signed_permutation"


REFUSED = {  # create_model arguments -> what the refusal must name
    "max_pool": (dict(class_token=False, global_pool="max"), r"global_pool='max'.*maximum over tokens"),
    "avgmax_pool": (dict(class_token=False, global_pool="avgmax"), r"global_pool='avgmax'"),
    "attention_pool": (dict(global_pool="map"), r"global_pool='map'.*attention-pool"),
    "no_pool": (dict(global_pool=""), r"no pooling"),
    "no_final_norm": (dict(final_norm=False), r"final_norm=False.*raw residual stream"),
    "no_head": (dict(num_classes=0), r"no classifier head"),
    "qk_norm": (dict(qk_norm=True), r"q_norm.*QK-norm"),
    "scale_attn_norm": (dict(scale_attn_norm=True), r"attention norm"),
    "scale_mlp_norm": (dict(scale_mlp_norm=True), r"scale_mlp_norm"),
    "rms_norm": (dict(norm_layer="rmsnorm"), r"norm1 is RmsNorm, not LayerNorm"),
    "embed_norm": (dict(embed_norm_layer="layernorm"), r"embed_norm_layer"),
    "swiglu": (dict(mlp_layer="swiglu"), r"MLP class SwiGLU"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_options_are_refused_by_name(case):
    import timm
    args, message = REFUSED[case]
    if args.get("mlp_layer") == "swiglu":
        from timm.layers import SwiGLU
        args = {**args, "mlp_layer": SwiGLU}
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**BASE, **args})
    with pytest.raises(UnsupportedModelError, match=message):
        get_adapter(type(model).__name__).spec(model)


@pytest.mark.parametrize("args, message", [
    (dict(reg_tokens=1), r"reg_tokens with VisionTransformerDistilled.*never adds them"),
    (dict(fc_norm=True), r"fc_norm with VisionTransformerDistilled.*never applies fc_norm"),
])
def test_distilled_refusals(args, message):
    import timm
    model = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, **{**BASE, **args})
    with pytest.raises(UnsupportedModelError, match=message):
        get_adapter("VisionTransformerDistilled").spec(model)


def _bad(graph, source, x, t) -> float:
    return checks.max_diff(source.model, models.instantiate(symmetry.apply(graph, t), source), x)


def test_norm_pre_allows_permutations_not_rotations(tiny_dirs):
    """norm_pre's gains sit on the stream: ±P is exact, a rotation fixing the ones direction (exact without
    norm_pre) is not, nor are per-channel signs (they move the stream's mean: LayerNorm needs G·1 = ±1)."""
    x = tiny.example_inputs("vit_norm_pre")
    source = models.load(tiny_dirs["vit_norm_pre"])
    graph = models.canonicalise(source)
    spec, d = graph.spec, graph.spec.d_model
    assert spec.residual == "signed_permutation"
    gains = graph.params["pre_norm.weight"]
    assert gains.max() - gains.min() > 0.5  # distinct gains: the case the derivation is about
    gen = torch.Generator().manual_seed(0)
    perm = torch.eye(d)[torch.randperm(d, generator=gen)]
    for sign in (1.0, -1.0):
        assert _bad(graph, source, x, Transform(sign * perm)) <= 1e-4
    rotation = symmetry.random_rotation_fixing_ones(d, gen).float()
    assert _bad(graph, source, x, Transform(rotation)) > 1e-2
    signs = torch.ones(d)
    signs[: d // 2] = -1.0
    assert _bad(graph, source, x, Transform(perm * signs[:, None])) > 1e-2
    # the same rotation is exact for the variant without norm_pre: the restriction is norm_pre's
    plain = models.load(tiny_dirs["vit"])
    assert _bad(models.canonicalise(plain), plain, x, Transform(rotation)) <= 1e-4
    # random elements of the declared group are signed permutations with one sign
    for seed in range(4):
        g = symmetry.random_transform(spec, seed=seed).rotation
        assert torch.equal(g.abs().sum(0), torch.ones(d)) and len(set(g.sum(0).tolist())) == 1


def test_weight_matching_stays_in_the_reduced_group(tiny_dirs, tmp_path):
    """Two unrelated norm_pre models: weight matching returns a signed permutation (a rotation would export a model
    that is not B), and the matched B computes what B computes."""
    from hf_rebasin.match.weight import weight_matching
    a = models.canonicalise(models.load(tiny_dirs["vit_norm_pre"]))
    b_loaded = models.load(tiny.make_tiny("vit_norm_pre", tmp_path / "b", seed=2))
    b = models.canonicalise(b_loaded)
    t_b = weight_matching(a, b, max_rounds=2, progress=False).transform_b
    g = t_b.rotation
    assert torch.equal(g.abs().sum(0), torch.ones(g.shape[0])) and torch.equal(g.abs().sum(1), torch.ones(g.shape[0]))
    assert not torch.equal(g.abs(), torch.eye(g.shape[0]))
    x = tiny.example_inputs("vit_norm_pre", seed=2)
    assert _bad(b, b_loaded, x, t_b) <= 1e-4


@pytest.mark.parametrize("kind, key", [("deit_distilled", "embed.dist"), ("deit_distilled", "head_dist"),
                                       ("vit_registers", "embed.reg"), ("vit_norm_pre", "pre_norm.weight"),
                                       ("vit_norm_pre", "pre_norm.bias")])
def test_the_new_tensors_must_move_with_the_group(kind, key, tiny_dirs):
    """The distillation token and the registers are residual writes, head_dist a read, norm_pre's gain and bias
    move with the residual map: a group element that leaves one of them where it was breaks the function."""
    x = tiny.example_inputs(kind)
    source = models.load(tiny_dirs[kind])
    graph = models.canonicalise(source)
    moved = symmetry.apply(graph, symmetry.random_transform(graph.spec, seed=1))
    assert checks.max_diff(source.model, models.instantiate(moved, source), x) <= 1e-4
    broken = dict(moved.params)
    if key == "head_dist":  # the second half of the canonical head's columns
        n = graph.spec.n_out
        assert graph.params["head.weight"].shape[1] == 2 * n
        broken["head.weight"] = torch.cat([moved.params["head.weight"][:, :n], graph.params["head.weight"][:, n:]], 1)
    else:
        broken[key] = graph.params[key]
    assert checks.max_diff(source.model, models.instantiate(moved.replace(broken), source), x) > 1e-2


def test_models_without_biases_align_with_models_with_them(tmp_path):
    """qkv_bias / proj_bias only say whether biases exist (the canonical form has them): such models are one
    configuration; other model_args still have to agree."""
    without = save_timm("vit_tiny_patch16_224", dict(BASE, qkv_bias=False, proj_bias=False), tmp_path / "a")
    with_biases = save_timm("vit_tiny_patch16_224", dict(BASE), tmp_path / "b", seed=2)
    models.check_compatible(without, with_biases)
    other = save_timm("vit_tiny_patch16_224", dict(BASE, qkv_bias=False, reg_tokens=1), tmp_path / "c")
    with pytest.raises(models.IncompatibleModelsError, match="reg_tokens"):
        models.check_compatible(without, other)


def test_inspect_names_the_group_and_why(tiny_dirs, capsys):
    from hf_rebasin.cli import main
    assert main(["inspect", str(tiny_dirs["vit_norm_pre"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert any("signed permutations of the 32 coordinates" in line and "no rotations" in line
               for line in info["symmetry_group"])
    assert any("norm_pre" in note and "cannot absorb" not in note and "no linear layer can absorb" in note
               for note in info["notes"])
    assert main(["inspect", str(tiny_dirs["deit_distilled"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "VisionTransformerDistilled"
    assert any("fixing the all-ones direction" in line for line in info["symmetry_group"])
    assert any("qkv_bias" in note for note in info["notes"])
    assert any("distillation token" in note and "head_dist" in note for note in info["notes"])
    assert main(["inspect", str(tiny_dirs["vit_registers"])]) == 0
    out = capsys.readouterr().out
    assert "proj_bias" in out and "LayerScale" in out


@pytest.mark.parametrize("kind", TIMM_KINDS)
def test_unknown_tensors_are_refused(kind, tiny_dirs, tmp_path):
    """A tensor the adapter does not align (here a QK-norm gain) is an error, in memory and in a checkpoint's
    files, never silently dropped."""
    import shutil

    from safetensors.torch import load_file, save_file
    source = models.load(tiny_dirs[kind])
    state = dict(source.model.state_dict())
    source.adapter.to_canonical(state, source.config)  # every tensor of the variant is known
    state["blocks.0.attn.q_norm.weight"] = torch.ones(8)
    with pytest.raises(UnsupportedModelError, match="does not know how to align: blocks.0.attn.q_norm.weight"):
        source.adapter.to_canonical(state, source.config)
    shutil.copytree(tiny_dirs[kind], tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    save_file({**load_file(weights), "blocks.0.attn.q_norm.weight": torch.ones(8)}, weights)
    with pytest.raises(UnsupportedModelError, match="does not know how to align: blocks.0.attn.q_norm.weight"):
        models.canonicalise(models.load(tmp_path / "m"))


@pytest.mark.parametrize("one_sign", [True, False], ids=["centred", "per_channel"])
def test_signed_assignment_is_the_best_signed_permutation(one_sign):
    """Weight matching's residual step for a signed-permutation group, against every candidate (d = 4)."""
    import itertools

    from hf_rebasin.match.linalg import best_signed_permutation_matrix
    m = torch.randn(4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    best = best_signed_permutation_matrix(m, one_sign=one_sign)
    signs = [(1.0,) * 4, (-1.0,) * 4] if one_sign else list(itertools.product((1.0, -1.0), repeat=4))
    values = [float((torch.eye(4, dtype=torch.float64)[list(perm)] * torch.tensor(s)[:, None] * m).sum())
              for perm in itertools.permutations(range(4)) for s in signs]
    assert float((best * m).sum()) == pytest.approx(max(values), abs=1e-12)
    assert torch.equal(best.abs().sum(0), torch.ones(4, dtype=best.dtype))
    if one_sign:
        assert len(set(best.sum(0).tolist())) == 1
