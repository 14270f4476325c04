"""Phi-3 (``Phi3ForCausalLM``): the LLaMA layout with two fused projections, ``qkv_proj`` = [q | k | v] (query
heads, then the KV heads of k, then those of v) and ``gate_up_proj`` = [gate | up], split on the way in and fused
on the way out; no biases, GQA, RoPE on the first ``partial_rotary_factor`` of each head (rotate_half layout
within them), optional sliding window and long-context RoPE scaling (``longrope``).

The group is LLaMA's with the QK maps of GPT-NeoX where the rotary fraction is below 1: on the rotary dims only
scaled rotations of each frequency pair commute with RoPE (also under longrope, which rescales the frequencies and
the cos/sin amplitude but keeps the pairs), the pass-through dims take any invertible map, and no map may mix the
two.  Fusing changes no symmetry: the fused output is the concatenation of the same q, k, v (gate, up) columns."""
from __future__ import annotations

import torch

from .base import StateReader, register, rope_facts
from .llama import Llama, head_dim


@register
class Phi3(Llama):
    architecture = "Phi3ForCausalLM"
    reads_partial_rotary = True  # Phi-3's RoPE turns the first partial_rotary_factor of each head only
    tiny = {
        "phi3_partial_rotary": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    num_hidden_layers=2, intermediate_size=48, vocab_size=97,
                                    max_position_embeddings=64, original_max_position_embeddings=64,
                                    partial_rotary_factor=0.5, tie_word_embeddings=False, pad_token_id=1,
                                    bos_token_id=1, eos_token_id=2),
    }

    def notes(self, config):
        hd = head_dim(config)
        rotary = int(hd * rope_facts(config, self.reads_partial_rotary)["rotary_fraction"])
        notes = ("qkv_proj split into q, k, v and gate_up_proj into gate, up; fused again in the export",)
        if rotary < hd:
            notes += (f"RoPE turns {rotary} of {hd} head dims: QK maps are scaled rotations per "
                      "frequency pair on those and any invertible map on the rest, never mixing the two",)
        if getattr(config, "sliding_window", None):
            notes += (f"sliding window of {config.sliding_window} positions: every head and head dim sees the "
                      "same positions, so the group is unchanged",)
        return notes

    def config_facts(self, config) -> dict:
        facts = {**super().config_facts(config), "sliding_window": getattr(config, "sliding_window", None)}
        if facts["rope_type"] == "longrope":  # the context length longrope switches its factors at
            facts["original_max_position_embeddings"] = getattr(config, "original_max_position_embeddings", None)
        for fixed_by_the_class in ("attention_bias", "mlp_bias"):  # no biases in Phi-3
            facts.pop(fixed_by_the_class)
        return facts

    def tiny_config(self, variant: str):
        from transformers import Phi3Config
        return Phi3Config(**self.tiny[variant])

    def _sizes(self, spec) -> list[int]:
        return [spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim]

    def layer_to_canonical(self, read, config, spec, i):
        """The fused tensors split into LLaMA's names, then LLaMA's conversion (which reads the split ones)."""
        pre = f"model.layers.{i}."
        q, k, v = read(pre + "self_attn.qkv_proj.weight").split(self._sizes(spec), dim=0)
        gate, up = read(pre + "mlp.gate_up_proj.weight").chunk(2, dim=0)
        split = {pre + "self_attn.q_proj.weight": q, pre + "self_attn.k_proj.weight": k,
                 pre + "self_attn.v_proj.weight": v, pre + "mlp.gate_proj.weight": gate,
                 pre + "mlp.up_proj.weight": up}
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight"):
            split[pre + name] = read(pre + name)
        return super().layer_to_canonical(StateReader(split, self.architecture, read.source, checked=True),
                                          config, spec, i)

    def layer_from_canonical(self, p, config, spec, i):
        pre = f"model.layers.{i}."
        sd = super().layer_from_canonical(p, config, spec, i)
        sd[pre + "self_attn.qkv_proj.weight"] = torch.cat(
            [sd.pop(pre + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
        sd[pre + "mlp.gate_up_proj.weight"] = torch.cat(
            [sd.pop(pre + "mlp.gate_proj.weight"), sd.pop(pre + "mlp.up_proj.weight")], dim=0)
        return sd
