"""The training loop itself (`train_loop.train_transforms`) for a few steps under CUDA's rules, on a machine without a
GPU: what `cuda_rules.check_step` checks for one hand-built step, here for the loop as it runs.

* the loss, its endpoints and the batch live on simulated CUDA (`cuda_rules.simulated_cuda`: fake tensors on device
  ``cuda``, CUDA's autocast); the loop gets a `SimulatedAccelerator` (one process on ``cuda``);
* the **backward** runs on the same fake CUDA tensors, so the bf16 backward of a forward recorded under CUDA's autocast
  is checked too.  torch's autograd engine refuses to start on a machine without a CUDA device ("hasPrimaryContext
  expects a valid device index"), so `run_backward` walks the graph itself: every node's own backward (the same
  aten ops the engine would call, checkpoint recomputation included) in dependency order, each gradient
  reduced to its input's shape and dtype as the engine's ``validate_outputs`` does;
* every aten op passes through a `LoopRecorder`, which fails on what CUDA rejects (`cuda_rules.Recorder`), counts
  per step the host syncs (answering a read of the device with zeros, as fake tensors hold no data; a sync whose
  result has a data-dependent size, such as ``torch.unique`` on the device, cannot be answered and fails at once),
  the aten ops by name (fused AdamW is one ``_fused_adamw_``), host-to-device copies and float64 ops.

The model's own host syncs do not show here: transformers skips its packed-sequence check on fake tensors (the meta
twin of `cuda_rules.check_step` counts them).
"""
from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from . import train_loop
from .cuda_rules import HARNESS_FILES, SYNC_OPS, CudaRuleViolation, Recorder, _is_view, _where, simulated_cuda

ANSWERABLE = {"_local_scalar_dense", "is_nonzero", "equal"}  # a value fake tensors cannot give: answered 0 / False


def _grad_like(grad: torch.Tensor, meta) -> torch.Tensor:
    """The gradient as the engine hands it on (validate_outputs): summed to the input's shape, in its dtype."""
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    if grad.dtype != meta.dtype:
        grad = grad.to(meta.dtype)
    if grad.device != meta.device:
        raise CudaRuleViolation(f"a gradient on {grad.device} meets an input on {meta.device}")
    return grad


def run_backward(loss: torch.Tensor) -> None:
    """loss.backward() without torch's autograd engine (module docstring): each node's backward in dependency
    order, gradients accumulated into the leaves' .grad by their AccumulateGrad nodes."""
    root = loss.grad_fn
    if root is None:
        raise CudaRuleViolation("the loss does not depend on the learned parameters")
    waiting: Counter = Counter()  # node -> edges into it not yet processed
    seen, stack = {root}, [root]
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is not None:
                waiting[node] += 1
                if node not in seen:
                    seen.add(node)
                    stack.append(node)
    inputs: dict = {root: [torch.ones_like(loss)]}
    ready = [root]
    # one group: each checkpointed region recomputed once (outside the engine, torch would recompute it per
    # saved tensor)
    with torch.no_grad(), torch.utils.checkpoint.GraphExecGroup():
        while ready:
            node = ready.pop()
            grads = inputs.pop(node, None)
            outputs = ()
            if grads is not None and any(g is not None for g in grads):
                call = node.apply if hasattr(node, "_forward_cls") else node  # a custom autograd.Function's node
                result = call(*grads)
                outputs = result if isinstance(result, tuple) else (result,)
            for k, (nxt, slot) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                grad = outputs[k] if k < len(outputs) else None
                if grad is not None:
                    buffer = inputs.setdefault(nxt, [None] * len(nxt._input_metadata))
                    grad = _grad_like(grad, nxt._input_metadata[slot])
                    buffer[slot] = grad if buffer[slot] is None else buffer[slot] + grad
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    ready.append(nxt)


