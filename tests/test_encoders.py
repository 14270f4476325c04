"""BERT and RoBERTa with their masked-LM heads (docs/design.md §9).  Beyond the checks every registered variant passes
(test_adapters, test_merge, ...): the post-LN group is no larger than the function allows (elements outside it
break the function, every kept tensor must move with it); the family's quirks (token types with an attention mask,
RoBERTa's position offset and shorter context) are exact or refused by name; the masked-LM barrier's masks are
fixed, recorded and the same for every method; activation matching finds a disguised copy; what `self` and `eval`
say for masked LMs."""
import json

import checks
import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.adapters import UnsupportedModelError
from hf_rebasin.cli import main
from hf_rebasin.core import symmetry
from hf_rebasin.core.symmetry import Transform
from hf_rebasin.errors import UserError
from hf_rebasin.sources import models

ENCODERS = ["bert", "roberta", "bert_pretraining"]


def outputs(model, x, **extra):
    """The token logits, and BertForPreTraining's next-sentence logits (the pooler's output) beside them."""
    with torch.no_grad():
        out = model(input_ids=x, **extra)
    nsp = getattr(out, "seq_relationship_logits", None)
    logits = models.lm_logits(out)
    return logits if nsp is None else torch.cat([logits.flatten(), 10 * nsp.flatten()])


def diff(source, graph, x, **extra) -> float:
    moved = models.instantiate(graph, source)
    return (outputs(source.model, x, **extra) - outputs(moved, x, **extra)).abs().max().item()


@pytest.fixture(scope="module")
def encoders(tiny_dirs):
    out = {}
    for kind in ENCODERS:
        source = models.load(tiny_dirs[kind])
        out[kind] = source, models.canonicalise(source).materialise()
    return out


