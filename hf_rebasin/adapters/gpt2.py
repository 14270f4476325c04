"""GPT-2 (``GPT2LMHeadModel``): LayerNorm with bias, learned position embeddings, Conv1D layout
(already row-vector: W is (d_in, d_out)), fused QKV split as [q | k | v], tied embeddings."""
from __future__ import annotations

import torch

from ..core.canonical import Spec, centre, fold_norm, layer_key
from .base import Adapter, filled, register, safe_divide


def conv1d(read, prefix: str):
    return read(prefix + ".weight"), read(prefix + ".bias")


@register
class GPT2(Adapter):
    architecture = "GPT2LMHeadModel"
    ignored_suffixes = ("attn.bias", "attn.masked_bias")
    modules = {"block": "transformer.h.{i}", "attn_out": "transformer.h.{i}.attn.c_proj",
               "ffn_hidden": "transformer.h.{i}.mlp.c_proj", "final": "transformer.ln_f"}
    tiny = {"gpt2": dict(n_embd=32, n_head=4, n_layer=2, vocab_size=97, n_positions=64)}

    def spec(self, config) -> Spec:
        d, h = config.n_embd, config.n_head
        return Spec(
            architecture=self.architecture, d_model=d, n_layers=config.n_layer, n_heads=h, n_kv_heads=h,
            head_dim=d // h, ffn_dim=config.n_inner or 4 * d, n_out=config.vocab_size, glu=False,
            rotary_dims=0, centred=True, embeddings=("tok", "pos"), token_embedding="tok",
            notes=("norm gains and biases absorbed into the next linear layers; LayerNorms exported with weight 1 "
                   "and bias 0, except ln_f, which keeps a bias (lm_head has none to absorb it)",
                   "embeddings untied in the export (the final norm gain now sits in lm_head): "
                   "tie_word_embeddings=False"))

    def config_facts(self, config) -> dict:
        return {"activation_function": config.activation_function, "n_positions": config.n_positions,
                "scale_attn_weights": bool(config.scale_attn_weights),
                "scale_attn_by_inverse_layer_idx": bool(config.scale_attn_by_inverse_layer_idx)}

    def norm_eps(self, config) -> float:
        return float(config.layer_norm_epsilon)

    def eps_config_changes(self, eps: float) -> dict:
        return {"layer_norm_epsilon": eps}

    def context_length(self, config) -> int:
        return config.n_positions

    def tiny_config(self, variant: str):
        from transformers import GPT2Config
        return GPT2Config(**self.tiny[variant])

    def outside_to_canonical(self, read, config, spec):
        gamma, beta = read("transformer.ln_f.weight"), read("transformer.ln_f.bias")
        unembed = (read.tied("transformer.wte.weight", "lm_head.weight") if config.tie_word_embeddings
                   else read("lm_head.weight")).T
        return {"embed.tok": centre(read("transformer.wte.weight")),
                "embed.pos": centre(read("transformer.wpe.weight")),
                "head.weight": gamma[:, None] * unembed, "final_norm.bias": safe_divide(beta, gamma)}

    def layer_to_canonical(self, read, config, spec, i):
        d, pre, p = spec.d_model, f"transformer.h.{i}.", {}
        w, b = fold_norm(read(pre + "ln_1.weight"), read(pre + "ln_1.bias"), *conv1d(read, pre + "attn.c_attn"))
        for j, name in enumerate("qkv"):
            p[layer_key(i, f"attn.{name}")] = w[:, j * d:(j + 1) * d]
            p[layer_key(i, f"attn.{name}_bias")] = b[j * d:(j + 1) * d]
        w, b = conv1d(read, pre + "attn.c_proj")
        p[layer_key(i, "attn.o")], p[layer_key(i, "attn.o_bias")] = centre(w), centre(b)
        w, b = fold_norm(read(pre + "ln_2.weight"), read(pre + "ln_2.bias"), *conv1d(read, pre + "mlp.c_fc"))
        p[layer_key(i, "mlp.up")], p[layer_key(i, "mlp.up_bias")] = w, b
        w, b = conv1d(read, pre + "mlp.c_proj")
        p[layer_key(i, "mlp.down")], p[layer_key(i, "mlp.down_bias")] = centre(w), centre(b)
        return p

    def outside_from_canonical(self, p, config, spec):
        return {"transformer.wte.weight": p["embed.tok"], "transformer.wpe.weight": p["embed.pos"],
                "transformer.ln_f.weight": filled(p["head.weight"], spec.d_model, 1.0),
                "transformer.ln_f.bias": p["final_norm.bias"], "lm_head.weight": p["head.weight"].T}

    def layer_from_canonical(self, p, config, spec, i):
        pre = f"transformer.h.{i}."
        lk = lambda name: p[layer_key(i, name)]
        sd = {pre + "attn.c_attn.weight": torch.cat([lk(f"attn.{n}") for n in "qkv"], dim=1),
              pre + "attn.c_attn.bias": torch.cat([lk(f"attn.{n}_bias") for n in "qkv"]),
              pre + "attn.c_proj.weight": lk("attn.o"), pre + "attn.c_proj.bias": lk("attn.o_bias"),
              pre + "mlp.c_fc.weight": lk("mlp.up"), pre + "mlp.c_fc.bias": lk("mlp.up_bias"),
              pre + "mlp.c_proj.weight": lk("mlp.down"), pre + "mlp.c_proj.bias": lk("mlp.down_bias")}
        for norm in ("ln_1", "ln_2"):
            sd[pre + norm + ".weight"] = filled(lk("attn.o_bias"), spec.d_model, 1.0)
            sd[pre + norm + ".bias"] = filled(lk("attn.o_bias"), spec.d_model, 0.0)
        return sd

    def export_config_changes(self, graph, config) -> dict:
        return {**super().export_config_changes(graph, config), "tie_word_embeddings": False}
