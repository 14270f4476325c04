"""Gemma (``GemmaForCausalLM``): the LLaMA layout with three changes, none of which shrinks the group.

* RMSNorm multiplies by (1 + w): the gain 1 + w is absorbed into the readers as LLaMA's w is, and the export
  stores w = 0 (a gain of 1).
* The token embeddings are multiplied by sqrt(hidden_size) in the forward (a buffer cast to the weights' dtype
  before the product).  The canonical embedding is the stored one times that factor, as the class computes it in
  the checkpoint's dtype; the export divides by it.  A scalar commutes with every residual map.  The tied
  unembedding reads the stored (unscaled) matrix, so the two are untied in the export.
* GeGLU: down(gelu_tanh(gate) * up).  The GLU scales multiply ``up`` by s and the rows of ``down`` by 1/s and
  never touch ``gate``, so they are exact whatever the gate's activation (sign flips included).
head_dim is given by the config (often not hidden_size / heads); MQA (one KV head) is the small sizes' layout."""
from __future__ import annotations

import torch

from .base import register
from .llama import Llama


def stored_dtype(config) -> torch.dtype:
    """The dtype the checkpoint's weights are stored in (the dtype the class runs in when loaded as stored)."""
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


@register
class Gemma(Llama):
    architecture = "GemmaForCausalLM"
    unit_gain = 0.0  # GemmaRMSNorm multiplies by 1 + w
    norm_note = "RMSNorm gains 1 + w absorbed into the next linear layers; RMSNorms exported with w = 0 (gain 1)"
    tiny = {
        "gemma_mqa": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                          num_hidden_layers=2, intermediate_size=48, vocab_size=97, max_position_embeddings=64,
                          tie_word_embeddings=True),
    }

    def gain(self, read, key: str):
        return 1.0 + read(key)

    def embed_scale(self, config) -> float:
        """sqrt(hidden_size) rounded to the dtype the class multiplies in (as its forward does)."""
        return float(torch.tensor(config.hidden_size ** 0.5).to(stored_dtype(config)))

    def notes(self, config):
        return (f"token embeddings times sqrt(hidden_size) = {self.embed_scale(config):g} in the canonical graph (a "
                "scalar: it commutes with every residual map); the export stores them divided by it",
                "GeGLU: the GLU scales act on up and down only, exact for the gelu gate")

    def tiny_config(self, variant: str):
        from transformers import GemmaConfig
        return GemmaConfig(**self.tiny[variant])
