"""Models whose decoder layers get their weights when the forward reaches them.

`swap_layers` replaces every decoder layer of a built model (the module at the adapter's ``modules["block"]``)
by an `OnDemandLayer`: when called, it asks for the layer's state dict and runs the original layer with it
through ``torch.func.functional_call``.  The rest of the model (embeddings, final norm, head) keeps ordinary
weights.  Two users:

* path evaluation of a model too large to hold in fp32 (evaluation.py): each layer of the interpolated model is
  computed from the aligned models, one layer at a time, as the forward reaches it;
* learned matching layer by layer (match/layered.py: gradient checkpointing and FSDP).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..errors import UserError


class OnDemandLayer(nn.Module):
    """Decoder layer i of a model, its weights supplied by `state()` on every call (the original layer module is
    kept for its code and buffers, not as a submodule: it stays in the mode it had when swapped, eval for both
    users, whatever train() is called on the model)."""

    checkpointing = False  # recompute the layer (weights included) in the backward

    def __init__(self, i: int, block: nn.Module, prefix: str):
        super().__init__()
        self.i, self.prefix = i, prefix
        self.__dict__["block"] = block

    def state(self) -> dict[str, Tensor]:
        """The layer's state dict, keyed as in the whole model (adapter.layer_from_canonical)."""
        raise NotImplementedError

    def local_state(self, device) -> dict[str, Tensor]:
        state = self.state()
        stray = [k for k in state if not k.startswith(self.prefix)]
        if stray:
            raise UserError(f"layer {self.i} converts to keys outside its module {self.prefix!r} "
                            f"({', '.join(stray[:3])}): the adapter's modules['block'] must name the module that "
                            "holds every key layer_from_canonical returns")
        return {k[len(self.prefix):]: v.to(device) for k, v in state.items()}

    def forward(self, *args, **kwargs):
        from torch.func import functional_call
        device = next((a.device for a in args if isinstance(a, Tensor)), None)

        def run(*inputs):
            return functional_call(self.block, self.local_state(device), inputs, kwargs, strict=True)

        if self.checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
        return run(*args)

    def __getattr__(self, name: str):
        """Attributes the model's forward reads from its layers (e.g. `attention_type`) come from the block."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__.get("block")
            if block is None:
                raise
            return getattr(block, name)


def swap_layers(model: nn.Module, adapter, n_layers: int,
                make: Callable[[int, nn.Module, str], OnDemandLayer]) -> list[OnDemandLayer]:
    """Replace decoder layer i of `model` by make(i, the layer module, its key prefix "path.to.layer.i.")."""
    layers = []
    for i in range(n_layers):
        path = adapter.modules["block"].format(i=i)
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        layer = make(i, parent.get_submodule(name), path + ".")
        parent._modules[name] = layer
        layers.append(layer)
    return layers


def norm_modules(adapter, model: nn.Module, layers: list[OnDemandLayer]) -> list[tuple[nn.Module, str]]:
    """The adapter's norm (module, eps attribute) pairs of a model whose layers were swapped."""
    return adapter.norm_modules(model) + [pair for layer in layers for pair in adapter.norm_modules(layer.block)]


class GraphLayer(OnDemandLayer):
    """Layer i of whatever canonical graph `holder.graph` is when the forward reaches it (computed then).

    With `holder.stage` set (a `Stage`), the model is driven one layer at a time over many batches
    (evaluation.py): layers before `stage.layer` return what the stage carries for the batch (the output of the
    layer before, computed by an earlier forward), layer `stage.layer` runs on the weights the stage holds,
    stores its output and stops the forward; with stage.layer = the number of layers, every layer returns the
    carried output and the forward goes on to the final norm and head."""

    def __init__(self, i: int, block: nn.Module, prefix: str, holder, template):
        super().__init__(i, block, prefix)
        self.__dict__["holder"] = holder
        self.__dict__["template"] = template

    def state(self) -> dict[str, Tensor]:
        graph, template = self.holder.graph, self.template
        return template.adapter.layer_from_canonical(graph.layer(self.i), template.config, graph.spec, self.i)

    def forward(self, *args, **kwargs):
        stage = getattr(self.holder, "stage", None)
        if stage is None:
            return super().forward(*args, **kwargs)
        if self.i < stage.layer:
            return stage.carried[stage.batch]
        from torch.func import functional_call
        stage.carried[stage.batch] = functional_call(self.block, stage.weights, args, kwargs, strict=True)
        raise StopForward


class StopForward(Exception):
    """Raised by the layer a `Stage` runs, once its output is stored: the rest of the forward is not needed."""


class Stage:
    """Which layer the forward of `batch` runs (`weights`: its local state dict), and the output of the last layer
    run for every batch."""

    def __init__(self):
        self.layer, self.batch, self.weights, self.carried = 0, 0, None, {}


__all__ = ["GraphLayer", "OnDemandLayer", "Stage", "StopForward", "norm_modules", "swap_layers"]
