"""OLMo-1 (``OlmoForCausalLM``): the LLaMA layout with parameter-free LayerNorms (eps fixed at 1e-5 in
the class), SwiGLU, RoPE, optional ``clip_qkv``.  The LayerNorms mean the stream must stay centred
(G·1 = ±1), and with ``clip_qkv`` the clamp on q, k, v rules out the per-head QK/OV maps."""
from __future__ import annotations

from .base import register
from .llama import Llama

OLMO_EPS = 1e-5  # OlmoLayerNorm's eps, fixed in the class (not in the config)


@register
class Olmo(Llama):
    architecture = "OlmoForCausalLM"
    norm_gains = False
    tiny = {
        "olmo": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48,
                     vocab_size=97, max_position_embeddings=64, tie_word_embeddings=True,
                     pad_token_id=1, bos_token_id=None, eos_token_id=2),
        "olmo_clip_qkv": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48,
                              vocab_size=97, max_position_embeddings=64, tie_word_embeddings=False, clip_qkv=0.8,
                              pad_token_id=1, bos_token_id=None, eos_token_id=2),
    }

    def spec(self, config, **overrides):
        clipped = config.clip_qkv is not None
        notes = ["OLMo's LayerNorm has no parameters: nothing is absorbed, the residual writes are centred"]
        if clipped:
            notes.append(f"clip_qkv={config.clip_qkv}: per-head QK/OV maps are not symmetries and are not used")
        if config.tie_word_embeddings:
            notes.append("tied embeddings kept as two tensors in the export (tie_word_embeddings=False): "
                         "the residual rotation acts on them as a write and a read")
        return super().spec(config, centred=True, qk_maps=not clipped, ov_maps=not clipped, scale_exact=False,
                            notes=tuple(notes), **overrides)

    def config_facts(self, config) -> dict:
        return {**super().config_facts(config), "clip_qkv": config.clip_qkv}

    def norm_eps(self, config) -> float:
        return OLMO_EPS

    def eps_config_changes(self, eps: float) -> dict:
        return {}

    def tiny_config(self, variant: str):
        from transformers import OlmoConfig
        return OlmoConfig(**self.tiny[variant])
