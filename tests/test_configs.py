"""Configs compared by meaning, checkpoints written as the class writes them.

A config.json written by transformers 4 spells RoPE as rotary_pct / rotary_emb_base / rope_theta / rope_scaling, one
written by 5 as rope_parameters; the same model saved both ways is one model (same function, accepted, merged),
and two configs that mean different things are refused naming the fact and both values.  The export's tensor
names are exactly those of a stock save_pretrained of the exported configuration, for every registered variant."""
import json
import shutil

import pytest
import torch

from hf_rebasin import tiny
from hf_rebasin.cli import main
from hf_rebasin.core import symmetry
from hf_rebasin.export import checkpoint
from hf_rebasin.sources import models

TRANSFORMERS_KINDS = [k for k in tiny.kinds() if tiny.adapter_of(k).backend == "transformers"]


def rewrite_config(folder, out, drop=(), **changes):
    """A copy of a checkpoint folder whose config.json is edited by hand (as an older transformers wrote it)."""
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    config.update(changes, transformers_version="4.45.0")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def old_style(folder, out, **rope):
    """The config as transformers 4 wrote it: RoPE as attributes (rotary_pct, rotary_emb_base, rope_theta,
    rope_scaling), no rope_parameters."""
    return rewrite_config(folder, out, drop=("rope_parameters",), **rope)


def test_rope_written_by_transformers_4_means_the_same(tiny_dirs, tmp_path):
    new = models.load(tiny_dirs["gpt_neox"])  # rotary_pct=0.5 in the tiny config, theta 10000
    assert new.hub_config["rope_parameters"]["partial_rotary_factor"] == 0.5
    spellings = {"emb_base": dict(rotary_pct=0.5, rotary_emb_base=10000),
                 "rope_theta": dict(rotary_pct=0.5, rope_theta=10000, rope_scaling=None)}
    x = tiny.example_inputs("gpt_neox")
    for name, rope in spellings.items():
        old = models.load(old_style(tiny_dirs["gpt_neox"], tmp_path / name, **rope))
        assert "rope_parameters" not in old.hub_config
        assert old.adapter.config_facts(old.config) == new.adapter.config_facts(new.config)
        assert old.spec == new.spec and old.spec.rotary_dims == 4  # the adapter's own facts read the old spelling
        models.check_compatible(new, old)
        models.check_compatible(old, new)
        assert torch.equal(tiny.outputs(old.model, x), tiny.outputs(new.model, x))  # one function
        exported = models.instantiate(models.canonicalise(old), old)
        assert (tiny.outputs(exported, x) - tiny.outputs(new.model, x)).abs().max() <= 1e-5


def test_rope_of_another_meaning_is_refused_naming_the_fact(tiny_dirs, tmp_path):
    new = models.load(tiny_dirs["gpt_neox"])
    other_base = models.load(old_style(tiny_dirs["gpt_neox"], tmp_path / "base", rotary_pct=0.5,
                                            rotary_emb_base=20000))
    with pytest.raises(models.IncompatibleModelsError, match=r"rope_theta: 10000.0 vs 20000.0"):
        models.check_compatible(new, other_base)
    other_fraction = models.load(old_style(tiny_dirs["gpt_neox"], tmp_path / "pct", rotary_pct=0.25,
                                                rope_theta=10000))
    with pytest.raises(models.IncompatibleModelsError, match=r"rotary_dims: 4 vs 2.*rotary_fraction: 0.5 vs 0.25"):
        models.check_compatible(new, other_fraction)
    sequential = models.load(rewrite_config(tiny_dirs["gpt_neox"], tmp_path / "seq", use_parallel_residual=False))
    with pytest.raises(models.IncompatibleModelsError, match=r"use_parallel_residual: True vs False"):
        models.check_compatible(new, sequential)


