"""timm ``VisionTransformerDistilled`` (DeiT ``deit_*_distilled_*``): a VisionTransformer with a second
prefix token (``dist_token``) and a second classifier (``head_dist``) reading it; in eval mode the output
is the mean of the two heads' logits.

Its own adapter, not a VisionTransformer variant, because it is its own class: timm builds it from the
model name (the checkpoint's ``architecture``), its state dict has two more tensors, and its forward
differs (both prefix tokens concatenated before the position embedding is added, never the register
tokens; the head skips ``fc_norm``).  The symmetry group is the VisionTransformer one: the distillation
token is one more residual write (W -> W G), ``head_dist`` one more read after the final norm, held beside
``head`` in the canonical head (head.weight is (d, 2 * classes): columns of head, then of head_dist)."""
from __future__ import annotations

import dataclasses

from ..core.canonical import Spec
from .base import register
from .vit import VisionTransformer

DISTILLED_NOTE = ("distillation token: one more residual write (moves with the residual map); head_dist: one more "
                  "read of the final norm's output, held beside head (canonical head.weight is (d, 2 x classes)); "
                  "the output is the mean of the two heads (timm's eval mode)")


@register
class VisionTransformerDistilled(VisionTransformer):
    architecture = "VisionTransformerDistilled"
    tiny = {"deit_distilled": dict(VisionTransformer.base, init_values=0.5, qkv_bias=False)}
    timm_name = "deit_tiny_distilled_patch16_224"
    heads = ("head", "head_dist")

    def spec(self, model) -> Spec:
        spec = super().spec(model)
        return dataclasses.replace(spec, notes=spec.notes + (DISTILLED_NOTE,))
