"""Mixtral (``MixtralForCausalLM``): Mistral's attention (GQA, RoPE, an optional sliding window) with a sparse
mixture-of-experts FFN in every layer (adapters/moe.py): ``num_local_experts`` SwiGLU experts of
``intermediate_size`` units, top-``num_experts_per_tok`` softmax routing with the chosen weights renormalised.
Per-expert files name the block ``block_sparse_moe`` and the experts' projections w1 (gate), w3 (up), w2 (down).

The group: Mistral's (residual rotation and scale, head permutations, QK maps within RoPE, OV maps), with the
expert permutations (router rows with them), a unit permutation and GLU scales inside every expert
(core/experts.py).  The router is a reader of the normed stream: G reaches its columns, and the folded norm gain
its rows."""
from __future__ import annotations

from .base import register
from .mistral import Mistral
from .moe import SparseMoe

TINY = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=16,
            vocab_size=97, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
            tie_word_embeddings=False)


@register
class Mixtral(SparseMoe, Mistral):
    architecture = "MixtralForCausalLM"
    modules = {"block": "model.layers.{i}", "attn_out": "model.layers.{i}.self_attn.o_proj", "final": "model.norm"}
    file_block = "block_sparse_moe"
    expert_files = ("w1", "w3", "w2")
    expert_dim_field = "intermediate_size"
    tiny = {"mixtral_moe": TINY}

    def tiny_config(self, variant: str):
        from transformers import MixtralConfig
        return MixtralConfig(**self.tiny[variant])