@dataclass
class StepCounts:
    """What one step of the loop did on the (simulated) device."""

    step: int
    syncs: Counter = field(default_factory=Counter)  # host syncs by (function of this project that made it, op)
    ops: Counter = field(default_factory=Counter)  # aten ops on the device by name (views included)
    launches: int = 0  # aten ops that are not views (a kernel launch each on a GPU)
    host_to_device: int = 0
    float64: int = 0
    where: Counter = field(default_factory=Counter)  # file:line of every sync and float64 op
    backward_launches: int = 0
    bf16: Counter = field(default_factory=Counter)  # launches with a bf16 operand or result, by phase

    @property
    def n_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def fused_adamw(self) -> int:
        return self.ops["_fused_adamw_"] + self.ops["_fused_adamw"]

    def summary(self) -> dict:
        return {"step": self.step, "host_syncs": self.n_syncs, "launches": self.launches,
                "backward_launches": self.backward_launches, "bf16_launches": dict(self.bf16),
                "fused_adamw": self.fused_adamw, "host_to_device": self.host_to_device, "float64_ops": self.float64,
                "sync_sites": {f"{fn}: {op}": n for (fn, op), n in self.syncs.items()}}


def _on_the_host(args, kwargs) -> bool:
    """Whether the op only involves real host tensors (none fake, none on the device, no device target)."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    target = kwargs.get("device")
    return (all(t.device.type == "cpu" and not isinstance(t, FakeTensor) for t in tensors)
            and (target is None or torch.device(target).type == "cpu"))


def _caller() -> str:
    """The innermost function of this project (not the harness) on the stack."""
    stack = traceback.extract_stack()
    ours = [f for f in stack if "hf_rebasin" in f.filename and not f.filename.endswith(HARNESS_FILES)]
    return ours[-1].name if ours else "?"


class LoopRecorder(Recorder):
    """`cuda_rules.Recorder`, not strict: host syncs are counted (and answered with zeros) by the function that made
    them, the ops counted by name; the host's own work runs for real."""

    def __init__(self):
        super().__init__("cuda", strict=False)
        self.names: Counter = Counter()
        self.sites: Counter = Counter()
        self.phase, self.backward_launches, self.bf16 = "forward", 0, Counter()  # (the accelerator sets the phase)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if _on_the_host(args, kwargs):
            if name == "_pin_memory":  # (no pinned memory without a driver: the tensor as it is)
                return args[0]
            with _disable_current_modes():  # the loop's own host work (data order, λ, token ids) runs for real
                return func(*args, **kwargs)
        before = self.counts.ops
        out = self._answer(name, args, kwargs)
        if out is None:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.counts.ops > before:
            self.names[name] += 1
            if not _is_view(func):
                self.backward_launches += self.phase == "backward"
                if any(t.dtype == torch.bfloat16 for t in tree_flatten((args, kwargs, out))[0]
                       if isinstance(t, torch.Tensor)):
                    self.bf16[self.phase] += 1
        return out

    def _sync(self, what: str) -> bool:
        self.sites[(_caller(), what)] += 1
        return super()._sync(what)

    def _answer(self, name: str, args, kwargs):
        """The result of a host read of a device value (zeros: fake tensors hold no data), counted as a sync; None
        if the op is not one."""
        on_device = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
        if not on_device:
            return None
        if name == "_to_copy":
            target = kwargs.get("device")
            if target is None or torch.device(target).type == "cuda":
                return None
            self.counts.ops += 1
            self._sync("device_to_host_copy")
            with _disable_current_modes():
                return torch.zeros(on_device[0].shape, dtype=kwargs.get("dtype") or on_device[0].dtype)
        if name in ANSWERABLE:
            self.counts.ops += 1
            self._sync(name)
            return False if on_device[0].dtype == torch.bool else 0
        if name in SYNC_OPS:
            raise CudaRuleViolation(f"host sync ({name}) at {_where()}: its result's size depends on the device's "
                                    "data, the host would wait for the GPU here")
        return None

    def take(self, step: int) -> StepCounts:
        """The counts since the last take, as step `step`'s; then start afresh."""
        counts = self.counts
        taken = StepCounts(step, Counter(self.sites), Counter(self.names), counts.launches, counts.host_to_device,
                           sum(counts.float64.values()), Counter(self.where), self.backward_launches,
                           Counter(self.bf16))
        self.counts, self.backward_launches = type(counts)(), 0
        for counter in (self.names, self.sites, self.where, self.bf16):
            counter.clear()
        return taken


