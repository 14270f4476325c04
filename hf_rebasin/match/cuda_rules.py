"""Learned matching's training step under CUDA's rules, on a machine without a GPU.

A CPU hides what a GPU rejects: CPU autocast casts ``linalg`` ops to fp32 while CUDA autocast has no rule for
them (a bf16 weight then meets an fp32 map and the op fails), and a CPU has no host/device boundary to stall
on.  `check_step` runs the project's own step on simulated CUDA tensors and records what a GPU would see:

* **forward**: torch fake tensors on device ``cuda`` (shapes, dtypes and devices, no data) under CUDA's autocast
  as the dispatcher implements it (the ``AutocastCUDA`` kernels run because the tensors carry CUDA's dispatch
  keys), so every dtype decision is CUDA's, not the CPU's;
* **optimiser**: AdamW's step on the same fake CUDA parameters;
* **backward**: the autograd engine cannot run on fake CUDA tensors without a CUDA driver, so the backward runs
  on a twin of the step on the ``meta`` device (no autocast there: the backward's dtypes follow the forward's,
  which the fake CUDA forward has already checked).

Every aten op passes through `Recorder`, which fails on what CUDA would reject (a ``linalg`` op with operands
outside fp32/fp64: CUDA has no half-precision linalg kernels, and its autocast leaves them alone, which
`autocast_has_rule` asks the dispatcher) and counts, per phase: aten ops, host syncs (reading a device value:
``_local_scalar_dense``, ``nonzero``, ``unique``, ``_linalg_check_errors``, device-to-host copies),
host-to-device copies and float64 ops on the device.
"""
from __future__ import annotations

import traceback
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ops that make the host wait for the device (their result is a value the host reads, or a data-dependent size)
SYNC_OPS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "_linalg_check_errors",
            "masked_select", "equal", "is_nonzero"}
COPY_OPS = {"_to_copy", "copy_", "copy"}


def _is_view(func) -> bool:
    return func.is_view or func.__name__.split(".")[0] in ("view", "_unsafe_view", "alias", "detach")


def autocast_has_rule(op_name: str, device_type: str = "cuda") -> bool:
    """Whether `device_type`'s autocast has a kernel of its own for the aten op (else autocast leaves it alone):
    read from the dispatcher's table, not assumed."""
    key = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}[device_type]
    table = torch._C._dispatch_dump_table(op_name)
    return any(line.startswith(f"{key}:") and "fallthrough" not in line for line in table.splitlines())


class CudaRuleViolation(RuntimeError):
    """An op the simulated GPU would reject, or a host sync where none is allowed."""


@dataclass
class Counts:
    """What one phase of a step did on the device."""

    ops: int = 0  # aten ops (each a kernel launch on a GPU, views aside)
    views: int = 0  # aten ops that only make views (no launch)
    syncs: Counter = field(default_factory=Counter)  # host syncs in this project's code
    model_syncs: Counter = field(default_factory=Counter)  # inside the model's own forward (transformers, timm)
    host_to_device: int = 0
    float64: Counter = field(default_factory=Counter)

    @property
    def launches(self) -> int:
        return self.ops - self.views

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.ops + other.ops, self.views + other.views, self.syncs + other.syncs,
                      self.model_syncs + other.model_syncs, self.host_to_device + other.host_to_device,
                      self.float64 + other.float64)

    def summary(self) -> dict:
        return {"aten_ops": self.ops, "launches": self.launches, "host_syncs": sum(self.syncs.values()),
                "model_host_syncs": sum(self.model_syncs.values()), "host_to_device": self.host_to_device,
                "float64_ops": sum(self.float64.values()), "sync_ops": dict(self.syncs),
                "model_sync_ops": dict(self.model_syncs), "float64_by_op": dict(self.float64)}


MODEL_LIBRARIES = ("/transformers/", "/timm/")
HARNESS_FILES = ("cuda_rules.py", "cuda_loop.py")


def _where() -> str:
    """The innermost frame of this project's code (not the harness) that led to the op, and of the model's library
    if the op came from there."""
    stack = traceback.extract_stack()
    ours = [f for f in stack if "hf_rebasin" in f.filename and not f.filename.endswith(HARNESS_FILES)]
    where = f"{ours[-1].filename.rsplit('hf_rebasin', 1)[1]}:{ours[-1].lineno}" if ours else "?"
    model = [f for f in stack if any(lib in f.filename for lib in MODEL_LIBRARIES)]
    return where if not model else f"{where} in {model[-1].filename.rsplit('site-packages/', 1)[-1]}:{model[-1].lineno}"


def _in_model_code() -> bool:
    return any(lib in f.filename for f in traceback.extract_stack() for lib in MODEL_LIBRARIES)


