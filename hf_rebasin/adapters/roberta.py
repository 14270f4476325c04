"""RoBERTa with its masked-LM head (``RobertaForMaskedLM``): BERT's post-LN encoder and group (adapters/bert.py),
with its own names and its position offset.  RoBERTa numbers positions from padding_idx + 1 (pad_token_id), skipping
pad tokens, which take the row padding_idx: that only chooses which rows of the position table are read, and every
row is a residual write, so the table moves with the residual permutation like any embedding; the longest input is
max_position_embeddings - padding_idx - 1 tokens."""
from __future__ import annotations

from .base import register
from .bert import BertForMaskedLM


@register
class RobertaForMaskedLM(BertForMaskedLM):
    architecture = "RobertaForMaskedLM"
    base = "roberta."
    modules = {"block": "roberta.encoder.layer.{i}", "attn_out": "roberta.encoder.layer.{i}.attention.output.dense",
               "ffn_hidden": "roberta.encoder.layer.{i}.output.dense", "final": "lm_head.dense"}
    head_names = ("lm_head.dense", "lm_head.layer_norm", "lm_head.decoder", "lm_head.bias")
    tiny = {"roberta": dict(BertForMaskedLM.tiny_base, max_position_embeddings=66, pad_token_id=1, bos_token_id=0,
                            eos_token_id=2, type_vocab_size=1)}

    def config_class(self):
        import transformers
        return transformers.RobertaConfig

    def context_length(self, config) -> int:
        return config.max_position_embeddings - config.pad_token_id - 1

    def extra_notes(self, config) -> tuple[str, ...]:
        return (f"position ids start at padding_idx + 1 = {config.pad_token_id + 1} and skip pad tokens (RoBERTa's "
                "offset): rows of the position table, residual writes like every row",)
