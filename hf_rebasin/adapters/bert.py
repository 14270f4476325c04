"""BERT encoders with their masked-LM head (``BertForMaskedLM``; ``BertForPreTraining``, MultiBERTs' class, with the
next-sentence head beside it): post-LN blocks, absolute position and token-type embeddings, an MLM head whose
decoder is tied to the word embeddings (docs/design.md §9).

Post-LN: each block computes x' = LN(x + f(x)), a LayerNorm with gain and bias ON the residual stream.  No linear
layer follows its gain on every path (the stream itself is added into the next sum), so nothing can be folded and
the canonical graph keeps every LayerNorm as it is (``pre_norm.*`` for the embeddings' LayerNorm,
``layers.i.attn.stream_norm*`` and ``layers.i.mlp.stream_norm*`` after the two residual adds).  A map G of the
stream must pass each of them: LN(z G)·diag(γ') + β' = (LN(z)·diag(γ) + β) G for every z, which for gains that are
not all equal holds only for G = ±P, P a permutation, γ' = γP, β' = βG (the residual group of timm's norm_pre).
The residual scale is not used: the MLM head's LayerNorm reads a GELU output that g cannot scale, with the
config's one eps.  Writes (embeddings, attention output, FFN down) and reads (q, k, v, FFN up, the head's dense
layer) move as everywhere; nothing is centred (the stream after a LayerNorm with a bias is not).

MLM head: u = gelu(x W + b), y = LN(u)·diag(γ) + β, logits = y Eᵀ + c with E the word embeddings (tied).  The tied
decoder makes the head's output space the stream's basis: E → E G needs y → y G, i.e. u → u P (GELU passes a
permutation, not a sign), so W → Gᵀ W |G| ("transit"), b → b|G|, γ → γG and β → βG (for G = sP, s γ P: the sign
moves into the gain).  An untied decoder is a read of that space (head.weight, (d, vocab)).

BertForPreTraining: the pooler's dense layer reads the stream at the first token (a read); its tanh output and the
next-sentence classifier are outputs of the model and stay as they are."""
from __future__ import annotations

from ..core.canonical import Spec, layer_key
from ..errors import UnsupportedModelError
from .base import Adapter, linear_in, register

POSITION_REFUSED = ("position_embedding_type={kind!r}: relative position embeddings are dotted with each head's "
                    "queries and keys, so the per-head QK maps are no symmetry there; only 'absolute' is adapted")