class Recorder(TorchDispatchMode):
    """Counts the aten ops on `device_type` tensors and fails on what CUDA would reject (module docstring).
    strict: a host sync raises at once, naming the line of code that caused it."""

    def __init__(self, device_type: str, strict: bool = True):
        super().__init__()
        self.device_type, self.strict, self.counts = device_type, strict, Counts()
        self.where: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t.device.type == self.device_type]
        if name in COPY_OPS and tensors:
            self._copy(name, tensors, kwargs)
        if not on_device or func.namespace != "aten":  # (prim::device and the like are queries, not kernels)
            return func(*args, **kwargs)
        counts = self.counts
        counts.ops += 1
        counts.views += _is_view(func)
        if name.startswith(("linalg_", "_linalg_")) or name in ("cholesky", "matrix_exp"):
            bad = {str(t.dtype) for t in on_device if t.is_floating_point() and t.dtype not in (torch.float32,
                                                                                             torch.float64)}
            if bad and self.device_type != "meta":
                raise CudaRuleViolation(f"aten::{name} with {', '.join(sorted(bad))} operands at {_where()}: CUDA "
                                        "has no linalg kernels for them and its autocast has no rule for linalg ops")
        if name in SYNC_OPS and self._sync(name) and name == "_local_scalar_dense" and self.device_type == "meta":
            # the model's own check on the meta twin (transformers skips it on fake tensors): answer as real data
            # would (bool checks such as "no packed sequences" hold for plain batches)
            return True if on_device[0].dtype == torch.bool else 0
        out = func(*args, **kwargs)
        results = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if any(t.dtype == torch.float64 for t in [*on_device, *results]):
            counts.float64[name] += 1
            self.where[f"float64 {name} at {_where()}"] += 1
        return out

    def _sync(self, what: str) -> bool:
        """Count a host sync; True if it is the model's own (in its library's code), else ours (raises if strict)."""
        model = _in_model_code()
        (self.counts.model_syncs if model else self.counts.syncs)[what] += 1
        self.where[f"{'model ' if model else ''}sync {what} at {_where()}"] += 1
        if self.strict and not model:
            raise CudaRuleViolation(f"host sync ({what}) at {_where()}: the host would wait for the GPU here")
        return model

    def _copy(self, name: str, tensors, kwargs) -> None:
        if name == "_to_copy":
            src, dst = tensors[0].device.type, kwargs.get("device", tensors[0].device)
            dst = torch.device(dst).type if dst is not None else src
        else:  # copy_(dst, src)
            dst, src = tensors[0].device.type, tensors[1].device.type
        if src == self.device_type and dst != self.device_type:
            self._sync("device_to_host_copy")
        elif dst == self.device_type and src != self.device_type:
            self.counts.host_to_device += 1


def _replacing_apply():
    """Module._apply that puts the converted tensors in place of the old ones (torch swaps a fake tensor into the
    existing Parameter object, which fails once the fake mode holds a weak reference to it); tied weights stay
    tied."""
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the old tensor, kept alive; the new one)

    def apply(module, fn, recurse=True):
        if recurse:
            for child in module.children():
                child._apply(fn)
        for store, wrap in ((module._parameters, True), (module._buffers, False)):
            for key, value in store.items():
                if value is not None:
                    if id(value) not in memo:
                        with torch.no_grad():
                            moved = fn(value)
                        memo[id(value)] = value, torch.nn.Parameter(moved, value.requires_grad) if wrap else moved
                    store[key] = memo[id(value)][1]
        return module
    return apply


