"""Mistral (``MistralForCausalLM``): the LLaMA layout without biases, GQA, and one sliding attention window for
every layer (``sliding_window``; None: full causal attention).  The window masks the same key positions for every
head and head dim, so the symmetry group is LLaMA's; the window is a fact two models must share."""
from __future__ import annotations

from .base import register
from .llama import Llama


@register
class Mistral(Llama):
    architecture = "MistralForCausalLM"
    tiny = {
        # a window of 4 positions: shorter than the tests' sequences, so the mask is at work
        "mistral_sliding": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                intermediate_size=48, vocab_size=97, max_position_embeddings=64, head_dim=16,
                                sliding_window=4, tie_word_embeddings=False),
    }

    def notes(self, config):
        window = getattr(config, "sliding_window", None)
        notes = (f"sliding window of {window} positions in every layer: every head and head dim sees the same "
                 "positions, so the group is unchanged",) if window else ()
        return notes

    def config_facts(self, config) -> dict:
        return {**super().config_facts(config), "sliding_window": getattr(config, "sliding_window", None)}

    def tiny_config(self, variant: str):
        from transformers import MistralConfig
        return MistralConfig(**self.tiny[variant])
