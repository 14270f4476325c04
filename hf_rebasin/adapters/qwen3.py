"""Qwen3 (``Qwen3ForCausalLM``): the LLaMA layout (RMSNorm gains absorbed, SwiGLU, RoPE, GQA) plus a per-head
QK-norm: ``q_h -> RMSNorm(q_h) · diag(γ_q)`` over each head's ``hd`` dims, one gain shared by all heads (likewise
k), before RoPE.

The group (docs/design.md §3), derived:

* residual rotation G: exact.  The pre-norms are parameter-free once their gains are folded into q, k, v, up
  and gate, exactly as in LLaMA, and the q/k norms act after the projections, away from the stream.
* residual scale g: not used.  The stream's pre-norms would take eps·g², but q_norm and k_norm read the
  projections (which g does not scale) with the same ``rms_norm_eps``: no single eps keeps both exact.
* head permutations: exact.  γ_q and γ_k are shared by every head, so moving whole heads leaves them alone.
* QK maps: not exact.  ``RMSNorm(q_h M)·diag(γ) = RMSNorm(q_h)·diag(γ)·M'`` needs M orthogonal (the rms) and
  ``M' = diag(γ)⁻¹ M diag(γ)`` to commute with RoPE and cancel against k's map; for generic γ only a sign per
  rotary frequency pair (a rotation by π) survives: a finite group, left unused.
* OV maps: exact (v is not normalised).  FFN permutations and GLU scales: exact, as in LLaMA.

The q_norm/k_norm gains are kept as canonical tensors (``attn.q_norm``, ``attn.k_norm``, length hd): they are
interpolated like every weight and no element of the declared group changes them."""
from __future__ import annotations

from ..core.canonical import layer_key
from .base import register
from .llama import Llama
from .qwen2 import attention_windows


@register
class Qwen3(Llama):
    architecture = "Qwen3ForCausalLM"
    kept_gains = ("q_norm", "k_norm")
    tiny = {
        "qwen3_gqa_tied": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                               intermediate_size=48, vocab_size=97, max_position_embeddings=64, head_dim=8,
                               tie_word_embeddings=True),
        "qwen3_bias": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                           intermediate_size=48, vocab_size=97, max_position_embeddings=64, head_dim=16,
                           tie_word_embeddings=False, attention_bias=True),
    }

    def config_facts(self, config) -> dict:
        return {**super().config_facts(config), "attention_windows": attention_windows(config)}

    def spec(self, config, **overrides):
        base = super().spec(config)
        notes = base.notes + (
            "q_norm/k_norm (per-head RMSNorm with a gain shared by the heads) kept as they are: no QK maps "
            "(a head-dim map does not pass through a norm with a gain; only a sign per RoPE pair would, unused)",
            "residual scale g not used: q_norm/k_norm share the stream norms' rms_norm_eps but read unscaled "
            "projections")
        return super().spec(config, qk_maps=False, qk_norm="head", scale_exact=False, notes=notes, **overrides)

    def tiny_config(self, variant: str):
        from transformers import Qwen3Config
        return Qwen3Config(**self.tiny[variant])

    def layer_to_canonical(self, read, config, spec, i):
        p = super().layer_to_canonical(read, config, spec, i)
        for name in ("q_norm", "k_norm"):
            p[layer_key(i, f"attn.{name}")] = read(f"model.layers.{i}.self_attn.{name}.weight")
        return p

    def layer_from_canonical(self, p, config, spec, i):
        sd = super().layer_from_canonical(p, config, spec, i)
        for name in ("q_norm", "k_norm"):
            sd[f"model.layers.{i}.self_attn.{name}.weight"] = p[layer_key(i, f"attn.{name}")]
        return sd
