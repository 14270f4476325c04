"""The adapter registry: one module per architecture, one line here per adapter."""
from __future__ import annotations

from .base import Adapter, UnsupportedModelError
from . import gpt2, gpt_neox, llama, olmo, vit

REGISTRY: dict[str, Adapter] = {a.architecture: a for a in (
    gpt_neox.ADAPTER,
    llama.ADAPTER,
    olmo.ADAPTER,
    gpt2.ADAPTER,
    vit.ADAPTER,
)}

# Classes users will try, with the reason no exact alignment exists for them.
UNSUPPORTED: dict[str, str] = {
    "Olmo2ForCausalLM": "OLMo-2 normalises q and k with RMSNorm over all heads at once (QK-norm) and "
                        "puts its norms after attention/FFN (post-norm), on the residual path itself; "
                        "neither commutes with the residual rotation or the per-head maps",
    "Olmo3ForCausalLM": "OLMo-3 uses QK-norm and post-norm like OLMo-2",
    "GemmaForCausalLM": "Gemma scales the embeddings by sqrt(d) and adds 1 to its RMSNorm gains; not yet adapted",
    "Qwen3ForCausalLM": "Qwen3 applies per-head RMSNorm to q and k (QK-norm), which breaks the QK maps",
}


def get_adapter(architecture: str) -> Adapter:
    if architecture in REGISTRY:
        return REGISTRY[architecture]
    why = UNSUPPORTED.get(architecture)
    supported = ", ".join(sorted(REGISTRY))
    raise UnsupportedModelError(
        f"{architecture} is not supported" + (f": {why}." if why else ".") + f" Supported classes: {supported}.")


__all__ = ["Adapter", "REGISTRY", "UNSUPPORTED", "UnsupportedModelError", "get_adapter"]
