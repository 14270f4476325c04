"""The loss on the path, layer by layer: what ``--gradient-checkpointing`` and ``--fsdp`` run.

learned.PathLoss builds the whole transformed, interpolated state dict before the forward.  Here each
decoder layer of the model is replaced by a `LayerPoint` that holds that layer's frozen canonical tensors of
every endpoint and, when the model's forward reaches it, computes the layer's weights at the current point
(group elements applied, interpolated, converted with the adapter's ``layer_from_canonical``) and runs the
layer with them (``functional_call``).  Same function, same loss and gradients as PathLoss (tested), with
two things PathLoss cannot do:

* **gradient checkpointing**: a layer's weights and activations are recomputed in the backward
  (``torch.utils.checkpoint``, non-reentrant), so a step keeps one layer's transformed weights and the
  residual stream between layers, not every transformed layer and its activations;
* **FSDP**: every LayerPoint (and the root, with the tensors outside the layers) is sharded with torch's
  ``fully_shard`` over all processes, so each process stores 1/N of the frozen endpoints; FSDP gathers a
  layer's tensors just before the layer runs (again before its backward) and frees them after.  The symmetry
  parameters are small and replicated (``ignored_params``): their gradients are averaged over the processes
  after the backward (``sync_gradients``, one all-reduce of them all), exactly what DDP does for PathLoss.

The group elements themselves are computed once per forward at the root, in fp32, and shared by the layers.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor, nn

from ..core.canonical import Graph
from ..sources.layerwise import OnDemandLayer, norm_modules, swap_layers
from .action import Action, combine, layer_share, outside_share
from .blocks import from_recipe, tiled_bases, view_recipe
from .params import SymmetryParams
from .path import PathOfEnds, stored, strip_parameters


class FrozenTensors(nn.Module):
    """A dict of frozen tensors held as parameters (so that FSDP shards them); names keep their dots.  Views that tile
    a block (blocks.py: a layer's reads, its writes) are held as the block and given back as views of it."""

    def __init__(self, tensors: dict[str, Tensor]):
        super().__init__()
        self.names, self.recipes, held = list(tensors), [], {}
        blocks = tiled_bases(tensors)
        for value in tensors.values():
            whole = id(value._base) in blocks
            source = value._base if whole else value
            if id(source) not in held:
                held[id(source)] = len(held)
                # FSDP shards only contiguous tensors (a fused QKV split per head is a strided view)
                self.register_parameter(f"t{held[id(source)]}", nn.Parameter(source.contiguous(), requires_grad=False))
            self.recipes.append((held[id(source)], view_recipe(value) if whole else None))

    def tensors(self) -> dict[str, Tensor]:
        out = {}
        for name, (j, recipe) in zip(self.names, self.recipes):
            held = getattr(self, f"t{j}")
            out[name] = held if recipe is None else from_recipe(held, recipe)
        return out


class LayerPoint(OnDemandLayer):
    """Decoder layer i at the current point of the path: the endpoints' canonical tensors of layer i (one
    FrozenTensors per endpoint, what FSDP shards) turned into the layer's weights when the forward reaches it."""

    def __init__(self, owner: LayeredPathLoss, i: int, block: nn.Module, prefix: str, ends: list[dict[str, Tensor]]):
        super().__init__(i, block, prefix)
        self.ends = nn.ModuleList(FrozenTensors(p) for p in ends)
        self.__dict__["owner"] = owner

    @property
    def checkpointing(self) -> bool:
        return self.owner.checkpointing

    def state(self) -> dict[str, Tensor]:
        owner = self.owner
        actions = owner.actions()
        shares = [layer_share(frozen.tensors(), self.i, owner.spec, actions[k]) if k in actions
                  else ({}, frozen.tensors()) for k, frozen in zip(owner.keys, self.ends)]
        point = combine(shares, owner.current_weights, owner.write_factor)
        return owner.adapter.layer_from_canonical(point, owner.config, owner.spec, self.i)


class LayeredPathLoss(PathOfEnds):
    """Task loss at sum_i w_i t_i(theta_i), the same function as learned.PathLoss, computed layer by layer
    (module docstring).  With `mesh` the frozen endpoints are sharded with FSDP over its processes."""

    manual_sync = True  # the training loop averages the symmetry parameters' gradients (`sync_gradients`)

    def __init__(self, graphs: list[Graph], ends: dict[str, SymmetryParams], template, task: str,
                 autocast_dtype: torch.dtype | None = None, *, checkpointing: bool = False, mesh=None):
        """graphs may be lazy: they are read one layer at a time.  With a device `mesh` (FSDP), each layer is
        sharded as soon as it is built, so a process never holds more than its shards and one whole layer."""
        super().__init__(ends, len(graphs))
        from ..sources.models import build
        adapter, first = template.adapter, graphs[0]
        self.keys = [str(k) for k in range(len(graphs))]
        self.spec, self.adapter = first.spec, adapter
        self.__dict__["config"] = template.config  # timm's "config" is a model: never a submodule here
        self.__dict__["tied"] = adapter.tied_names(template.config)
        self.task, self.autocast_dtype, self.checkpointing = task, autocast_dtype, checkpointing
        self.norm_eps = [g.norm_eps for g in graphs]
        # built on the meta device (no copy of the weights), placeholders on the CPU (movable), eval mode
        model = strip_parameters(build(first, template), device="cpu").eval()
        self.outside = nn.ModuleList(
            FrozenTensors(stored(Graph(g.spec, g.outside(), g.norm_eps), autocast_dtype).params) for g in graphs)
        self.model_parameters = sum(p.numel() for p in self.outside[0].parameters())

        def make(i, block, prefix):
            ends_i = [stored(Graph(g.spec, g.layer(i), g.norm_eps), autocast_dtype).params for g in graphs]
            layer = LayerPoint(self, i, block, prefix, ends_i)
            self.model_parameters += sum(p.numel() for p in layer.ends[0].parameters())
            if mesh is not None:
                from torch.distributed.fsdp import fully_shard
                block.to(mesh.device_type)
                fully_shard(layer, mesh=mesh)
            return layer

        self.layers = nn.ModuleList(swap_layers(model, adapter, first.spec.n_layers, make))
        self.__dict__["model"] = model  # not a submodule: its own weights are placeholders
        self.__dict__["norms"] = norm_modules(adapter, model, list(self.layers)) if first.spec.scale_exact else []
        self.elements, self.current_weights, self.sharded = {}, [], mesh is not None
        self.write_factor = None
        self._actions = None, {}  # (the elements they are of, the actions)
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard
            model.to(mesh.device_type)
            fully_shard(self, mesh=mesh, reshard_after_forward=True, ignored_params=set(self.ends.parameters()))
            self.ends.to(mesh.device_type)

    def to_device(self, device) -> LayeredPathLoss:
        self.to(device)
        self.model.to(device)  # buffers (rotary tables, masks)
        for layer in self.layers:
            layer.block.to(device)
        return self

    def sync_gradients(self, world: int) -> None:
        """Average the symmetry parameters' gradients over the processes (what DDP does for PathLoss), in one
        collective: all of them flattened into one buffer."""
        grads = [p.grad for p in self.ends.parameters() if p.grad is not None]
        if world == 1 or not grads:
            return
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        bucket = _flatten_dense_tensors(grads)
        dist.all_reduce(bucket)
        bucket /= world
        for grad, averaged in zip(grads, _unflatten_dense_tensors(bucket, grads)):
            grad.copy_(averaged)

    def stored_bytes(self) -> tuple[int, int]:
        """(bytes of frozen endpoint tensors this process stores, bytes of all of them)."""
        local = total = 0
        for p in [*self.outside.parameters(), *self.layers.parameters()]:
            shard = p.to_local() if hasattr(p, "to_local") else p
            local += shard.numel() * shard.element_size()
            total += p.numel() * p.element_size()
        return local, total

    # --- the forward --------------------------------------------------------------------------------
    def _outside_state(self, rows: Tensor | None) -> dict[str, Tensor]:
        """The model's state dict outside the layers at the current point.  With `rows`, only those token-embedding
        rows are transformed and interpolated (PathLoss.point)."""
        key = f"embed.{self.spec.token_embedding}"
        parts = [frozen.tensors() for frozen in self.outside]
        first_embedding = parts[0].get(key)
        if rows is not None:
            parts = [{**p, key: p[key][rows]} for p in parts]
        actions = self.actions()
        shares = [outside_share(p, actions[k]) if k in actions else ({}, p) for k, p in zip(self.keys, parts)]
        point = combine(shares, self.current_weights, self.write_factor)
        if rows is not None:
            point[key] = first_embedding.index_put((rows,), point[key].to(first_embedding.dtype))
        return self.adapter.outside_from_canonical(point, self.config, self.spec)

    def logits(self, inputs: Tensor, lam, rows: Tensor | None) -> Tensor:
        """The predictions at λ on the batch; the backward's recomputation reads the point's weights and elements
        set here, so the differentiated call is the last one of a step (PathOfEnds.forward)."""
        self.current_weights = self.weights(lam)
        self.elements = self.current_elements(inputs.device.type)
        eps, self.write_factor = self.eps_and_write_factor(self.elements, self.norm_eps, self.current_weights)
        self.actions()  # made here, outside every checkpointed layer: the layers and their recomputation share them
        return self._run(inputs, eps, rows if self.sparse else None)

    def actions(self) -> dict[str, Action]:
        """The action of each end's current element at the current weights (action.Action), made once per element."""
        if self._actions[0] is not self.elements:
            weights = dict(zip(self.keys, self.current_weights))
            self._actions = self.elements, {
                k: Action.of(t, weights[k], self.write_factor, self.spec, self.autocast_dtype)
                for k, t in self.elements.items() if weights[k] != 0.0}
        return self._actions[1]

    def endpoint_logits(self, inputs: Tensor, k: int, rows: Tensor | None) -> Tensor:
        """Endpoint k's predictions: its frozen tensors run as they are (PathOfEnds.endpoint_logits), no group
        element.  (Called without gradient before the step's own `logits`, which sets what the backward reads.)"""
        self.current_weights, self.elements, self.write_factor = list(self.vertices[k]), {}, None
        return self._run(inputs, self.norm_eps[k], None)

    def _run(self, inputs: Tensor, eps: float, rows: Tensor | None) -> Tensor:
        device_type = inputs.device.type
        autocast = torch.autocast(device_type, dtype=self.autocast_dtype) if self.autocast_dtype else nullcontext()
        with autocast:
            state = self._outside_state(rows)
            for module, attr in self.norms:
                setattr(module, attr, eps)
            return self.run_model(state, inputs)


__all__ = ["LayeredPathLoss", "LayerPoint"]
