"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v biases, GQA, RoPE) with a sparse MoE block in every
layer (adapters/moe.py): ``num_experts`` SwiGLU experts of ``moe_intermediate_size`` units, top-k softmax routing
(renormalised when ``norm_topk_prob``), and a shared expert of ``shared_expert_intermediate_size`` units whose
output is multiplied by ``sigmoid(x · w_shared_gate)``.

The group: Qwen2's, with the expert permutations (router rows with them), unit permutations and GLU scales inside
every expert, and the shared expert's own unit permutation and GLU scales (canonically the layer's ``mlp.*``: the
sigmoid gate multiplies its whole output, so it commutes with them; the gate's weight ``mlp.shared_gate`` is a
reader of the stream).  Models with dense FFN layers among the sparse ones (``mlp_only_layers``,
``decoder_sparse_step`` > 1) are refused."""
from __future__ import annotations

from .base import register
from .moe import SparseMoe
from .qwen2 import Qwen2


@register
class Qwen2Moe(SparseMoe, Qwen2):
    architecture = "Qwen2MoeForCausalLM"
    modules = {"block": "model.layers.{i}", "attn_out": "model.layers.{i}.self_attn.o_proj", "final": "model.norm"}
    shared = True
    tiny = {"qwen2_moe": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                              intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                              vocab_size=97, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=False, tie_word_embeddings=False)}

    def tiny_config(self, variant: str):
        from transformers import Qwen2MoeConfig
        return Qwen2MoeConfig(**self.tiny[variant])
