"""Qwen2 (``Qwen2ForCausalLM``): the LLaMA layout with biases on q, k and v (none on o or the MLP), GQA, tied
embeddings in the small sizes, and sliding-window attention on the layers ``layer_types`` names.

The symmetry group is LLaMA's.  The q/k/v biases are reads' biases: head permutations and the per-head QK/OV maps
act on them as on the columns of their weights (q + b_q -> (q + b_q) M), and the residual rotation does not touch
them.  A sliding window masks the same key positions for every head and every head dim, so it commutes with every
element of the group; the windows per layer are a fact two models must share."""
from __future__ import annotations

from .base import register
from .llama import Llama


def attention_windows(config) -> tuple:
    """The attention window of each layer as the class's forward uses it (None: full causal attention)."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


@register
class Qwen2(Llama):
    architecture = "Qwen2ForCausalLM"
    tiny = {
        "qwen2_gqa_tied": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                               intermediate_size=48, vocab_size=97, max_position_embeddings=64,
                               tie_word_embeddings=True),
        # layer 0 full attention, layer 1 a window of 4 positions (the tests' sequences are longer)
        "qwen2_sliding": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                              intermediate_size=48, vocab_size=97, max_position_embeddings=64,
                              tie_word_embeddings=False, use_sliding_window=True, sliding_window=4,
                              max_window_layers=1),
    }

    def notes(self, config):
        notes = ("q/k/v biases move with their heads under the head permutations and QK/OV maps",)
        if any(attention_windows(config)):
            notes += (f"sliding windows {attention_windows(config)} per layer: every head and head dim sees the "
                      "same positions, so the group is unchanged",)
        return notes

    def config_facts(self, config) -> dict:
        facts = {**super().config_facts(config), "attention_windows": attention_windows(config)}
        for fixed_by_the_class in ("attention_bias", "mlp_bias"):  # q/k/v biases always, none elsewhere
            facts.pop(fixed_by_the_class)
        return facts

    def tiny_config(self, variant: str):
        from transformers import Qwen2Config
        return Qwen2Config(**self.tiny[variant])
