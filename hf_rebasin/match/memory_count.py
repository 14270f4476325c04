"""The memory of one learned-matching step, counted on the project's own step without allocating it: the reference
that memory_plan.py's estimate is checked against (tests, benchmarks/memory_plan_check.py).

The endpoints are built from a config alone (canonicalised on the meta device), then put on fake CPU tensors
(torch's FakeTensorMode: shapes, dtypes and storages, no data), and the step runs there as `learn` runs it: the
same PathLoss or LayeredPathLoss, bf16 autocast (CPU's autocast: the fake tensors are CPU tensors; the autograd
engine cannot run a backward on fake CUDA tensors without a driver), soft-target passes, forward and backward.
`LiveBytes` sees every tensor the step creates and when its storage is freed (a weak reference to the storage),
so its peak is the step's peak of allocated bytes on top of what was there before it: the frozen endpoints, the
symmetry parameters and AdamW's two moments of them (the steady state after the first step), added here.
"""
from __future__ import annotations

import json
import tempfile
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under the mode and still alive (`now`), and their maximum (`peak`)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output on an input's storage (a view, an in-place op) allocates nothing, even where that storage was
        # made before the mode (the frozen endpoints, counted as held): never counted as the step's
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata  # the storage itself, shared by every view of it
                if key not in self.live and key not in inputs:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out


@contextmanager
def fake_tensors():
    """torch's FakeTensorMode (real tensors accepted as inputs); on the way out, the caches that may have kept a fake
    tensor made under it (linalg.ones_complement) are emptied, so that real work after it never meets one."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from .linalg import ones_complement
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fake tensors warn about data pointers (models.own_tensors reads them)
            yield
    finally:
        ones_complement.cache_clear()


def config_template(config):
    """A sources.models.Loaded for a transformers config alone (no weight files): enough to build the model class
    and canonicalise on the meta device."""
    from ..sources.backends import backend_of
    from ..sources.models import Loaded
    folder = Path(tempfile.mkdtemp(prefix="hf-rebasin-config-"))
    config.save_pretrained(folder)
    hub_config = json.loads((folder / "config.json").read_text())
    backend = backend_of(hub_config)
    adapter, parsed = backend.configure(folder, hub_config)
    return Loaded(str(folder), adapter, backend, parsed, hub_config, folder, None)


def meta_graph(template):
    """The canonical graph of the template's class and config, on the meta device."""
    state = {k: torch.empty(v.shape, dtype=v.dtype, device="meta")
             for k, v in template.backend.build(template, {}).state_dict().items()}
    return template.adapter.to_canonical(state, template.config, template.source)


@dataclass
class StepCount:
    """Bytes of one step: what is held throughout (endpoints, symmetry parameters and AdamW's moments) and the
    step's own peak on top of it."""

    held_bytes: int
    step_peak_bytes: int
    endpoint_bytes: int
    learned_parameters: int
    model_parameters: int

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + self.step_peak_bytes


def count_step(template, *, batch: int, seq: int, method: str = "dual", precision: str = "bf16",
               checkpointing: bool = False, soft_targets: float = 1.0, n_models: int = 2) -> StepCount:
    """Count one training step (forward with its soft-target passes, backward) of `method` on `n_models` copies of the
    template's config, `batch` windows of `seq` tokens (LMs), in `precision`."""
    from .layered import LayeredPathLoss
    from .learned import PathLoss
    from .params import SymmetryParams
    graph = meta_graph(template)
    dtype = torch.bfloat16 if precision == "bf16" else None
    with fake_tensors():
        graphs = [graph.replace({k: torch.empty(v.shape, dtype=v.dtype) for k, v in graph.params.items()})
                  for _ in range(n_models)]
        learned = range(n_models) if method == "dual" else range(1, n_models)
        ends = {str(k): SymmetryParams(graph.spec, None) for k in learned}
        if checkpointing:
            path_loss = LayeredPathLoss(graphs, ends, template, template.task, dtype, checkpointing=True)
        else:
            path_loss = PathLoss(graphs, ends, template, template.task, dtype)
            path_loss.stack_ends()  # as on a GPU (PathLoss.to_device): the soft target's endpoints run batched
        path_loss.soft_targets = soft_targets
        del graphs
        vocab = graph.spec.n_out
        inputs = torch.randint(0, vocab, (batch, seq))
        rows = torch.arange(min(vocab, batch * seq)) if path_loss.sparse else None  # distinct ids: at most all
        with LiveBytes() as live:
            path_loss(inputs, None, 0.5, rows).backward()
        learned_parameters = sum(p.numel() for p in path_loss.parameters() if p.requires_grad)
        endpoint_bytes = path_loss.stored_bytes()[0]
    held = endpoint_bytes + 3 * 4 * learned_parameters  # the fp32 parameters and AdamW's two moments
    return StepCount(held, live.peak, endpoint_bytes, learned_parameters, path_loss.model_parameters)


__all__ = ["LiveBytes", "StepCount", "config_template", "count_step", "fake_tensors", "meta_graph"]
