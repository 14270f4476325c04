"""GPT-2 (``GPT2LMHeadModel``): LayerNorm with bias, learned position embeddings, Conv1D layout
(already row-vector: W is (d_in, d_out)), fused QKV split as [q | k | v], tied embeddings."""
from __future__ import annotations

import torch

from ..canonical import Graph, Spec, centre, fold_norm, layer_key
from .base import Adapter, StateReader, safe_divide


def spec(config) -> Spec:
    d, h = config.n_embd, config.n_head
    return Spec(
        architecture="GPT2LMHeadModel", d_model=d, n_layers=config.n_layer, n_heads=h, n_kv_heads=h,
        head_dim=d // h, ffn_dim=config.n_inner or 4 * d, n_out=config.vocab_size, glu=False,
        rotary_dims=0, centred=True, embeddings=("tok", "pos"), token_embedding="tok",
        notes=("norm gains and biases absorbed into the next linear layers; LayerNorms exported with weight 1 "
               "and bias 0, except ln_f, which keeps a bias (lm_head has none to absorb it)",
               "embeddings untied in the export (the final norm gain now sits in lm_head): "
               "tie_word_embeddings=False"))


def conv1d(r: StateReader, prefix: str):
    return r(prefix + ".weight"), r(prefix + ".bias")


def to_canonical(state_dict, config) -> Graph:
    s, r = spec(config), StateReader(state_dict, "GPT2LMHeadModel")
    d = s.d_model
    p = {"embed.tok": centre(r("transformer.wte.weight")), "embed.pos": centre(r("transformer.wpe.weight"))}
    for i in range(s.n_layers):
        pre = f"transformer.h.{i}."
        w, b = fold_norm(r(pre + "ln_1.weight"), r(pre + "ln_1.bias"), *conv1d(r, pre + "attn.c_attn"))
        for j, name in enumerate("qkv"):
            p[layer_key(i, f"attn.{name}")] = w[:, j * d:(j + 1) * d]
            p[layer_key(i, f"attn.{name}_bias")] = b[j * d:(j + 1) * d]
        w, b = conv1d(r, pre + "attn.c_proj")
        p[layer_key(i, "attn.o")], p[layer_key(i, "attn.o_bias")] = centre(w), centre(b)
        w, b = fold_norm(r(pre + "ln_2.weight"), r(pre + "ln_2.bias"), *conv1d(r, pre + "mlp.c_fc"))
        p[layer_key(i, "mlp.up")], p[layer_key(i, "mlp.up_bias")] = w, b
        w, b = conv1d(r, pre + "mlp.c_proj")
        p[layer_key(i, "mlp.down")], p[layer_key(i, "mlp.down_bias")] = centre(w), centre(b)
    gamma, beta = r("transformer.ln_f.weight"), r("transformer.ln_f.bias")
    unembed = (r.tied("transformer.wte.weight", "lm_head.weight") if config.tie_word_embeddings else r("lm_head.weight")).T
    p["head.weight"] = gamma[:, None] * unembed
    p["final_norm.bias"] = safe_divide(beta, gamma)
    r.finish(ignore=("attn.bias", "attn.masked_bias"))
    return Graph(s, p, float(config.layer_norm_epsilon))


def from_canonical(graph: Graph, config):
    s, p = graph.spec, graph.params
    ones, zeros = torch.ones(s.d_model), torch.zeros(s.d_model)
    sd = {"transformer.wte.weight": p["embed.tok"], "transformer.wpe.weight": p["embed.pos"]}
    for i in range(s.n_layers):
        pre = f"transformer.h.{i}."
        lk = lambda name: p[layer_key(i, name)]  # noqa: E731
        sd[pre + "attn.c_attn.weight"] = torch.cat([lk(f"attn.{n}") for n in "qkv"], dim=1)
        sd[pre + "attn.c_attn.bias"] = torch.cat([lk(f"attn.{n}_bias") for n in "qkv"])
        sd[pre + "attn.c_proj.weight"], sd[pre + "attn.c_proj.bias"] = lk("attn.o"), lk("attn.o_bias")
        sd[pre + "mlp.c_fc.weight"], sd[pre + "mlp.c_fc.bias"] = lk("mlp.up"), lk("mlp.up_bias")
        sd[pre + "mlp.c_proj.weight"], sd[pre + "mlp.c_proj.bias"] = lk("mlp.down"), lk("mlp.down_bias")
        for norm in ("ln_1", "ln_2"):
            sd[pre + norm + ".weight"], sd[pre + norm + ".bias"] = ones, zeros
    sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"] = ones, p["final_norm.bias"]
    sd["lm_head.weight"] = p["head.weight"].T
    return sd, {"layer_norm_epsilon": graph.norm_eps, "tie_word_embeddings": False}


MODULES = {"block": "transformer.h.{i}",
           "attn_out": "transformer.h.{i}.attn.c_proj",
           "ffn_hidden": "transformer.h.{i}.mlp.c_proj",
           "final": "transformer.ln_f"}

ADAPTER = Adapter("GPT2LMHeadModel", "transformers", spec, to_canonical, from_canonical, modules=MODULES)
