"""The seed families (hf_rebasin/hub/seed_families.py): each bundled recipe names the first two ids of its family, its
dry run works offline and takes any other two seeds by --set; the families' quirks are exact, each shown on a tiny
model built with that setting: GPT-2's scale_attn_by_inverse_layer_idx and reorder_and_upcast_attn (the Stanford
CRFM runs), BERT's token types and RoBERTa's position offset (tests/test_encoders.py)."""
import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.cli import main
from hf_rebasin.core import symmetry
from hf_rebasin.export import checkpoint
from hf_rebasin.hub import recipes
from hf_rebasin.hub.seed_families import SEED_FAMILIES
from hf_rebasin.sources import models

RECIPE_FAMILY = {name: name for name in SEED_FAMILIES}  # each family has one bundled recipe of its name


def test_every_family_has_its_recipe_naming_its_first_two_seeds():
    assert set(RECIPE_FAMILY) <= set(recipes.bundled())
    for name, family in RECIPE_FAMILY.items():
        ids = SEED_FAMILIES[family]
        assert len(set(ids)) == len(ids) >= 3
        assert tuple(recipes.read_yaml(recipes.bundled()[name])["models"]) == ids[:2]
    assert len(SEED_FAMILIES["multiberts"]) == 25 and SEED_FAMILIES["crfm-gpt2-medium"][2] == \
        "stanford-crfm/celebrimbor-gpt2-medium-x81"


@pytest.mark.parametrize("name", sorted(RECIPE_FAMILY))
def test_dry_run_offline_with_other_seeds(name, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing read from the Hub
    monkeypatch.chdir(tmp_path)
    ids = SEED_FAMILIES[RECIPE_FAMILY[name]]
    assert main(["run", name, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"merge {ids[0]} {ids[1]} --method wm" in out
    assert ("eval " in out) == (name != "multiberts")  # lm-eval is for causal LMs: no eval step for MultiBERTs
    assert main(["run", name, "--dry-run", "--set", f"models=[{ids[2]}, {ids[-1]}]"]) == 0
    assert f"merge {ids[2]} {ids[-1]} --method wm" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


CRFM = dict(scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)


def _gpt2(tmp_path, name, seed=1, **changes):
    import transformers
    config = transformers.GPT2Config(**{**tiny.adapter_of("gpt2").tiny["gpt2"], **changes})
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    tiny.randomise_(model, seed)
    model.save_pretrained(tmp_path / name)
    tiny.tiny_tokenizer(97).save_pretrained(tmp_path / name)
    return tmp_path / name


def _eager(folder):
    import transformers
    return transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def test_crfm_gpt2_attention_settings_are_exact(tmp_path):
    """scale_attn_by_inverse_layer_idx divides layer i's scores by i + 1 (a scalar on q·k: every QK map leaves it
    alone); reorder_and_upcast_attn computes the same scores in fp32 (run with eager attention, the only kind that
    reads it).  A random group element, exported and reloaded with the stock class, is exact with both; the first
    changes the function (so the test covers it) and must agree between two models."""
    folder = _gpt2(tmp_path, "crfm", **CRFM)
    source = models.load(folder)
    graph = models.canonicalise(source)
    checkpoint.export(symmetry.apply(graph, symmetry.random_transform(graph.spec, seed=2)), source, tmp_path / "out")
    x = tiny.example_inputs("gpt2", seed=1)
    reference, moved = _eager(folder), _eager(tmp_path / "out")
    assert moved.config.scale_attn_by_inverse_layer_idx and moved.config.reorder_and_upcast_attn
    assert (tiny.outputs(reference, x) - tiny.outputs(moved, x)).abs().max() <= 1e-4
    assert (tiny.outputs(source.model, x) - tiny.outputs(reference, x)).abs().max() <= 1e-4  # sdpa: the same
    plain = _gpt2(tmp_path, "plain")
    assert (tiny.outputs(_eager(plain), x) - tiny.outputs(reference, x)).abs().max() > 1e-3
    with pytest.raises(models.IncompatibleModelsError, match="scale_attn_by_inverse_layer_idx: True vs False"):
        models.check_compatible(source, models.load(plain))


def test_crfm_gpt2_disguised_copy_merges_flat(tmp_path, text_file):
    import json

    import checks
    folder = _gpt2(tmp_path, "crfm", **CRFM)
    twin = checks.disguise(folder, tmp_path / "twin", seed=3)
    assert main(["barrier", str(folder), str(twin), "--method", "wm", "--data", str(text_file), "--seq-len", "32",
                 "--max-eval-tokens", "1024", "--lambdas", "3", "--no-raw-reference",
                 "--json", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["barrier"] < 1e-3
