"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head QK-norm with a gain shared by the heads, GQA,
RoPE) with a sparse MoE block in every layer (adapters/moe.py): ``num_experts`` SwiGLU experts of
``moe_intermediate_size`` units, top-k softmax routing (renormalised when ``norm_topk_prob``), no shared expert.

The group: Qwen3's reduced one (residual rotation, no residual scale, head permutations, OV maps, no QK maps;
adapters/qwen3.py says why), with the expert permutations (router rows with them), unit permutations and GLU
scales inside every expert.  Dense FFN layers among the sparse ones are refused."""
from __future__ import annotations

from .base import register
from .moe import SparseMoe
from .qwen3 import Qwen3


@register
class Qwen3Moe(SparseMoe, Qwen3):
    architecture = "Qwen3MoeForCausalLM"
    modules = {"block": "model.layers.{i}", "attn_out": "model.layers.{i}.self_attn.o_proj", "final": "model.norm"}
    tiny = {"qwen3_moe": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                              intermediate_size=40, moe_intermediate_size=16, vocab_size=97, head_dim=8,
                              max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                              tie_word_embeddings=False)}

    def tiny_config(self, variant: str):
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**self.tiny[variant])