class SimulatedAccelerator:
    """What train_transforms asks of an accelerate.Accelerator, for one process on simulated CUDA; its backward is
    `run_backward`, checked: an fp32 loss on the device, and every learned parameter gets a gradient of its own
    dtype on the device."""

    device = torch.device("cuda")
    is_main_process, process_index, num_processes = True, 0, 1

    def __init__(self, params, recorder: LoopRecorder):
        self.params, self.recorder, self.backwards = list(params), recorder, 0

    def backward(self, loss: torch.Tensor) -> None:
        if loss.dtype != torch.float32 or loss.device.type != "cuda":
            raise CudaRuleViolation(f"the loss is {loss.dtype} on {loss.device}, not fp32 on cuda")
        self.recorder.phase = "backward"
        try:
            run_backward(loss)
        finally:
            self.recorder.phase = "forward"
        self.backwards += 1
        for p in self.params:
            if p.grad is None or p.grad.dtype != p.dtype or p.grad.device.type != "cuda":
                got = None if p.grad is None else f"{p.grad.dtype} on {p.grad.device}"
                raise CudaRuleViolation(f"a {p.dtype} parameter got the gradient {got}")

    def wait_for_everyone(self) -> None:
        pass


class _Stop(Exception):
    pass


def reads_at(done: int, schedule: int) -> bool:
    """Whether the loop reads the losses after step `done` of a `schedule`-step run (nothing evaluated, no
    checkpoints): every min(log interval, MAX_STEPS_BETWEEN_READS) steps and after the last."""
    log_every = max(1, schedule // 100)
    return done % min(log_every, train_loop.MAX_STEPS_BETWEEN_READS) == 0 or done == schedule


def check_counts(counts: StepCounts, schedule: int) -> None:
    """CUDA's rules for one step of the loop: no host sync but the loss read of a read step, one fused AdamW
    launch, no float64 op (CudaRuleViolation naming what broke them)."""
    where = "; ".join(counts.where) or "-"
    allowed = {"read"} if reads_at(counts.step, schedule) else set()
    stray = {site: n for site, n in counts.syncs.items() if site[0] not in allowed}
    if stray:
        raise CudaRuleViolation(f"step {counts.step}: {sum(stray.values())} host sync(s) outside the loss read "
                                f"({', '.join(f'{fn}: {op}' for fn, op in stray)}) at {where}")
    if counts.fused_adamw != 1:
        raise CudaRuleViolation(f"step {counts.step}: {counts.fused_adamw} fused AdamW launches, not 1 (on CUDA the "
                                "optimiser is AdamW(fused=True): one launch for every parameter)")
    if counts.float64:
        raise CudaRuleViolation(f"step {counts.step}: {counts.float64} float64 op(s) on the device at {where}")


def loop_options(steps: int, batch: int, **overrides):
    """MergeOptions for a run of `steps` steps (of which the harness runs the first few), nothing evaluated."""
    from ..options import MergeOptions
    return MergeOptions(steps=steps, learn_batch_size=batch, eval_every=0, holdout=0, checkpoint_every=0,
                        **overrides)


def run_loop(path_loss, train, *, method: str, run_steps: int = 2, schedule: int = 200, batch: int = 2,
             grad_accum: int = 1) -> list[StepCounts]:
    """train_transforms (looked up in train_loop when called, so that a patched loop is the one run) for the first
    `run_steps` steps of a `schedule`-step run of `method` on simulated CUDA (module docstring), each step checked
    by `check_counts` as it ends; `path_loss` is given on the host and moved to the device here.  Raises
    CudaRuleViolation at the first step that breaks CUDA's rules; returns every step's counts."""
    options = loop_options(schedule, batch, method=method, grad_accum=grad_accum)
    steps: list[StepCounts] = []
    with simulated_cuda():
        path_loss.to_device(torch.device("cuda"))
        with LoopRecorder() as recorder:
            accelerator = SimulatedAccelerator((p for p in path_loss.parameters() if p.requires_grad), recorder)
            def on_step(done, _loss):
                steps.append(recorder.take(done))
                check_counts(steps[-1], schedule)
                if done >= run_steps:
                    raise _Stop

            try:
                train_loop.train_transforms(path_loss, accelerator, train, None, options, fingerprint={},
                                            resume_state=None, progress=False, on_step=on_step)
            except _Stop:
                pass
    if accelerator.backwards != run_steps * grad_accum:
        raise CudaRuleViolation(f"{accelerator.backwards} backward passes in {run_steps} steps of {grad_accum}")
    return steps


__all__ = ["LoopRecorder", "SimulatedAccelerator", "StepCounts", "check_counts", "run_backward", "run_loop"]
