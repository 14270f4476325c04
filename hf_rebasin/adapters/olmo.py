"""OLMo-1 (``OlmoForCausalLM``): parameter-free LayerNorm (eps fixed at 1e-5 in the class), SwiGLU,
RoPE, optional ``clip_qkv``.  The LayerNorms mean the stream must stay centred (G·1 = ±1), and
with ``clip_qkv`` the clamp on q, k, v rules out the per-head QK/OV maps."""
from __future__ import annotations

from ..canonical import Graph
from . import llama
from .base import Adapter


def spec(config):
    clipped = config.clip_qkv is not None
    notes = ["OLMo's LayerNorm has no parameters: nothing is absorbed, the residual writes are centred"]
    if clipped:
        notes.append(f"clip_qkv={config.clip_qkv}: per-head QK/OV maps are not symmetries and are not used")
    if config.tie_word_embeddings:
        notes.append("tied embeddings kept as two tensors in the export (tie_word_embeddings=False): "
                     "the residual rotation acts on them as a write and a read")
    return llama.spec(config, architecture="OlmoForCausalLM", centred=True, head_maps=not clipped,
                      scale_exact=False, notes=tuple(notes))


def to_canonical(state_dict, config) -> Graph:
    graph = llama.llama_like_to_canonical(state_dict, config, spec(config), norm_gains=False, centred=True)
    return graph.replace(norm_eps=1e-5)


def from_canonical(graph: Graph, config):
    return llama.llama_like_from_canonical(graph, norm_gains=False), {"tie_word_embeddings": False}


ADAPTER = Adapter("OlmoForCausalLM", "transformers", spec, to_canonical, from_canonical,
                  modules=llama.LLAMA_MODULES)