def test_llama_rope_scaling_in_both_spellings(tiny_dirs, tmp_path):
    source = tiny_dirs["llama_gqa_tied"]
    plain = models.load(old_style(source, tmp_path / "plain", rope_theta=10000.0, rope_scaling=None))
    new = models.load(source)
    models.check_compatible(new, plain)
    linear_4 = models.load(old_style(source, tmp_path / "lin4", rope_theta=10000.0,
                                           rope_scaling={"type": "linear", "factor": 2.0}))
    linear_5 = models.load(rewrite_config(source, tmp_path / "lin5", rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}))
    models.check_compatible(linear_4, linear_5)
    x = tiny.example_inputs("llama_gqa_tied")
    assert torch.equal(tiny.outputs(linear_4.model, x), tiny.outputs(linear_5.model, x))
    assert (tiny.outputs(linear_4.model, x) - tiny.outputs(new.model, x)).abs().max() > 1e-3  # scaling matters
    with pytest.raises(models.IncompatibleModelsError, match=r"rope_type: default vs linear; rope_scaling: None vs "
                                                             r"\{'factor': 2.0\}"):
        models.check_compatible(new, linear_4)
    other_theta = models.load(old_style(source, tmp_path / "theta", rope_theta=500000.0))
    with pytest.raises(models.IncompatibleModelsError, match=r"rope_theta: 10000.0 vs 500000.0"):
        models.check_compatible(new, other_theta)


OLD_SPELLINGS = {"gpt_neox": dict(rotary_pct=0.5, rope_theta=10000, rope_scaling=None),
                 "llama_gqa_tied": dict(rope_theta=10000.0, rope_scaling=None)}


@pytest.mark.parametrize("kind", OLD_SPELLINGS)
def test_old_and_new_spelling_merge(kind, tiny_dirs, tmp_path, text_file):
    """`hf-rebasin merge` of a 5.x-style model and a 4.x-style disguised copy (the refusal of issue 30)."""
    import checks
    twin = checks.disguise(tiny_dirs[kind], tmp_path / "twin", seed=5)
    old = rewrite_config(twin, tmp_path / "old", drop=("rope_parameters",), **OLD_SPELLINGS[kind])
    assert main(["merge", str(tiny_dirs[kind]), str(old), "--method", "wm", "--out", str(tmp_path / "m"),
                 "--data", str(text_file), "--seq-len", "32", "--max-eval-tokens", "1024", "--lambdas", "3"]) == 0
    assert json.loads((tmp_path / "m" / "barrier.json").read_text())["barrier"] < 1e-3


def stock_keys(folder, out):
    """The tensor names a stock save_pretrained writes for the class and configuration in folder."""
    import transformers
    from safetensors import safe_open
    config = transformers.AutoConfig.from_pretrained(folder)
    model = getattr(transformers, config.architectures[0])(config)
    model.save_pretrained(out, safe_serialization=True)
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        return set(handle.keys())


@pytest.mark.parametrize("kind", TRANSFORMERS_KINDS)
def test_export_writes_the_names_the_class_saves(tiny_dirs, kind, tmp_path):
    from safetensors import safe_open
    source = models.load(tiny_dirs[kind])
    graph = models.canonicalise(source)
    checkpoint.export(symmetry.apply(graph, symmetry.random_transform(graph.spec, 1)), source, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as handle:
        written = set(handle.keys())
    assert written == stock_keys(tmp_path / "out", tmp_path / "stock")
    if kind.startswith("gpt_neox"):
        assert "embed_out.weight" in written and "lm_head.weight" not in written
    reread = models.load(tmp_path / "out")  # and hf-rebasin reads its own output back
    assert set(models.canonicalise(reread).shapes) == set(graph.shapes)


def test_rope_facts_of_config_objects_of_either_version():
    """A config object of transformers 4 keeps RoPE as attributes; one of 5 in rope_parameters (one per layer type
    for classes that alternate attention kinds): the facts are the same where the meaning is."""
    from types import SimpleNamespace

    import transformers

    from hf_rebasin.adapters.base import rope_facts
    five = transformers.GPTNeoXConfig(hidden_size=32, num_attention_heads=4, rotary_pct=0.25)
    four = SimpleNamespace(rotary_pct=0.25, rotary_emb_base=10000, rope_scaling=None)
    assert rope_facts(four) == rope_facts(five) == {"rope_theta": 10000.0, "rotary_fraction": 0.25,
                                                    "rope_type": "default", "rope_scaling": None}
    scaled = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0})
    assert rope_facts(scaled) == {"rope_theta": 5e5, "rotary_fraction": 1.0, "rope_type": "linear",
                                  "rope_scaling": {"factor": 4.0}}
    # LLaMA's default RoPE turns the whole head whatever partial_rotary_factor says; its scaled kinds honour it
    partial = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    assert rope_facts(partial, reads_partial=False)["rotary_fraction"] == 1.0
    assert rope_facts(partial)["rotary_fraction"] == 0.5
    per_kind = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    facts = rope_facts(per_kind)
    assert facts["full_attention.rope_theta"] == 1e6 and facts["sliding_attention.rope_theta"] == 1e4
