"""OLMo-2 (``Olmo2ForCausalLM``): no norm before the sublayers; each sublayer reads the raw stream and writes
``RMSNorm(y)·diag(w)`` (post_attention_layernorm, post_feedforward_layernorm); q and k are normalised over the
whole projection (all heads at once) with a gain per coordinate, before RoPE; SwiGLU, GQA; a final RMSNorm.

The group (docs/design.md §3), derived:

* residual: signed permutations only.  The final norm's gain folds into the unembedding as in LLaMA, and the
  raw reads take ``Gᵀ W`` for any invertible G; the final norm makes G orthogonal.  But every write is
  ``RMSNorm(y)·diag(w)``: rotating the stream needs ``RMSNorm(y)·diag(w)·G = RMSNorm(y M)·diag(w')``, i.e.
  ``diag(w) G = M diag(w')`` with M orthogonal (the norm passes only those), for every layer's gain w with the one
  G.  A signed permutation G does it (M = G, ``w' = w |G|``); for generic gains a rotation does not (the negative
  test).  The post-norm gains are canonical tensors (``attn.post_norm``, ``mlp.post_norm``) that G permutes.
* residual scale g: not used.  The reads are raw (no norm to absorb g before the SiLU gate), so g would have to
  divide the up/gate reads while the writes keep their scale: a different action from the pre-norm families'.
* head permutations: exact, with q_norm's and k_norm's gains permuted with their heads (the rms over the whole
  projection does not see the order).
* QK maps: not exact.  The norm spans all heads and its gain is per coordinate: a map inside a head must be
  orthogonal (the rms) and commute with the gain and RoPE, which for generic gains leaves a sign per rotary pair.
* OV maps: exact (v is not normalised; ``v N · N⁻¹ W_O`` feeds the post-norm the same y).
* FFN permutations and GLU scales: exact (the MLP's output y is unchanged)."""
from __future__ import annotations

from ..core.canonical import layer_key
from .base import filled, linear_in, register
from .llama import PROJECTIONS, WRITES, Llama, linears_from_canonical

POST_NORMS = {"attn.post_norm": "post_attention_layernorm", "mlp.post_norm": "post_feedforward_layernorm"}
QK_NORMS = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}


@register
class Olmo2(Llama):
    architecture = "Olmo2ForCausalLM"
    modules = {"block": "model.layers.{i}", "attn_out": "model.layers.{i}.self_attn.o_proj",
               "ffn_hidden": "model.layers.{i}.mlp.down_proj", "final": "model.norm"}
    kept_gains = ("q_norm", "k_norm", "post_attention_layernorm", "post_feedforward_layernorm")
    tiny = {
        "olmo2_gqa": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                          intermediate_size=48, vocab_size=97, max_position_embeddings=64, tie_word_embeddings=False,
                          pad_token_id=1, bos_token_id=None, eos_token_id=2),
        "olmo2_tied_bias": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48,
                                vocab_size=97, max_position_embeddings=64, tie_word_embeddings=True,
                                attention_bias=True, pad_token_id=1, bos_token_id=None, eos_token_id=2),
    }

    def spec(self, config, **overrides):
        notes = ("final RMSNorm gain absorbed into the unembedding, exported with weight 1",
                 "post-sublayer norm gains and q_norm/k_norm gains kept as they are: the residual group is the "
                 "signed permutations (a rotation does not pass a gain after a norm), no QK maps (the QK-norm's "
                 "gain per coordinate; only a sign per RoPE pair would pass, unused)",
                 "residual scale g not used: the sublayers read the raw stream")
        if config.tie_word_embeddings:
            notes += ("embeddings untied in the export (the final norm gain now sits in lm_head): "
                      "tie_word_embeddings=False",)
        return super().spec(config, residual="signed_permutation", qk_maps=False, qk_norm="projection",
                            scale_exact=False, notes=notes, **overrides)

    def tiny_config(self, variant: str):
        from transformers import Olmo2Config
        return Olmo2Config(**self.tiny[variant])

    def layer_to_canonical(self, read, config, spec, i):
        pre, p = f"model.layers.{i}.", {}
        for name, module in {**PROJECTIONS, **WRITES}.items():  # the reads see the raw stream: nothing to fold
            w, b = linear_in(read, pre + module)
            p[layer_key(i, name)] = w
            if b is not None:
                p[layer_key(i, name + "_bias")] = b
        for name, module in {**POST_NORMS, **QK_NORMS}.items():
            p[layer_key(i, name)] = read(pre + module + ".weight")
        return p

    def layer_from_canonical(self, p, config, spec, i):
        pre, sd = f"model.layers.{i}.", {}
        sd.update(linears_from_canonical(p, i, pre))
        for name, module in {**POST_NORMS, **QK_NORMS}.items():
            sd[pre + module + ".weight"] = p[layer_key(i, name)]
        return sd

    def outside_from_canonical(self, p, config, spec):
        return {"model.embed_tokens.weight": p["embed.tok"], "lm_head.weight": p["head.weight"].T,
                "model.norm.weight": filled(p["head.weight"], spec.d_model, 1.0)}
