"""Gemma-2 (``Gemma2ForCausalLM``): pre-norm AND post-sublayer RMSNorms, every gain stored as w and applied as
``1 + w``; embeddings multiplied by √d in the forward; GeGLU (tanh GELU gate); GQA with RoPE; attention scores
scaled by ``query_pre_attn_scalar^-½`` and soft-capped, ``c·tanh(s/c)``; final logits soft-capped; sliding-window
attention on alternate layers.

The group (docs/design.md §3), derived:

* residual: signed permutations only.  The pre-norms' and the final norm's gains fold into their readers as in
  LLaMA, but each write is ``RMSNorm(y)·diag(1 + w)`` (post_attention_layernorm, post_feedforward_layernorm):
  as for OLMo-2, a stream map G must satisfy ``diag(γ) G = M diag(γ')`` with M orthogonal for every kept gain γ,
  which generic gains allow for signed permutations only (``γ' = γ |G|``).  The gains are canonical tensors
  (``attn.post_norm``, ``mlp.post_norm``, holding γ = 1 + w).
* residual scale g: exact in principle (writes ``g W G``, post-norm gains ``g γ |G|``, every eps ``g² eps``), but
  not used: learned matching rescales the eps by dividing the writes, which the post-norms would undo.
* head permutations, QK maps (scaled 2-D rotations per RoPE pair) and OV maps: exact.  The scores depend on q and
  k only through ``q kᵀ`` (soft-capping, the scalar and the sliding window act on the scores), and the head's
  output through ``v W_O``.
* FFN permutations and GLU scales: exact (the up projection enters linearly; GELU is on the gate).
* √d: folded into the canonical token embedding (the export divides it out); the unembedding (tied in the
  class) reads the unscaled embedding times the final norm's gain, and is untied in the export.  The final
  soft-capping acts on the logits, after every map of the group."""
from __future__ import annotations

import torch

from ..core.canonical import Spec, fold_norm, layer_key
from .base import Adapter, filled, linear_in, register, rope_facts
from .llama import PROJECTIONS, WRITES, head_dim, linears_from_canonical
from .qwen2 import attention_windows

PRE_NORMS = {"attn": "input_layernorm", "mlp": "pre_feedforward_layernorm"}
POST_NORMS = {"attn.post_norm": "post_attention_layernorm", "mlp.post_norm": "post_feedforward_layernorm"}


def embed_scale(config) -> torch.Tensor:
    """The √d the class multiplies its embeddings by (a float32 scalar, as the class builds it)."""
    return torch.tensor(config.hidden_size ** 0.5)


@register
class Gemma2(Adapter):
    architecture = "Gemma2ForCausalLM"
    ignored_suffixes = ("rotary_emb.inv_freq", "embed_scale")
    modules = {"block": "model.layers.{i}", "attn_out": "model.layers.{i}.self_attn.o_proj",
               "ffn_hidden": "model.layers.{i}.mlp.down_proj", "final": "model.norm"}
    kept_gains = ("post_attention_layernorm", "post_feedforward_layernorm")
    unit_gain = 0.0
    tiny = {
        "gemma2_gqa_tied": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                intermediate_size=48, vocab_size=97, max_position_embeddings=64, head_dim=8,
                                query_pre_attn_scalar=12, sliding_window=6, attn_logit_softcapping=3.0,
                                final_logit_softcapping=8.0, tie_word_embeddings=True, pad_token_id=0,
                                eos_token_id=1, bos_token_id=2),
    }

    def config_facts(self, config) -> dict:
        return {"hidden_activation": config.hidden_activation, **rope_facts(config),
                "max_position_embeddings": config.max_position_embeddings,
                **{name: getattr(config, name, None) for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                                                                  "final_logit_softcapping", "attention_bias")},
                "attention_windows": attention_windows(config)}

    def spec(self, config, **overrides) -> Spec:
        fields = dict(
            architecture=self.architecture, d_model=config.hidden_size, n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim(config), ffn_dim=config.intermediate_size, n_out=config.vocab_size, glu=True,
            rotary_dims=head_dim(config), rotary_layout="half", residual="signed_permutation", scale_exact=False,
            notes=("pre-norm and final-norm gains (1 + w) absorbed into the next linear layers, exported as w = 0",
                   "post-sublayer norm gains kept as they are: the residual group is the signed permutations "
                   "(a rotation does not pass a gain after a norm)",
                   "residual scale g not used: the layers write through post-norms, which learned matching's eps "
                   "rescaling (dividing the writes) does not pass",
                   "sqrt(hidden_size) embedding scale folded into the canonical token embedding",
                   "embeddings untied in the export (the final norm gain now sits in lm_head): "
                   "tie_word_embeddings=False"))
        fields.update(overrides)
        return Spec(**fields)

    def norm_eps(self, config) -> float:
        return float(config.rms_norm_eps)

    def context_length(self, config) -> int:
        return config.max_position_embeddings

    def tiny_config(self, variant: str):
        from transformers import Gemma2Config
        return Gemma2Config(**self.tiny[variant])

    def outside_to_canonical(self, read, config, spec):
        embedding = read("model.embed_tokens.weight")
        unembed = (read.tied("model.embed_tokens.weight", "lm_head.weight") if config.tie_word_embeddings
                   else read("lm_head.weight")).T
        head = (1.0 + read("model.norm.weight"))[:, None] * unembed
        return {"embed.tok": embedding * embed_scale(config), "head.weight": head}

    def layer_to_canonical(self, read, config, spec, i):
        pre, p = f"model.layers.{i}.", {}
        for name, module in PROJECTIONS.items():
            gain = 1.0 + read(pre + PRE_NORMS[name.split(".")[0]] + ".weight")
            w, b = fold_norm(gain, None, *linear_in(read, pre + module))
            p[layer_key(i, name)] = w
            if b is not None:
                p[layer_key(i, name + "_bias")] = b
        for name, module in WRITES.items():
            w, b = linear_in(read, pre + module)
            p[layer_key(i, name)] = w
            if b is not None:
                p[layer_key(i, name + "_bias")] = b
        for name, module in POST_NORMS.items():
            p[layer_key(i, name)] = 1.0 + read(pre + module + ".weight")
        return p

    def outside_from_canonical(self, p, config, spec):
        return {"model.embed_tokens.weight": p["embed.tok"] / embed_scale(config).to(p["embed.tok"].dtype),
                "lm_head.weight": p["head.weight"].T, "model.norm.weight": filled(p["head.weight"], spec.d_model, 0.0)}

    def layer_from_canonical(self, p, config, spec, i):
        pre, sd = f"model.layers.{i}.", {}
        sd.update(linears_from_canonical(p, i, pre))
        for norm in PRE_NORMS.values():
            sd[pre + norm + ".weight"] = filled(p[layer_key(i, "attn.o")], spec.d_model, 0.0)
        for name, module in POST_NORMS.items():
            sd[pre + module + ".weight"] = p[layer_key(i, name)] - 1.0
        return sd

    def export_config_changes(self, graph, config) -> dict:
        return {**super().export_config_changes(graph, config), "tie_word_embeddings": False}