@register
class BertForMaskedLM(Adapter):
    architecture = "BertForMaskedLM"
    task = "masked-lm"
    base = "bert."
    ignored_suffixes = ("position_ids", "token_type_ids")
    kept_gains = ("LayerNorm.weight", "layer_norm.weight")  # every LayerNorm acts on the stream (or the tied space)
    modules = {"block": "bert.encoder.layer.{i}", "attn_out": "bert.encoder.layer.{i}.attention.output.dense",
               "ffn_hidden": "bert.encoder.layer.{i}.output.dense", "final": "cls.predictions.transform"}
    # head parameter names: (dense, LayerNorm, decoder, bias of the prediction head)
    head_names = ("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm", "cls.predictions.decoder",
                  "cls.predictions.bias")
    tiny_base = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=97,
                     max_position_embeddings=64)
    tiny = {"bert": dict(tiny_base, type_vocab_size=2)}

    def config_class(self):
        import transformers
        return transformers.BertConfig

    def tiny_config(self, variant: str):
        return self.config_class()(**self.tiny[variant])

    def check(self, config) -> None:
        kind = getattr(config, "position_embedding_type", None) or "absolute"
        if kind != "absolute":
            raise UnsupportedModelError(f"{self.architecture}: " + POSITION_REFUSED.format(kind=kind))
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise UnsupportedModelError(f"{self.architecture}: is_decoder / add_cross_attention (a causal or "
                                        "cross-attending BERT) is not adapted; only the bidirectional encoder is")

    def spec(self, config) -> Spec:
        self.check(config)
        d, h = config.hidden_size, config.num_attention_heads
        embeddings = ("tok", "pos", "type")
        notes = ("post-LN: every LayerNorm acts on the residual stream itself (the embeddings' and the two after each "
                 "residual add), so no gain can be absorbed and the residual group is the permutations of the "
                 f"{d} coordinates (times one sign); all LayerNorms are exported with their gains and biases "
                 "(permuted)",
                 "MLM head: the decoder is " + ("tied to the word embeddings, so the head's dense output and its "
                                                 "LayerNorm move with the residual permutation (tie kept in the export)"
                                                 if config.tie_word_embeddings else
                                                 "untied: a read of the head's output space, which moves with the "
                                                 "residual permutation"),
                 "token-type and position embeddings are residual writes")
        return Spec(
            architecture=self.architecture, d_model=d, n_layers=config.num_hidden_layers, n_heads=h, n_kv_heads=h,
            head_dim=d // h, ffn_dim=config.intermediate_size, n_out=config.vocab_size, glu=False, rotary_dims=0,
            centred=True, scale_exact=False, residual="signed_permutation", embeddings=embeddings,
            token_embedding="tok", notes=notes + self.extra_notes(config))

    def extra_notes(self, config) -> tuple[str, ...]:
        return ()

    def tied_names(self, config) -> dict[str, str]:
        _dense, _norm, decoder, bias = self.head_names
        if not config.tie_word_embeddings:
            return {}
        return {decoder + ".weight": self.base + "embeddings.word_embeddings.weight", decoder + ".bias": bias}

    def refused(self, config) -> list[str]:
        return ["relative position embeddings (position_embedding_type relative_key / relative_key_query): dotted "
                "with each head's queries, so the per-head QK maps are no symmetry there",
                "is_decoder / add_cross_attention: only the bidirectional encoder is adapted",
                "the bare encoder (BertModel / RobertaModel): its output is the residual stream itself, which every "
                "residual permutation moves; merge it with its masked-LM head",
                "`self` training or matching data: a masked LM does not generate text left to right to sample from",
                "`eval` (lm-eval zero-shot): it scores a causal LM's log-likelihood of continuations; masked LMs are "
                "scored by the masked-LM loss and accuracy in barrier.json",
                "models of different widths: the residual group is permutations (post-LN), with no width embedding"]

    def config_facts(self, config) -> dict:
        return {"hidden_act": config.hidden_act, "max_position_embeddings": config.max_position_embeddings,
                "type_vocab_size": config.type_vocab_size, "pad_token_id": config.pad_token_id,
                "position_embedding_type": getattr(config, "position_embedding_type", None) or "absolute",
                "tie_word_embeddings": bool(config.tie_word_embeddings)}

    def norm_eps(self, config) -> float:
        return float(config.layer_norm_eps)

    def context_length(self, config) -> int:
        return config.max_position_embeddings

    # --- outside the layers ------------------------------------------------------------------------
    def embeddings(self, read) -> dict:
        e = self.base + "embeddings."
        return {"embed.tok": read(e + "word_embeddings.weight"), "embed.pos": read(e + "position_embeddings.weight"),
                "embed.type": read(e + "token_type_embeddings.weight"),
                "pre_norm.weight": read(e + "LayerNorm.weight"), "pre_norm.bias": read(e + "LayerNorm.bias")}

    def outside_to_canonical(self, read, config, spec):
        dense, norm, decoder, bias = self.head_names
        p = self.embeddings(read)
        w, b = linear_in(read, dense)
        p["head.transform"], p["head.transform_bias"] = w, b
        p["head.norm.weight"], p["head.norm.bias"] = read(norm + ".weight"), read(norm + ".bias")
        if config.tie_word_embeddings:
            read.tied(self.base + "embeddings.word_embeddings.weight", decoder + ".weight")
            p["head.bias"] = read.tied(bias, decoder + ".bias")
        else:
            p["head.weight"], p["head.bias"] = read(decoder + ".weight").T, read(decoder + ".bias")
            p["head.unused_bias"] = read(bias)  # the class keeps it, its untied forward never adds it
        p.update(self.extra_outside(read))
        return p

    def extra_outside(self, read) -> dict:
        return {}

    def outside_from_canonical(self, p, config, spec):
        dense, norm, decoder, bias = self.head_names
        e = self.base + "embeddings."
        sd = {e + "word_embeddings.weight": p["embed.tok"], e + "position_embeddings.weight": p["embed.pos"],
              e + "token_type_embeddings.weight": p["embed.type"], e + "LayerNorm.weight": p["pre_norm.weight"],
              e + "LayerNorm.bias": p["pre_norm.bias"], dense + ".weight": p["head.transform"].T,
              dense + ".bias": p["head.transform_bias"], norm + ".weight": p["head.norm.weight"],
              norm + ".bias": p["head.norm.bias"]}
        if config.tie_word_embeddings:  # the class ties decoder.weight / decoder.bias to these (fill ties them)
            sd[bias] = p["head.bias"]
        else:
            sd.update({decoder + ".weight": p["head.weight"].T, decoder + ".bias": p["head.bias"],
                       bias: p["head.unused_bias"]})
        sd.update(self.extra_from_canonical(p))
        return sd

    def extra_from_canonical(self, p) -> dict:
        return {}

    # --- layers ------------------------------------------------------------------------------------
    def layer_to_canonical(self, read, config, spec, i):
        pre, p = f"{self.base}encoder.layer.{i}.", {}
        key = lambda name: layer_key(i, name)
        for name, module in (("q", "query"), ("k", "key"), ("v", "value")):
            p[key(f"attn.{name}")], p[key(f"attn.{name}_bias")] = linear_in(read, pre + "attention.self." + module)
        p[key("attn.o")], p[key("attn.o_bias")] = linear_in(read, pre + "attention.output.dense")
        p[key("attn.stream_norm")] = read(pre + "attention.output.LayerNorm.weight")
        p[key("attn.stream_norm_bias")] = read(pre + "attention.output.LayerNorm.bias")
        p[key("mlp.up")], p[key("mlp.up_bias")] = linear_in(read, pre + "intermediate.dense")
        p[key("mlp.down")], p[key("mlp.down_bias")] = linear_in(read, pre + "output.dense")
        p[key("mlp.stream_norm")] = read(pre + "output.LayerNorm.weight")
        p[key("mlp.stream_norm_bias")] = read(pre + "output.LayerNorm.bias")
        return p

    def layer_from_canonical(self, p, config, spec, i):
        pre = f"{self.base}encoder.layer.{i}."
        lk = lambda name: p[layer_key(i, name)]
        sd = {}
        for name, module in (("q", "query"), ("k", "key"), ("v", "value"), ("o", None)):
            target = pre + ("attention.self." + module if module else "attention.output.dense")
            sd[target + ".weight"], sd[target + ".bias"] = lk(f"attn.{name}").T, lk(f"attn.{name}_bias")
        sd.update({pre + "attention.output.LayerNorm.weight": lk("attn.stream_norm"),
                   pre + "attention.output.LayerNorm.bias": lk("attn.stream_norm_bias"),
                   pre + "intermediate.dense.weight": lk("mlp.up").T,
                   pre + "intermediate.dense.bias": lk("mlp.up_bias"),
                   pre + "output.dense.weight": lk("mlp.down").T, pre + "output.dense.bias": lk("mlp.down_bias"),
                   pre + "output.LayerNorm.weight": lk("mlp.stream_norm"),
                   pre + "output.LayerNorm.bias": lk("mlp.stream_norm_bias")})
        return sd

    def export_config_changes(self, graph, config) -> dict:
        return {}


