"""LLaMA: RMSNorm with gain, SwiGLU, full RoPE (rotate_half layout), GQA, tied or untied embeddings.

The functions here also serve OLMo-1 (see olmo.py), which shares the layout but has
parameter-free LayerNorms."""
from __future__ import annotations

import torch

from ..canonical import Graph, Spec, centre, fold_norm, layer_key
from .base import Adapter, StateReader, linear_in

PROJECTIONS = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
               "mlp.up": "mlp.up_proj", "mlp.gate": "mlp.gate_proj"}
WRITES = {"attn.o": "self_attn.o_proj", "mlp.down": "mlp.down_proj"}
LLAMA_MODULES = {"block": "model.layers.{i}", "attn_out": "model.layers.{i}.self_attn.o_proj",
                 "ffn_hidden": "model.layers.{i}.mlp.down_proj", "final": "model.norm"}
NORM_BEFORE = {"attn": "input_layernorm", "mlp": "post_attention_layernorm"}


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def spec(config, **overrides) -> Spec:
    fields = dict(
        architecture="LlamaForCausalLM", d_model=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim(config), ffn_dim=config.intermediate_size, n_out=config.vocab_size, glu=True,
        rotary_dims=head_dim(config), rotary_layout="half", centred=False,
        embeddings=("tok",), token_embedding="tok",
        notes=("RMSNorm gains absorbed into the next linear layers; RMSNorms exported with weight 1",)
        + (("embeddings untied in the export (the final norm gain now sits in lm_head): "
            "tie_word_embeddings=False",) if config.tie_word_embeddings else ()))
    fields.update(overrides)
    return Spec(**fields)


def llama_like_to_canonical(state_dict, config, s: Spec, norm_gains: bool, centred: bool) -> Graph:
    """Shared by LLaMA (RMSNorm gains, no centring) and OLMo-1 (no gains, LayerNorm: centre writes)."""
    r = StateReader(state_dict, s.architecture)
    write = centre if centred else (lambda w: w)
    p = {"embed.tok": write(r("model.embed_tokens.weight"))}
    for i in range(s.n_layers):
        pre = f"model.layers.{i}."
        for name, module in PROJECTIONS.items():
            w, b = linear_in(r, pre + module)
            if norm_gains:
                w, b = fold_norm(r(pre + NORM_BEFORE[name.split(".")[0]] + ".weight"), None, w, b)
            p[layer_key(i, name)] = w
            if b is not None:
                p[layer_key(i, name + "_bias")] = b
        for name, module in WRITES.items():
            w, b = linear_in(r, pre + module)
            p[layer_key(i, name)] = write(w)
            if b is not None:
                p[layer_key(i, name + "_bias")] = write(b)
    unembed = (r.tied("model.embed_tokens.weight", "lm_head.weight") if config.tie_word_embeddings else r("lm_head.weight")).T
    p["head.weight"] = (r("model.norm.weight")[:, None] * unembed) if norm_gains else unembed
    r.finish(ignore=("rotary_emb.inv_freq",))
    return Graph(s, p, float(getattr(config, "rms_norm_eps", 1e-5)))


def llama_like_from_canonical(graph: Graph, norm_gains: bool) -> dict:
    s, p = graph.spec, graph.params
    sd = {"model.embed_tokens.weight": p["embed.tok"], "lm_head.weight": p["head.weight"].T}
    for i in range(s.n_layers):
        pre = f"model.layers.{i}."
        for name, module in {**PROJECTIONS, **WRITES}.items():
            sd[pre + module + ".weight"] = p[layer_key(i, name)].T
            if layer_key(i, name + "_bias") in p:
                sd[pre + module + ".bias"] = p[layer_key(i, name + "_bias")]
        if norm_gains:
            for norm in NORM_BEFORE.values():
                sd[pre + norm + ".weight"] = torch.ones(s.d_model)
    if norm_gains:
        sd["model.norm.weight"] = torch.ones(s.d_model)
    return sd


def to_canonical(state_dict, config) -> Graph:
    return llama_like_to_canonical(state_dict, config, spec(config), norm_gains=True, centred=False)


def from_canonical(graph: Graph, config):
    sd = llama_like_from_canonical(graph, norm_gains=True)
    return sd, {"rms_norm_eps": graph.norm_eps, "tie_word_embeddings": False}


ADAPTER = Adapter("LlamaForCausalLM", "transformers", spec, to_canonical, from_canonical,
                  modules=LLAMA_MODULES)
