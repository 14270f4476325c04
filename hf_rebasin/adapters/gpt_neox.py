"""GPT-NeoX (Pythia): LayerNorm with bias, fused per-head interleaved QKV, partial rotary,
parallel or sequential residual, untied unembedding (``lm_head``, ``embed_out`` on the Hub)."""
from __future__ import annotations

import torch

from ..canonical import Graph, Spec, centre, fold_norm, layer_key
from .base import Adapter, StateReader, linear_in, safe_divide


def rotary_dims(config) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    return int(head_dim * factor)


def spec(config) -> Spec:
    d, h = config.hidden_size, config.num_attention_heads
    return Spec(
        architecture="GPTNeoXForCausalLM", d_model=d, n_layers=config.num_hidden_layers, n_heads=h,
        n_kv_heads=h, head_dim=d // h, ffn_dim=config.intermediate_size, n_out=config.vocab_size,
        glu=False, rotary_dims=rotary_dims(config), rotary_layout="half", centred=True,
        embeddings=("tok",), token_embedding="tok",
        notes=("norm gains and biases absorbed into the next linear layers; LayerNorms exported with weight 1 "
               "and bias 0, except the final one, which keeps a bias (lm_head has none to absorb it)",
               "attention and FFN biases always present in the export (attention_bias=True)"))


def to_canonical(state_dict, config) -> Graph:
    s, r = spec(config), StateReader(state_dict, "GPTNeoXForCausalLM")
    d, h, hd = s.d_model, s.n_heads, s.head_dim
    p = {"embed.tok": centre(r("gpt_neox.embed_in.weight"))}
    for i in range(s.n_layers):
        pre = f"gpt_neox.layers.{i}."
        w, b = linear_in(r, pre + "attention.query_key_value")
        w, b = fold_norm(r(pre + "input_layernorm.weight"), r(pre + "input_layernorm.bias"), w, b)
        w = w.reshape(d, h, 3, hd)
        b = b.reshape(h, 3, hd)
        for j, name in enumerate("qkv"):
            p[layer_key(i, f"attn.{name}")] = w[:, :, j].reshape(d, h * hd)
            p[layer_key(i, f"attn.{name}_bias")] = b[:, j].reshape(h * hd)
        w, b = linear_in(r, pre + "attention.dense")
        p[layer_key(i, "attn.o")] = centre(w)
        p[layer_key(i, "attn.o_bias")] = centre(b if b is not None else torch.zeros(d))
        w, b = linear_in(r, pre + "mlp.dense_h_to_4h")
        w, b = fold_norm(r(pre + "post_attention_layernorm.weight"), r(pre + "post_attention_layernorm.bias"), w, b)
        p[layer_key(i, "mlp.up")], p[layer_key(i, "mlp.up_bias")] = w, b
        w, b = linear_in(r, pre + "mlp.dense_4h_to_h")
        p[layer_key(i, "mlp.down")], p[layer_key(i, "mlp.down_bias")] = centre(w), centre(b)
    gamma, beta = r("gpt_neox.final_layer_norm.weight"), r("gpt_neox.final_layer_norm.bias")
    unembed = (r.tied("gpt_neox.embed_in.weight", "lm_head.weight") if config.tie_word_embeddings else r("lm_head.weight")).T
    p["head.weight"] = gamma[:, None] * unembed
    p["final_norm.bias"] = safe_divide(beta, gamma)
    r.finish(ignore=("rotary_emb.inv_freq", "masked_bias", "attention.bias"))
    return Graph(s, p, float(config.layer_norm_eps))


def from_canonical(graph: Graph, config):
    s, p = graph.spec, graph.params
    d, h, hd = s.d_model, s.n_heads, s.head_dim
    ones, zeros = torch.ones(d), torch.zeros(d)
    sd = {"gpt_neox.embed_in.weight": p["embed.tok"]}
    for i in range(s.n_layers):
        pre = f"gpt_neox.layers.{i}."
        lk = lambda name: p[layer_key(i, name)]  # noqa: E731
        w = torch.stack([lk(f"attn.{n}").reshape(d, h, hd) for n in "qkv"], dim=2).reshape(d, 3 * d)
        b = torch.stack([lk(f"attn.{n}_bias").reshape(h, hd) for n in "qkv"], dim=1).reshape(3 * d)
        sd[pre + "attention.query_key_value.weight"], sd[pre + "attention.query_key_value.bias"] = w.T, b
        sd[pre + "attention.dense.weight"], sd[pre + "attention.dense.bias"] = lk("attn.o").T, lk("attn.o_bias")
        sd[pre + "mlp.dense_h_to_4h.weight"], sd[pre + "mlp.dense_h_to_4h.bias"] = lk("mlp.up").T, lk("mlp.up_bias")
        sd[pre + "mlp.dense_4h_to_h.weight"], sd[pre + "mlp.dense_4h_to_h.bias"] = lk("mlp.down").T, lk("mlp.down_bias")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[pre + norm + ".weight"], sd[pre + norm + ".bias"] = ones, zeros
    sd["gpt_neox.final_layer_norm.weight"] = ones
    sd["gpt_neox.final_layer_norm.bias"] = p["final_norm.bias"]
    sd["lm_head.weight"] = p["head.weight"].T
    changes = {"layer_norm_eps": graph.norm_eps, "tie_word_embeddings": False, "attention_bias": True}
    return sd, changes


MODULES = {"block": "gpt_neox.layers.{i}",
           "attn_out": "gpt_neox.layers.{i}.attention.dense",
           "ffn_hidden": "gpt_neox.layers.{i}.mlp.dense_4h_to_h",
           "final": "gpt_neox.final_layer_norm"}

ADAPTER = Adapter("GPTNeoXForCausalLM", "transformers", spec, to_canonical, from_canonical, modules=MODULES)
