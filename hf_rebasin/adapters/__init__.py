"""The adapter registry.  Every module in this folder is imported here, and its adapter classes register
themselves with ``@register``: adding an architecture is adding one file."""
from __future__ import annotations

import importlib
import pkgutil

from ..errors import UnsupportedModelError
from .base import REGISTRY, Adapter, StateReader, register


def discover() -> None:
    """Import every module of this package (each registers its adapters); modules already imported are kept."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")


discover()

# Classes users will try, with the reason no exact alignment exists for them.
_BARE = ("{name} has no masked-LM head: its output is the residual stream itself, which every residual permutation "
         "moves (so the only exact symmetries left would be inside the layers), and it has no loss to measure a "
         "barrier with. Merge the checkpoint with its head ({head}: the same weights plus the head)")
UNSUPPORTED: dict[str, str] = {
    "Olmo3ForCausalLM": "OLMo-3 uses QK-norm and post-norm like OLMo-2 and sliding-window layers; not yet adapted",
    # mixtures of experts whose routing or layers the MoE adapters (adapters/moe.py) do not compute
    "DeepseekV2ForCausalLM": "grouped top-k routing (n_group/topk_group) and multi-head latent attention; not adapted",
    "DeepseekV3ForCausalLM": "grouped top-k routing with sigmoid scores and a selection bias, and multi-head latent "
                             "attention; not adapted",
    "PhimoeForCausalLM": "SparseMixer routing (its second expert chosen from a masked, jittered score); not adapted",
    "GptOssForCausalLM": "a router with a bias, experts with biases and a clamped SwiGLU, attention sinks; not adapted",
    "JambaForCausalLM": "Mamba layers between the attention layers; not adapted",
    "BertModel": _BARE.format(name="BertModel", head="BertForMaskedLM or BertForPreTraining"),
    "RobertaModel": _BARE.format(name="RobertaModel", head="RobertaForMaskedLM"),
}


def get_adapter(architecture: str) -> Adapter:
    if architecture in REGISTRY:
        return REGISTRY[architecture]
    why = UNSUPPORTED.get(architecture)
    supported = ", ".join(sorted(REGISTRY))
    raise UnsupportedModelError(
        f"{architecture} is not supported" + (f": {why}." if why else ".") + f" Supported classes: {supported}.")


def tiny_variants() -> dict[str, Adapter]:
    """Every tiny test variant of every registered adapter: {variant name: adapter}."""
    return {variant: adapter for adapter in REGISTRY.values() for variant in adapter.tiny}


__all__ = ["Adapter", "REGISTRY", "StateReader", "UNSUPPORTED", "UnsupportedModelError", "discover", "get_adapter",
           "register", "tiny_variants"]