@register
class BertForPreTraining(BertForMaskedLM):
    """MultiBERTs' class: the MLM head, and the pooler (a read of the stream at the first token) with the
    next-sentence classifier after its tanh (outputs of the model: they stay as they are)."""
    architecture = "BertForPreTraining"
    # untied decoder (a read of the head's space), three token types, another GELU
    tiny = {"bert_pretraining": dict(BertForMaskedLM.tiny_base, type_vocab_size=3, tie_word_embeddings=False,
                                     hidden_act="gelu_new")}

    def extra_notes(self, config) -> tuple[str, ...]:
        return ("pooler: its dense layer reads the stream (moves with the residual permutation); its tanh output and "
                "the next-sentence classifier are outputs of the model and stay as they are",)

    def extra_outside(self, read) -> dict:
        w, b = linear_in(read, "bert.pooler.dense")
        nsp_w, nsp_b = linear_in(read, "cls.seq_relationship")
        return {"head.pooler": w, "head.pooler_bias": b, "head.nsp": nsp_w, "head.nsp_bias": nsp_b}

    def extra_from_canonical(self, p) -> dict:
        return {"bert.pooler.dense.weight": p["head.pooler"].T, "bert.pooler.dense.bias": p["head.pooler_bias"],
                "cls.seq_relationship.weight": p["head.nsp"].T, "cls.seq_relationship.bias": p["head.nsp_bias"]}
