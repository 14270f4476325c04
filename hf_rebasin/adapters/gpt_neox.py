"""GPT-NeoX (Pythia): LayerNorm with bias, fused per-head interleaved QKV, partial rotary,
parallel or sequential residual, untied unembedding (``lm_head`` in the class, ``embed_out`` in its files:
read and written under that name).  Attention biases are always canonical (the LayerNorm bias folds into them),
so attention_bias is not a fact two models must share."""
from __future__ import annotations

import torch

from ..core.canonical import Spec, centre, fold_norm, layer_key
from .base import Adapter, filled, linear_in, register, rope_facts, safe_divide


def rotary_dims(config) -> int:
    """The rotary dims per head, from rotary_pct (transformers 4) or rope_parameters (5) alike."""
    return int(config.hidden_size // config.num_attention_heads * rope_facts(config)["rotary_fraction"])


@register
class GPTNeoX(Adapter):
    architecture = "GPTNeoXForCausalLM"
    ignored_suffixes = ("rotary_emb.inv_freq", "masked_bias", "attention.bias")
    saved_names = {"lm_head.weight": "embed_out.weight"}  # what save_pretrained and the Hub's Pythia files say
    modules = {"block": "gpt_neox.layers.{i}", "attn_out": "gpt_neox.layers.{i}.attention.dense",
               "ffn_hidden": "gpt_neox.layers.{i}.mlp.dense_4h_to_h", "final": "gpt_neox.final_layer_norm"}
    tiny = {
        "gpt_neox": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                         vocab_size=97, max_position_embeddings=64, rotary_pct=0.5, use_parallel_residual=True),
        "gpt_neox_sequential": dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                    intermediate_size=64, vocab_size=97, max_position_embeddings=64,
                                    rotary_pct=0.25, use_parallel_residual=False, attention_bias=False),
    }

    def spec(self, config) -> Spec:
        d, h = config.hidden_size, config.num_attention_heads
        return Spec(
            architecture=self.architecture, d_model=d, n_layers=config.num_hidden_layers, n_heads=h,
            n_kv_heads=h, head_dim=d // h, ffn_dim=config.intermediate_size, n_out=config.vocab_size,
            glu=False, rotary_dims=rotary_dims(config), rotary_layout="half", centred=True,
            embeddings=("tok",), token_embedding="tok",
            notes=("norm gains and biases absorbed into the next linear layers; LayerNorms exported with "
                   "weight 1 and bias 0, except the final one, which keeps a bias (lm_head has none to absorb it)",
                   "attention and FFN biases always present in the export (attention_bias=True)"))

    def config_facts(self, config) -> dict:
        return {"hidden_act": config.hidden_act, "use_parallel_residual": bool(config.use_parallel_residual),
                **rope_facts(config), "max_position_embeddings": config.max_position_embeddings}

    def norm_eps(self, config) -> float:
        return float(config.layer_norm_eps)

    def eps_config_changes(self, eps: float) -> dict:
        return {"layer_norm_eps": eps}

    def context_length(self, config) -> int:
        return config.max_position_embeddings

    def tiny_config(self, variant: str):
        from transformers import GPTNeoXConfig
        return GPTNeoXConfig(**self.tiny[variant])

    def outside_to_canonical(self, read, config, spec):
        gamma, beta = read("gpt_neox.final_layer_norm.weight"), read("gpt_neox.final_layer_norm.bias")
        unembed = (read.tied("gpt_neox.embed_in.weight", "lm_head.weight") if config.tie_word_embeddings
                   else read("lm_head.weight")).T
        return {"embed.tok": centre(read("gpt_neox.embed_in.weight")), "head.weight": gamma[:, None] * unembed,
                "final_norm.bias": safe_divide(beta, gamma)}

    def layer_to_canonical(self, read, config, spec, i):
        d, h, hd = spec.d_model, spec.n_heads, spec.head_dim
        pre, p = f"gpt_neox.layers.{i}.", {}
        w, b = linear_in(read, pre + "attention.query_key_value")
        w, b = fold_norm(read(pre + "input_layernorm.weight"), read(pre + "input_layernorm.bias"), w, b)
        w, b = w.reshape(d, h, 3, hd), b.reshape(h, 3, hd)
        for j, name in enumerate("qkv"):
            p[layer_key(i, f"attn.{name}")] = w[:, :, j].reshape(d, h * hd)
            p[layer_key(i, f"attn.{name}_bias")] = b[:, j].reshape(h * hd)
        w, b = linear_in(read, pre + "attention.dense")
        p[layer_key(i, "attn.o")] = centre(w)
        p[layer_key(i, "attn.o_bias")] = centre(b if b is not None else w.new_zeros(d))
        w, b = linear_in(read, pre + "mlp.dense_h_to_4h")
        w, b = fold_norm(read(pre + "post_attention_layernorm.weight"), read(pre + "post_attention_layernorm.bias"),
                         w, b)
        p[layer_key(i, "mlp.up")], p[layer_key(i, "mlp.up_bias")] = w, b
        w, b = linear_in(read, pre + "mlp.dense_4h_to_h")
        p[layer_key(i, "mlp.down")], p[layer_key(i, "mlp.down_bias")] = centre(w), centre(b)
        return p

    def outside_from_canonical(self, p, config, spec):
        return {"gpt_neox.embed_in.weight": p["embed.tok"], "lm_head.weight": p["head.weight"].T,
                "gpt_neox.final_layer_norm.weight": filled(p["head.weight"], spec.d_model, 1.0),
                "gpt_neox.final_layer_norm.bias": p["final_norm.bias"]}

    def layer_from_canonical(self, p, config, spec, i):
        d, h, hd = spec.d_model, spec.n_heads, spec.head_dim
        pre = f"gpt_neox.layers.{i}."
        lk = lambda name: p[layer_key(i, name)]
        w = torch.stack([lk(f"attn.{n}").reshape(d, h, hd) for n in "qkv"], dim=2).reshape(d, 3 * d)
        b = torch.stack([lk(f"attn.{n}_bias").reshape(h, hd) for n in "qkv"], dim=1).reshape(3 * d)
        sd = {pre + "attention.query_key_value.weight": w.T, pre + "attention.query_key_value.bias": b,
              pre + "attention.dense.weight": lk("attn.o").T, pre + "attention.dense.bias": lk("attn.o_bias"),
              pre + "mlp.dense_h_to_4h.weight": lk("mlp.up").T, pre + "mlp.dense_h_to_4h.bias": lk("mlp.up_bias"),
              pre + "mlp.dense_4h_to_h.weight": lk("mlp.down").T, pre + "mlp.dense_4h_to_h.bias": lk("mlp.down_bias")}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[pre + norm + ".weight"] = filled(b, d, 1.0)
            sd[pre + norm + ".bias"] = filled(b, d, 0.0)
        return sd

    def export_config_changes(self, graph, config) -> dict:
        return {**super().export_config_changes(graph, config), "tie_word_embeddings": False, "attention_bias": True}