@contextmanager
def simulated_cuda():
    """A FakeTensorMode in which tensors may live on device ``cuda`` and ``torch.autocast("cuda")`` is CUDA's
    autocast (bf16 taken as supported), though no GPU is present; ``module.to("cuda")`` works as on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False))
        stack.enter_context(mock.patch("torch.cuda.is_bf16_supported", return_value=True))
        stack.enter_context(mock.patch.object(torch.nn.Module, "_apply", _replacing_apply()))
        yield stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))


@dataclass
class StepReport:
    """Counts of one training step by phase, and where (file:line of this project) each sync or float64 op was."""

    forward: Counts
    backward: Counts
    optimizer: Counts
    where: Counter

    @property
    def total(self) -> Counts:
        return self.forward + self.backward + self.optimizer

    def summary(self) -> dict:
        return {"forward": self.forward.summary(), "backward": self.backward.summary(),
                "optimizer": self.optimizer.summary(), "total": self.total.summary()}


def _path_loss(template, graphs, method: str, layered: bool, dtype, init: str, soft_targets: float = 0.0):
    """learned matching's loss on the path as `learn` builds it (match/learned.py), on the CPU: `init` "absorbed"
    (every learned element starts at the identity, the default) or "plain" (at a random group element, with
    permutations)."""
    from ..core.symmetry import random_transform
    from .layered import LayeredPathLoss
    from .learned import PathLoss
    from .params import SymmetryParams
    spec = graphs[0].spec

    def start(seed):
        return None if init == "absorbed" else random_transform(spec, seed=seed)

    ends = {"1": SymmetryParams(spec, start(2))}
    if method == "dual":
        ends["0"] = SymmetryParams(spec, start(1))
    if layered:
        path_loss = LayeredPathLoss(graphs, ends, template, template.task, dtype, checkpointing=True)
    else:
        path_loss = PathLoss(graphs, ends, template, template.task, dtype)
    path_loss.soft_targets = soft_targets
    return path_loss


def example_batch(template, batch: int, seq: int, seed: int = 0):
    """(inputs, labels or None) on the host: random token windows, or random images and labels."""
    gen = torch.Generator().manual_seed(seed)
    if template.task in ("causal-lm", "masked-lm"):
        from ..sources.masking import example_labels
        x = torch.randint(0, template.spec.n_out, (batch, seq), generator=gen)
        return x, example_labels(x, gen) if template.task == "masked-lm" else None
    size = template.model.default_cfg.get("input_size", (3, 32, 32)) if hasattr(template.model, "default_cfg") else None
    images = torch.randn(batch, *(size or (3, 32, 32)), generator=gen)
    return images, torch.randint(0, template.spec.n_out, (batch,), generator=gen)


def check_step(template, graphs, *, method: str = "dual", layered: bool = False, precision: str = "bf16",
               init: str = "absorbed", batch: int = 2, seq: int = 8, strict: bool = True,
               soft_targets: float = 0.0) -> StepReport:
    """One training step of learned matching (`method` lm or dual, the whole-model or the layer-by-layer loss with
    checkpointing, bf16 autocast or fp32, `soft_targets` as --soft-targets) on simulated CUDA (module docstring):
    the forward and AdamW's step on fake CUDA tensors under CUDA's autocast, the backward on the meta twin.  Raises
    CudaRuleViolation on an op CUDA would reject (and, when strict, on a host sync); returns the counts."""
    from .train_loop import host_batch, make_optimizer, send
    dtype = torch.bfloat16 if precision == "bf16" else None
    inputs, labels = example_batch(template, batch, seq)
    lam, cuda = 0.3, torch.device("cuda")
    where: Counter = Counter()
    path_loss = _path_loss(template, graphs, method, layered, dtype, init, soft_targets)
    batch = host_batch(inputs, labels, path_loss.sparse)
    with simulated_cuda():
        path_loss.to_device(cuda)
        with Recorder("cuda", strict) as forward:
            x, y, rows = send(batch, cuda, pin=False)  # (no pinned memory without a driver)
            loss = path_loss(x, y, lam, rows)
        if loss.dtype != torch.float32 or loss.device.type != "cuda":
            raise CudaRuleViolation(f"the loss is {loss.dtype} on {loss.device}, not fp32 on cuda")
        params = [p for p in path_loss.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = make_optimizer(params, 1e-3, cuda)
        optimizer.step()  # the first step also creates AdamW's state: count one as every later step is
        with Recorder("cuda", strict) as step:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    twin = _path_loss(template, graphs, method, layered, None, init, soft_targets).to_device("meta")
    with Recorder("meta", strict) as twin_forward:  # for the model's own syncs, which fake tensors do not show
        x, y, rows = send(batch, torch.device("meta"))
        loss = twin(x, y, lam, rows)
    with Recorder("meta", strict) as backward:
        loss.backward()
    forward.counts.model_syncs = twin_forward.counts.model_syncs
    for recorder in (forward, twin_forward, step, backward):
        where.update(recorder.where)
    return StepReport(forward.counts, backward.counts, step.counts, where)


def check_plain_step(template, *, precision: str = "bf16", batch: int = 2, seq: int = 8) -> StepReport:
    """The same counts for a plain training step of one model (forward, backward, fused AdamW over all its
    weights): the yardstick for the launches of a learned-matching step."""
    import copy

    import torch.nn.functional as F

    from .train_loop import make_optimizer
    inputs, labels = example_batch(template, batch, seq)

    def loss_of(model, x, y):
        if template.task == "causal-lm":
            logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        if template.task == "masked-lm":
            from ..sources.models import lm_logits
            logits = lm_logits(model(input_ids=x)).float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        return F.cross_entropy(model(x).float(), y)

    cuda = torch.device("cuda")
    model = copy.deepcopy(template.model)  # (its mode as loaded: eval, no dropout)
    with simulated_cuda():
        model.to(cuda)
        with Recorder("cuda") as forward:
            x, y = inputs.to(cuda), None if labels is None else labels.to(cuda)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss_of(model, x, y)
        params = [p for p in model.parameters()]
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = make_optimizer(params, 1e-3, cuda)
        optimizer.step()
        with Recorder("cuda") as step:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    twin = copy.deepcopy(template.model).to("meta")
    with Recorder("meta") as twin_forward:
        loss = loss_of(twin, inputs.to("meta"), None if labels is None else labels.to("meta"))
    with Recorder("meta") as backward:
        loss.backward()
    forward.counts.model_syncs = twin_forward.counts.model_syncs
    return StepReport(forward.counts, backward.counts, step.counts, twin_forward.where)


__all__ = ["Counts", "CudaRuleViolation", "Recorder", "StepReport", "autocast_has_rule", "check_plain_step",
           "check_step", "simulated_cuda"]
