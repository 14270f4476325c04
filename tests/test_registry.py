"""Adding an architecture is adding one file to hf_rebasin/adapters/: this test drops a throw-away adapter
module into the package, and the registry, the tiny variants and the very checks every adapter must pass
pick it up with nothing else changed.  Also: every registered adapter has tiny variants (so it is tested)."""
from __future__ import annotations

import sys
import textwrap

import checks
import corpus
import pytest

from hf_rebasin import adapters, tiny
from hf_rebasin.adapters import REGISTRY
from hf_rebasin.sources import models

THROWAWAY = textwrap.dedent('''
    """Seed-OSS (throw-away, written by tests/test_registry.py): the LLaMA layout with q/k/v biases."""
    from hf_rebasin.adapters.base import register
    from hf_rebasin.adapters.llama import Llama


    @register
    class SeedOss(Llama):
        architecture = "SeedOssForCausalLM"
        tiny = {"seed_oss_throwaway": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=8, num_hidden_layers=2, intermediate_size=48, vocab_size=97,
                                           max_position_embeddings=64, tie_word_embeddings=False,
                                           attention_bias=True, attention_out_bias=False, mlp_bias=False)}

        def tiny_config(self, variant):
            from transformers import SeedOssConfig
            return SeedOssConfig(**self.tiny[variant])
''')


def test_every_registered_adapter_has_tiny_variants():
    for name, adapter in REGISTRY.items():
        assert adapter.tiny, f"{name} declares no tiny variants, so no exactness test would run on it"
        for variant in adapter.tiny:
            assert tiny.adapter_of(variant) is adapter


@pytest.fixture
def throwaway_adapter(tmp_path, monkeypatch):
    """hf_rebasin/adapters/ with one more file in it (the folder extended by a temporary one)."""
    (tmp_path / "seed_oss_throwaway.py").write_text(THROWAWAY)
    monkeypatch.setattr(adapters, "__path__", [*adapters.__path__, str(tmp_path)])
    yield
    REGISTRY.pop("SeedOssForCausalLM", None)
    sys.modules.pop("hf_rebasin.adapters.seed_oss_throwaway", None)


def test_a_new_architecture_is_one_file(throwaway_adapter, tmp_path):
    assert "SeedOssForCausalLM" not in REGISTRY
    adapters.discover()
    assert "SeedOssForCausalLM" in REGISTRY and "seed_oss_throwaway" in tiny.kinds()
    folder = tiny.make_tiny("seed_oss_throwaway", tmp_path / "seed_oss", seed=1)
    source = models.load(folder)
    assert source.adapter is REGISTRY["SeedOssForCausalLM"]
    assert "layers.0.attn.q_bias" in models.canonicalise(source).params  # the biases LLaMA checkpoints lack
    # the checks test_adapters.py and test_merge.py run on every registered variant
    checks.round_trip_is_exact(source, "seed_oss_throwaway")
    checks.random_group_element_preserves_function(source, "seed_oss_throwaway")
    checks.export_loads_with_stock_loader(source, "seed_oss_throwaway", tmp_path / "export")
    text = tmp_path / "heldout.txt"
    text.write_text(corpus.heldout_text(20000))
    checks.weight_matching_recovers_a_disguised_copy("seed_oss_throwaway", folder, tmp_path, text, None)
