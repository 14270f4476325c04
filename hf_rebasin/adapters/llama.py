"""LLaMA: RMSNorm with gain, SwiGLU, full RoPE (rotate_half layout), GQA, tied or untied embeddings,
optional attention / MLP biases.  OLMo-1 (olmo.py) shares the layout with parameter-free LayerNorms; Qwen2,
Mistral, Phi-3 and Gemma (their own files) are this layout with a few hooks changed: how a norm's gain is
stored, how the embedding is scaled, how the projections are packed."""
from __future__ import annotations

from ..core.canonical import Spec, centre, fold_norm, layer_key
from .base import Adapter, filled, linear_in, register, rope_facts

PROJECTIONS = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
               "mlp.up": "mlp.up_proj", "mlp.gate": "mlp.gate_proj"}
WRITES = {"attn.o": "self_attn.o_proj", "mlp.down": "mlp.down_proj"}
NORM_BEFORE = {"attn": "input_layernorm", "mlp": "post_attention_layernorm"}


def linears_from_canonical(p: dict, i: int, pre: str, projections: dict = PROJECTIONS, writes: dict = WRITES) -> dict:
    """The q/k/v/o and up/gate/down nn.Linear weights (and biases) of layer i, from canonical row-vector form."""
    sd = {}
    for name, module in {**projections, **writes}.items():
        sd[pre + module + ".weight"] = p[layer_key(i, name)].T
        if layer_key(i, name + "_bias") in p:
            sd[pre + module + ".bias"] = p[layer_key(i, name + "_bias")]
    return sd


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@register
class Llama(Adapter):
    architecture = "LlamaForCausalLM"
    ignored_suffixes = ("rotary_emb.inv_freq",)
    modules = {"block": "model.layers.{i}", "attn_out": "model.layers.{i}.self_attn.o_proj",
               "ffn_hidden": "model.layers.{i}.mlp.down_proj", "final": "model.norm"}
    tiny = {
        "llama_gqa_tied": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                               intermediate_size=48, vocab_size=97, max_position_embeddings=64,
                               tie_word_embeddings=True),
        "llama_untied_bias": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                                  intermediate_size=48, vocab_size=97, max_position_embeddings=64,
                                  tie_word_embeddings=False, attention_bias=True, mlp_bias=True, head_dim=16),
    }
    norm_gains = True  # RMSNorm with a gain (absorbed); False: a parameter-free LayerNorm (OLMo-1)
    unit_gain = 1.0  # the stored norm weight whose gain is 1 (Gemma stores w for a gain of 1 + w)
    norm_note = "RMSNorm gains absorbed into the next linear layers; RMSNorms exported with weight 1"
    reads_partial_rotary = False  # LLaMA's default RoPE turns the whole head, whatever partial_rotary_factor says
    projections, writes = PROJECTIONS, WRITES  # the nn.Linear layers of a layer (a MoE class: attention only)

    def spec(self, config, **overrides) -> Spec:
        rope = rope_facts(config, self.reads_partial_rotary)
        fields = dict(
            architecture=self.architecture, d_model=config.hidden_size, n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim(config), ffn_dim=config.intermediate_size, n_out=config.vocab_size, glu=True,
            rotary_dims=int(head_dim(config) * rope["rotary_fraction"]), rotary_layout="half", centred=False,
            embeddings=("tok",), token_embedding="tok",
            notes=(self.norm_note,)
            + (("embeddings untied in the export (the final norm gain now sits in lm_head): "
                "tie_word_embeddings=False",) if config.tie_word_embeddings else ()) + self.notes(config))
        fields.update(overrides)
        return Spec(**fields)

    def config_facts(self, config) -> dict:
        return {"hidden_act": config.hidden_act, **rope_facts(config, self.reads_partial_rotary),
                "max_position_embeddings": config.max_position_embeddings,
                "attention_bias": bool(getattr(config, "attention_bias", False)),
                "mlp_bias": bool(getattr(config, "mlp_bias", False))}

    def norm_eps(self, config) -> float:
        return float(getattr(config, "rms_norm_eps", 1e-5))

    def eps_config_changes(self, eps: float) -> dict:
        return {"rms_norm_eps": eps}

    def context_length(self, config) -> int:
        return config.max_position_embeddings

    def tiny_config(self, variant: str):
        from transformers import LlamaConfig
        return LlamaConfig(**self.tiny[variant])

    # --- hooks of the LLaMA-like classes -------------------------------------------------------------
    def notes(self, config) -> tuple[str, ...]:
        """The class's own caveats and reasons, for inspect and model cards."""
        return ()

    def gain(self, read, key: str):
        """The gain a norm multiplies by, from its stored weight."""
        return read(key)

    def embed_scale(self, config) -> float:
        """The factor the class multiplies the token embeddings by in its forward (Gemma: sqrt(d))."""
        return 1.0

    def _write(self, w):
        return centre(w) if not self.norm_gains else w

    def outside_to_canonical(self, read, config, spec):
        unembed = (read.tied("model.embed_tokens.weight", "lm_head.weight") if config.tie_word_embeddings
                   else read("lm_head.weight")).T
        head = self.gain(read, "model.norm.weight")[:, None] * unembed if self.norm_gains else unembed
        embed = read("model.embed_tokens.weight") * self.embed_scale(config)
        return {"embed.tok": self._write(embed), "head.weight": head}

    def layer_to_canonical(self, read, config, spec, i):
        pre, p = f"model.layers.{i}.", {}
        for name, module in self.projections.items():
            w, b = linear_in(read, pre + module)
            if self.norm_gains:
                w, b = fold_norm(self.gain(read, pre + NORM_BEFORE[name.split(".")[0]] + ".weight"), None, w, b)
            p[layer_key(i, name)] = w
            if b is not None:
                p[layer_key(i, name + "_bias")] = b
        for name, module in self.writes.items():
            w, b = linear_in(read, pre + module)
            p[layer_key(i, name)] = self._write(w)
            if b is not None:
                p[layer_key(i, name + "_bias")] = self._write(b)
        return p

    def outside_from_canonical(self, p, config, spec):
        sd = {"model.embed_tokens.weight": p["embed.tok"] / self.embed_scale(config),
              "lm_head.weight": p["head.weight"].T}
        if self.norm_gains:
            sd["model.norm.weight"] = filled(p["head.weight"], spec.d_model, self.unit_gain)
        return sd

    def layer_from_canonical(self, p, config, spec, i):
        pre, sd = f"model.layers.{i}.", {}
        sd.update(linears_from_canonical(p, i, pre, self.projections, self.writes))
        if self.norm_gains:
            for norm in NORM_BEFORE.values():
                sd[pre + norm + ".weight"] = filled(p[layer_key(i, "attn.o")], spec.d_model, self.unit_gain)
        return sd

    def export_config_changes(self, graph, config) -> dict:
        return {**super().export_config_changes(graph, config), "tie_word_embeddings": False}
