"""OLMoE (``OlmoeForCausalLM``): LLaMA's pre-norm layout (RMSNorm gains absorbed) with QK-norm over the whole q and
k projections (a gain per coordinate, as OLMo-2), an optional ``clip_qkv``, and a sparse MoE block in every layer
(adapters/moe.py): ``num_experts`` SwiGLU experts of ``intermediate_size`` units, top-k softmax routing
(renormalised when ``norm_topk_prob``).

The group, derived:

* residual rotation G: exact (the stream's norms are pre-norms, their gains folded into q, k, v, the router and
  the experts); residual scale g: not used (q_norm and k_norm share ``rms_norm_eps`` but read projections that g
  does not scale).
* head permutations: exact, with q_norm's and k_norm's gains permuted with their heads.
* QK maps: none (a gain per coordinate after a norm over the whole projection); OV maps: exact unless clip_qkv.
* expert permutations with the router's rows, unit permutations and GLU scales inside every expert."""
from __future__ import annotations

from ..core.canonical import layer_key
from .base import register
from .llama import Llama
from .moe import SparseMoe

QK_NORMS = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}


@register
class Olmoe(SparseMoe, Llama):
    architecture = "OlmoeForCausalLM"
    modules = {"block": "model.layers.{i}", "attn_out": "model.layers.{i}.self_attn.o_proj", "final": "model.norm"}
    kept_gains = ("q_norm", "k_norm")
    expert_dim_field = "intermediate_size"
    tiny = {"olmoe": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                          intermediate_size=16, vocab_size=97, max_position_embeddings=64, num_experts=4,
                          num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False,
                          pad_token_id=1, bos_token_id=None, eos_token_id=2)}

    def spec(self, config, **overrides):
        clipped = config.clip_qkv is not None
        notes = ("q_norm/k_norm (RMSNorm over the whole projection, a gain per coordinate) kept and permuted with "
                 "their heads: no QK maps; residual scale g not used (they share rms_norm_eps but read unscaled "
                 "projections)",)
        if clipped:
            notes += (f"clip_qkv={config.clip_qkv}: OV maps are not symmetries and are not used",)
        base = Llama.spec(self, config)
        return super().spec(config, qk_maps=False, ov_maps=not clipped, qk_norm="projection", scale_exact=False,
                            notes=base.notes + notes, **overrides)

    def config_facts(self, config) -> dict:
        return {**super().config_facts(config), "clip_qkv": config.clip_qkv}

    def tiny_config(self, variant: str):
        from transformers import OlmoeConfig
        return OlmoeConfig(**self.tiny[variant])

    def layer_to_canonical(self, read, config, spec, i):
        p = super().layer_to_canonical(read, config, spec, i)
        for name, module in QK_NORMS.items():
            p[layer_key(i, name)] = read(f"model.layers.{i}.{module}.weight")
        return p

    def layer_from_canonical(self, p, config, spec, i):
        sd = super().layer_from_canonical(p, config, spec, i)
        for name, module in QK_NORMS.items():
            sd[f"model.layers.{i}.{module}.weight"] = p[layer_key(i, name)]
        return sd