@pytest.mark.parametrize("kind", ENCODERS)
def test_the_residual_group_is_the_permutations_times_one_sign(encoders, kind):
    """±P is exact; a rotation fixing the ones direction (exact for pre-norm LayerNorm models) is not, nor are signs
    per coordinate (LayerNorm subtracts the mean), nor the residual scale (the head's LayerNorm has the same eps)."""
    source, graph = encoders[kind]
    spec, d, x = graph.spec, graph.spec.d_model, tiny.example_inputs(kind)
    assert spec.residual == "signed_permutation" and spec.centred and not spec.scale_exact
    assert outputs(source.model, x).abs().max() > 1.0
    gen = torch.Generator().manual_seed(0)
    perm = torch.eye(d)[torch.randperm(d, generator=gen)]
    for sign in (1.0, -1.0):
        assert diff(source, symmetry.apply(graph, Transform(sign * perm)), x) <= 1e-4
    rotation = symmetry.random_rotation_fixing_ones(d, gen).float()
    assert diff(source, symmetry.apply(graph, Transform(rotation)), x) > 1e-2
    signs = torch.ones(d)
    signs[: d // 2] = -1.0
    assert diff(source, symmetry.apply(graph, Transform(perm * signs[:, None])), x) > 1e-2
    assert diff(source, symmetry.apply(graph, Transform(None, 1.3)), x) > 1e-3


KEPT = ["embed.type", "pre_norm.weight", "pre_norm.bias", "layers.0.attn.stream_norm", "layers.0.attn.stream_norm_bias",
        "layers.1.mlp.stream_norm", "layers.1.mlp.stream_norm_bias", "head.transform", "head.transform_bias",
        "head.norm.weight", "head.norm.bias"]


@pytest.mark.parametrize("kind", ENCODERS)
def test_every_kept_tensor_moves_with_the_group(encoders, kind):
    """A random element is exact; leaving any one of the tensors that post-LN and the tied head add where it was
    breaks the function (so each is really moved, and moved as it must be)."""
    source, graph = encoders[kind]
    x = tiny.example_inputs(kind, seed=1)
    t = symmetry.random_transform(graph.spec, seed=3)
    moved = symmetry.apply(graph, t)
    assert diff(source, moved, x) <= 1e-4
    extra = ["head.weight", "head.pooler"] if kind == "bert_pretraining" else []
    for key in KEPT + extra:
        stale = moved.replace({**moved.params, key: graph.params[key]})
        assert diff(source, stale, x) > 1e-3, key


def test_the_head_space_moves_without_the_sign(encoders):
    """The MLM head's dense output passes GELU, so the tied space moves by |G| there (W -> G^T W |G|): with G = -P,
    W -> G^T W G (the sign pushed through GELU) breaks the function."""
    source, graph = encoders["bert"]
    d, x = graph.spec.d_model, tiny.example_inputs("bert")
    g = -torch.eye(d)[torch.randperm(d, generator=torch.Generator().manual_seed(2))]
    moved = symmetry.apply(graph, Transform(g))
    assert diff(source, moved, x) <= 1e-4
    signed = {**moved.params, "head.transform": g.T @ graph.params["head.transform"] @ g,
              "head.transform_bias": graph.params["head.transform_bias"] @ g}
    assert diff(source, moved.replace(signed), x) > 1e-2


def test_token_types_and_padding_masks_are_exact(encoders):
    """token_type_ids (a residual write per type) and an attention mask with padding: a random element is exact for
    them too, and both change the outputs (so the comparison covers them)."""
    source, graph = encoders["bert_pretraining"]  # three token types
    x = tiny.example_inputs("bert_pretraining", batch=3, seq=16)
    types = torch.randint(0, 3, x.shape, generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    mask[0, 10:] = 0
    mask[2, 5:] = 0
    moved = symmetry.apply(graph, symmetry.random_transform(graph.spec, seed=4))
    assert diff(source, moved, x, token_type_ids=types, attention_mask=mask) <= 1e-4
    plain = outputs(source.model, x)
    assert (outputs(source.model, x, token_type_ids=types) - plain).abs().max() > 1e-2
    with torch.no_grad():
        masked = models.lm_logits(source.model(input_ids=x, attention_mask=mask))
        plain = models.lm_logits(source.model(input_ids=x))
    assert (masked[1] - plain[1]).abs().max() <= 1e-5  # the row without padding
    assert (masked[0, :10] - plain[0, :10]).abs().max() > 1e-3


def test_roberta_position_offset_is_exact_and_bounds_the_context(encoders, tiny_dirs, tmp_path, text_file):
    """RoBERTa numbers positions from pad_token_id + 1 and gives pad tokens the row pad_token_id: inputs with pad
    tokens and a full-length window are exact under a random element; the context is max_position_embeddings -
    pad_token_id - 1 tokens, and a longer --seq-len is refused naming it."""
    source, graph = encoders["roberta"]
    pad, context = source.config.pad_token_id, source.adapter.context_length(source.config)
    assert context == source.config.max_position_embeddings - pad - 1 == 64
    x = tiny.example_inputs("roberta", seq=context)
    x[:, ::7] = pad
    moved = symmetry.apply(graph, symmetry.random_transform(graph.spec, seed=6))
    assert diff(source, moved, x) <= 1e-4
    no_pad = x.clone()
    no_pad[:, ::7] = pad + 5
    assert (outputs(source.model, x)[:, 3] - outputs(source.model, no_pad)[:, 3]).abs().max() > 1e-3  # positions move
    code = main(["barrier", str(tiny_dirs["roberta"]), str(tiny_dirs["roberta"]), "--method", "raw", "--data",
                 str(text_file), "--seq-len", str(context + 1), "--json", str(tmp_path / "b.json")])
    assert code == 2


def test_refused_variants_say_why(tmp_path):
    import transformers
    base = dict(tiny.adapter_of("bert").tiny["bert"])
    for name, changes, message in (
            ("relative", dict(position_embedding_type="relative_key"), r"position_embedding_type='relative_key'.*QK"),
            ("decoder", dict(is_decoder=True), r"is_decoder"),):
        config = transformers.BertConfig(**base, **changes)
        transformers.BertForMaskedLM(config).save_pretrained(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps({**json.loads(
            (tmp_path / name / "config.json").read_text()), **changes}))
        with pytest.raises(UnsupportedModelError, match=message):
            _ = models.load(tmp_path / name).spec
    transformers.BertModel(transformers.BertConfig(**base)).save_pretrained(tmp_path / "bare")
    with pytest.raises(UnsupportedModelError, match=r"BertModel has no masked-LM head.*BertForMaskedLM"):
        models.load(tmp_path / "bare")


def test_masks_are_fixed_recorded_and_shared_by_the_methods(tiny_dirs, tmp_path, text_file):
    """The same masks at every λ and for every method: raw and wm read the same masked windows (same digest, same
    record); about 15 % of the ordinary tokens are predicted, special tokens never; the loss is over those only."""
    from hf_rebasin.sources.eval_data import load_eval_data
    source = models.load(tiny_dirs["bert"])
    first = load_eval_data(str(text_file), source, seq_len=32, max_tokens=4096, max_examples=None)
    second = load_eval_data(str(text_file), source, seq_len=32, max_tokens=4096, max_examples=None)
    assert torch.equal(first.inputs, second.inputs) and torch.equal(first.labels, second.labels)
    record = first.info["masking"]
    chosen = first.labels != -100
    assert record["scheme"] == "BERT 80/10/10" and record["seed"] == 0 and record["predicted"] == int(chosen.sum())
    assert 0.12 < chosen.float().mean() < 0.18
    assert record["masked"] > 6 * record["random"]
    assert (first.inputs == record["mask_token_id"]).sum() == record["masked"]
    assert not torch.isin(first.labels[chosen], torch.tensor(record["never_masked_ids"])).any()
    twin = checks.disguise(tiny_dirs["bert"], tmp_path / "twin", seed=3)
    reports = {}
    for method, extra in (("raw", []), ("wm", ["--no-raw-reference"])):
        assert main(["barrier", str(tiny_dirs["bert"]), str(twin), "--method", method, "--data", str(text_file),
                     "--seq-len", "32", "--max-eval-tokens", "1024", "--lambdas", "3", *extra,
                     "--json", str(tmp_path / f"{method}.json")]) == 0
        reports[method] = json.loads((tmp_path / f"{method}.json").read_text())
    assert reports["raw"]["data"]["digest"] == reports["wm"]["data"]["digest"]
    assert reports["raw"]["data"]["masking"] == reports["wm"]["data"]["masking"]
    assert reports["wm"]["task"] == "masked-lm" and len(reports["wm"]["accuracy"]) == 3
    assert reports["wm"]["barrier"] < 1e-3 and max(reports["wm"]["loss"]) - min(reports["wm"]["loss"]) < 1e-4
    assert abs(reports["raw"]["loss"][1] - reports["raw"]["loss"][0]) > 1e-2  # the disguise moved the weights


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_activation_matching_finds_a_disguised_copy(kind, tiny_dirs, tmp_path, text_file):
    twin = checks.disguise(tiny_dirs[kind], tmp_path / "twin", seed=4)
    assert main(["barrier", str(tiny_dirs[kind]), str(twin), "--method", "am", "--data", str(text_file),
                 "--seq-len", "32", "--max-eval-tokens", "2048", "--lambdas", "3", "--no-raw-reference",
                 "--json", str(tmp_path / "am.json")]) == 0
    report = json.loads((tmp_path / "am.json").read_text())
    assert report["barrier"] < 1e-3 and report["data"]["part"]


def test_self_and_eval_are_refused_for_masked_lms(tiny_dirs, tmp_path, text_file, capsys):
    from hf_rebasin.hub.evals import check_language_model
    a = str(tiny_dirs["bert"])
    assert main(["merge", a, a, "--method", "lm", "--train-data", "self", "--data", str(text_file),
                 "--out", str(tmp_path / "m")]) == 2
    assert "a masked LM only fills in masked tokens" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"masked LM \(BertForMaskedLM\).*lm-eval's zero-shot tasks score"):
        check_language_model(a)
    from hf_rebasin.adapters import REGISTRY
    from hf_rebasin.architectures import masked_lm_architectures
    assert masked_lm_architectures() == {name for name, adapter in REGISTRY.items() if adapter.task == "masked-lm"}


def test_inspect_shows_the_group_and_what_is_refused(tiny_dirs, capsys):
    for kind, arch in (("bert", "BertForMaskedLM"), ("roberta", "RobertaForMaskedLM"),
                       ("bert_pretraining", "BertForPreTraining")):
        assert main(["inspect", str(tiny_dirs[kind]), "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["architecture"] == arch and info["task"] == "masked-lm"
        group = "\n".join(info["symmetry_group"])
        assert "signed permutations of the 32 coordinates only" in group and "post-LN encoders" in group
        assert "QK maps (per head): any invertible 8x8 (no RoPE)" in group and "residual scale g: fixed to 1" in group
        assert any("post-LN" in note for note in info["notes"])
        refused = "\n".join(info["refused"])
        assert "relative position embeddings" in refused and "`self`" in refused and "`eval`" in refused
    assert info["context_length"] == 64
