"""Learned matching: ``--method lm`` (single-sided, Theus et al.) and ``--method dual`` (LMC-DM, Li & Shen),
for two models or N.

Both start from the weight-matching solution and train continuous symmetry parameters (params.py) on the
task loss at random points of the path (two models) or of the simplex (N models),

    theta(w) = sum_i w_i * pi_i(theta_i),   two models: w = (1 - l, l), l ~ U(0, 1) ("uniform") or
                                            U(0.4, 0.6) ("narrow");  N models: w ~ Dirichlet(1) or Dirichlet(36),

with the endpoints frozen.  ``lm`` learns every model's element but the first (model A's frame is the
reference); ``dual`` learns all.  With the default ``--init absorbed`` the weight-matching transforms are
applied to the graphs first and the learned elements start at the identity; the transform returned is
the product compose(wm, learned), so applying it to the ORIGINAL graph gives the learned point.
``--init plain`` (two models) starts the parameters at the weight-matching values instead.  The parameters
returned are those with the lowest midpoint loss on ``--holdout`` training examples kept out of the
optimisation (measured at the start, every ``--eval-every`` steps and at the end; train_loop.py).

The loss is computed inside the forward: the transformed, interpolated canonical graph is exported with
the adapter's ``from_canonical`` (plain tensor ops) and run through one module instance (its own weights
dropped) with ``torch.func.functional_call``.

Two exact shortcuts keep a step cheap:
* the group acts linearly on the weights, so the two-model dual path (1-l) t_a(A) + l t_b(B) is t_a
  applied to (1-l) A + l (t_a^-1 t_b)(B): dual trains through the latter (same function at every l, one
  transform per step instead of two; not with a start that permutes A);
* only the token-embedding rows of the batch are transformed (the others are never looked up).
Cost: transforming the weights takes ~ d·P flops per pass (d the width, P the parameters) against ~ T·P
for the model on T tokens, so an lm or dual step costs about 1 + d/T plain training steps.

Memory: PathLoss is not layer by layer.  Every step materialises a full transformed state dict (plus the
intermediates of the transform chain and the interpolated point, which autograd keeps for the backward)
on top of the frozen endpoints.  ``--gradient-checkpointing`` and ``--fsdp`` run layered.LayeredPathLoss
instead: the same loss computed layer by layer, with layers recomputed in the backward and/or the endpoints
sharded over the processes.  With ``--learn-precision bf16`` (the default on CUDA) the endpoints are held
in bf16 and the transforms act on them under autocast, so each of those copies is bf16 too; the group
elements (small matrices), their gradients and AdamW's state stay fp32.
"""
from __future__ import annotations

import datetime
import hashlib
import itertools
import warnings
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn

from ..core.canonical import Graph
from ..core.symmetry import apply, compose
from ..errors import OptionError, UserError
from .action import Action, combine, graph_share
from .alignment import DEFAULT_HOLDOUT
from .params import SymmetryParams
from .path import PathOfEnds, batched_soft_target, stacked, stored, strip_parameters

LEARNED_SETTINGS = ("method", "start", "steps", "lr", "warmup", "learn_batch_size", "grad_accum", "init", "orth", "inv",
                    "lambda_dist", "soft_targets", "learn_seed", "eval_every", "eval_subset", "holdout",
                    "checkpoint_every", "checkpoint_minutes", "checkpoint_dir", "resume", "learn_precision", "device",
                    "gradient_checkpointing", "fsdp")


def trajectory_settings(options, n_models: int, task: str) -> dict:
    """The settings that determine the trajectory (a resumed run must match them)."""
    return {"method": options.method, "steps": options.steps, "lr": options.lr, "batch_size": options.learn_batch_size,
            "start": options.start, "init": options.init, "orth": options.orth, "inv": options.inv,
            "seed": options.learn_seed, "precision": options.learn_precision,
            "lambda_dist": options.learned_lambda_dist(n_models, task), "warmup": options.warmup_steps(),
            "holdout": options.holdout, "eval_every": options.eval_every,
            "soft_targets": options.soft_target_share(task)}


# --- the loss on the path ------------------------------------------------------------------------

class PathLoss(PathOfEnds):
    """Task loss at sum_i w_i t_i(theta_i), the whole transformed state dict built per step."""

    def __init__(self, graphs: list[Graph], ends: dict[str, SymmetryParams], template, task: str,
                 autocast_dtype: torch.dtype | None = None):
        super().__init__(ends, len(graphs))
        from ..sources.models import instantiate
        # trained through: held in memory, in the autocast dtype when there is one (bf16 endpoints)
        self.graphs = {str(k): stored(g.materialise(), autocast_dtype) for k, g in enumerate(graphs)}
        self.template, self.task, self.autocast_dtype, self.spec = template, task, autocast_dtype, graphs[0].spec
        self.__dict__["model"] = strip_parameters(instantiate(graphs[0], template))  # not a submodule
        self.__dict__["norms"] = template.adapter.norm_modules(self.model) if graphs[0].spec.scale_exact else []
        self.__dict__["tied"] = template.adapter.tied_names(template.config)
        self.model_parameters = sum(v.numel() for v in self.graphs["0"].params.values())
        self.stacks: dict[str, Tensor] | None = None  # the endpoints stacked (stack_ends)

    def stored_bytes(self) -> tuple[int, int]:
        """(bytes of frozen endpoint tensors this process stores, bytes of all of them): the same here."""
        total = sum(v.numel() * v.element_size() for g in self.graphs.values() for v in g.params.values())
        return total, total

    def to_device(self, device) -> PathLoss:
        """Everything on `device`; off the CPU the endpoints are stacked (path.stacked) for one batched forward of
        them all (soft targets): on a GPU that halves their launches; on the CPU they stay the caller's tensors."""
        self.to(device)
        self.model.to(device)
        if torch.device(device).type == "cpu":
            self.graphs = {k: g.replace({n: v.to(device) for n, v in g.params.items()}) for k, g in self.graphs.items()}
        else:
            self.stack_ends(device)
        return self

    def stack_ends(self, device=None) -> None:
        """Hold the endpoints stacked (path.stacked), on `device` (default where they are)."""
        device = device or next(iter(self.graphs["0"].params.values())).device
        self.stacks, graphs = stacked(list(self.graphs.values()), device)
        self.graphs = dict(zip(self.graphs, graphs))

    def soft_target(self, inputs: Tensor, weights: list[float], rows: Tensor | None) -> Tensor:
        """PathOfEnds.soft_target, by one batched forward of the endpoints when they are stacked (stack_ends), share one
        norm eps (the model runs with one) and are language models (timm's patch convolution fails under vmap with
        autocast: its bias keeps the weights' dtype while the input is cast).  Not mixtures of experts: transformers
        picks their expert kernels by the device's capability, and no batched run of those has been checked on a GPU
        (on the CPU it gives the same target; tests/test_soft_targets.py)."""
        if (self.stacks is None or self.task != "causal-lm" or self.spec.n_experts
                or len({g.norm_eps for g in self.graphs.values()}) > 1):  # experts: unbatched (below)
            return super().soft_target(inputs, weights, rows)
        try:
            return batched_soft_target(self, self.stacks, self.graphs["0"], inputs, weights)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:  # an op of this model or device with no vmap batching rule: one at a time
            warnings.warn(f"the soft target's endpoints run one at a time (the batched forward failed: "
                          f"{str(error).splitlines()[0] if str(error) else type(error).__name__})", stacklevel=2)
            self.stacks = None
            return super().soft_target(inputs, weights, rows)

    def point(self, lam, device_type: str, rows: Tensor | None = None) -> Graph:
        """The point trained on.  With `rows` (the distinct token ids of the batch) only those rows of the token
        embedding are transformed and interpolated: the others are never looked up, so the loss is the same, at
        T·d² instead of V·d² for the embedding."""
        first = self.graphs["0"]
        key = f"embed.{first.spec.token_embedding}"
        graphs = self.graphs
        if rows is not None:
            graphs = {k: g.replace({**g.params, key: g.params[key][rows]}) for k, g in graphs.items()}
        elements = self.current_elements(device_type)
        weights = self.weights(lam)
        eps, factor = self.eps_and_write_factor(elements, [g.norm_eps for g in graphs.values()], weights)
        actions = {k: Action.of(t, weights[int(k)], factor, self.spec, self.autocast_dtype)
                   for k, t in elements.items() if weights[int(k)] != 0.0}
        shares = [graph_share(g, actions[k]) if k in actions else ({}, g.params) for k, g in graphs.items()]
        params = combine(shares, weights, factor)
        if rows is not None:  # unused rows: the first model's own (any value would do)
            params[key] = first.params[key].index_put((rows,), params[key].to(first.params[key].dtype))
        return first.replace(params, norm_eps=eps)

    def logits(self, inputs: Tensor, lam, rows: Tensor | None) -> Tensor:
        """The predictions at λ (or interpolation weights) on the batch (PathOfEnds.run_model)."""
        # under autocast the transforms run in the endpoints' bf16 too (no fp32 copy of a model is ever made);
        # the symmetry parameters, their gradients and the optimiser state stay fp32
        dtype = self.autocast_dtype
        with torch.autocast(inputs.device.type, dtype=dtype) if dtype else nullcontext():
            point = self.point(lam, inputs.device.type, rows if self.sparse else None)
            state_dict, _ = self.template.adapter.from_canonical(point, self.template.config)
            for module, attr in self.norms:  # the norm eps of the point (eps_and_write_factor)
                setattr(module, attr, point.norm_eps)
            return self.run_model(state_dict, inputs)

    def endpoint_logits(self, inputs: Tensor, k: int, rows: Tensor | None) -> Tensor:
        """Endpoint k's predictions: its frozen graph run as it is (PathOfEnds.endpoint_logits)."""
        graph = self.graphs[str(k)]
        with torch.autocast(inputs.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else nullcontext():
            state_dict, _ = self.template.adapter.from_canonical(graph, self.template.config)
            for module, attr in self.norms:
                setattr(module, attr, graph.norm_eps)
            return self.run_model(state_dict, inputs)


# --- fingerprints (for resume) -----------------------------------------------------------------

def _tensor_digest_parts(key: str, value: Tensor) -> tuple[bytes, bytes]:
    flat = value.detach().cpu().reshape(-1)
    sample = flat[:: max(1, flat.numel() // 4096)].double()
    return f"{key}{tuple(value.shape)}{float(flat.double().sum()):.10e}".encode(), sample.numpy().tobytes()


def _combine(parts: dict[str, tuple[bytes, bytes]]) -> str:
    h = hashlib.sha256()
    for key in sorted(parts):
        for chunk in parts[key]:
            h.update(chunk)
    return h.hexdigest()[:16]


def digest_tensors(tensors: dict[str, Tensor]) -> str:
    """A cheap content hash: names, shapes, float64 sums and a strided sample of every tensor."""
    return _combine({key: _tensor_digest_parts(key, value) for key, value in tensors.items()})


def digest_graph(graph) -> str:
    """digest_tensors of the graph's tensors, read one part at a time (a lazy graph is never held whole)."""
    if isinstance(graph, Graph):
        return digest_tensors(graph.params)
    parts = {}
    for _, tensors in graph.parts():
        parts.update({key: _tensor_digest_parts(key, value) for key, value in tensors.items()})
    return _combine(parts)


def digest_data(data) -> str:
    if hasattr(data.inputs, "digest"):  # a memory-mapped token file (token_files.TokenWindows)
        return data.inputs.digest()
    tensors = {"inputs": data.inputs}
    if data.labels is not None:
        tensors["labels"] = data.labels
    return digest_tensors(tensors)


# --- the method ----------------------------------------------------------------------------------

def bf16_supported(device: torch.device) -> bool:
    """Whether `device` runs bfloat16: asked of that GPU (cuda:N as chosen), not of the current CUDA device."""
    if device.type != "cuda":
        return True
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported()


def autocast_dtype(options, device: torch.device) -> torch.dtype | None:
    if options.learn_precision == "fp32":
        return None
    bf16_ok = bf16_supported(device)
    if options.learn_precision == "bf16":
        if not bf16_ok:
            raise OptionError("--learn-precision bf16: this GPU does not support bfloat16; use fp32")
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" and bf16_ok else None


@contextmanager
def tf32_matmuls(enabled: bool):
    """fp32 matrix products in TF32 inside the block when `enabled` (torch's "high" precision), restored after."""
    before = torch.get_float32_matmul_precision()
    if enabled:
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def starting_frames(graphs: list[Graph], start: list, options) -> tuple[list[Graph], list]:
    """(the graphs the learned elements act on, where each learned element starts; None: the identity).
    Absorbed: the weight-matching transforms are applied first.  Plain (two models): lm freezes A as
    apply(A, t_a) and starts B's element at t_b; dual starts both elements at theirs."""
    if options.init == "absorbed":
        return [apply(g, t) for g, t in zip(graphs, start)], [None] * len(graphs)
    a, b = graphs
    if options.method == "lm":
        return [apply(a, start[0]), b], [None, start[1]]
    return [a, b], list(start)


def learn(graphs: list[Graph], start, template, train, eval_data, options, *, progress: bool = True,
          on_step=None):
    """Learned (lm) or dual learned (dual) matching from the weight-matching Alignment `start`; returns an
    Alignment whose transforms act on the ORIGINAL graphs.  Under `accelerate launch` every process must pass
    the same graphs and `start` (the lm and dual methods compute it once, on_main_process): refused otherwise."""
    from .alignment import Alignment
    from .train_loop import load_checkpoint, make_accelerator, train_transforms, training_device
    n, method = len(graphs), options.method
    if train is None:
        raise UserError(f"--method {method} trains on data and got none: pass --train-data (a text file/folder, "
                        ".jsonl, a datasets spec, or images for ViTs)")
    if n > 2 and options.init != "absorbed":
        raise OptionError(f"--init {options.init} is for two models; an N-way merge learns from the common frame "
                          "that weight matching finds (--init absorbed)")
    accelerator = make_accelerator(options)
    options.check(n, accelerator.num_processes)
    fingerprint = {"models": [digest_graph(g) for g in graphs], "train_data": digest_data(train),
                   "settings": trajectory_settings(options, n, train.task)}
    resume_state = load_checkpoint(options.resume, fingerprint) if options.resume else None
    from ..sources.splits import eos_token_id
    train, holdout, held_record = split_holdout(train, options.holdout,
                                                eos_token_id(template) if train.task == "causal-lm" else None)

    frames, starts = starting_frames(graphs, start.transforms, options)
    learned = range(n) if method == "dual" else range(1, n)
    try:
        ends = {str(k): SymmetryParams(graphs[k].spec, starts[k], orth=options.orth, inv=options.inv)
                for k in learned}
    except ValueError as error:
        raise OptionError(str(error)) from error
    device = training_device(options.device, accelerator.num_processes, accelerator.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dtype = autocast_dtype(options, device)
    tf32 = device.type == "cuda" and dtype is None  # fp32 learning on a GPU: its matrix products in TF32
    path_loss = path_loss_for(frames, ends, template, train.task, dtype, options, accelerator, device)
    del frames  # the path holds its own layout of them (path.stored: a layer's reads and writes in blocks)
    check_same_start(accelerator, {"models": fingerprint["models"],
                                   "matching": [exact_digest(t.to_tensors()) for t in start.transforms],
                                   "parameters": exact_digest(path_loss.learned_state())})
    with tf32_matmuls(tf32):
        log = train_transforms(path_loss, accelerator, train, eval_data, options, fingerprint=fingerprint,
                               resume_state=resume_state, progress=progress, on_step=on_step, holdout=holdout,
                               device=device)

    transforms = []
    for k, graph in enumerate(graphs):
        end = path_loss.ends[str(k)].export() if str(k) in path_loss.ends else None
        if options.init == "absorbed":
            transforms.append(start.transforms[k] if end is None else compose(start.transforms[k], end, graph.spec))
        else:
            transforms.append(start.transforms[k] if end is None else end)
    settings = {"learned": {**{name: getattr(options, name) for name in LEARNED_SETTINGS},
                            "lambda_dist": options.learned_lambda_dist(n, train.task),
                            "soft_targets": options.soft_target_share(train.task), "warmup": options.warmup_steps(),
                            "tf32": tf32},
                "wm": start.settings, "num_processes": accelerator.num_processes, "device": str(device),
                "learned_parameters": sum(p.numel() for p in path_loss.parameters() if p.requires_grad),
                "model_parameters": path_loss.model_parameters, "endpoint_storage": endpoint_storage(path_loss),
                "train_data": dict(train.info or {}), "holdout": held_record, "peak_memory": peak_memory(device),
                "notes": []}
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        accelerator.end_training()
    wm_log = [{"stage": "wm", **entry} for entry in start.log]
    return Alignment(transforms, wm_log + log, settings)


def path_loss_for(frames: list[Graph], ends: dict[str, SymmetryParams], template, task: str,
                  dtype: torch.dtype | None, options, accelerator, device: torch.device) -> nn.Module:
    """PathLoss (the whole state dict per step), or layered.LayeredPathLoss for --gradient-checkpointing and
    --fsdp (sharded over the accelerator's processes), on `device`."""
    if not (options.gradient_checkpointing or options.fsdp):
        path_loss = PathLoss(frames, ends, template, task, dtype).to_device(device)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        from .layered import LayeredPathLoss
        mesh = init_device_mesh(device.type, (accelerator.num_processes,)) if options.fsdp else None
        path_loss = LayeredPathLoss(frames, ends, template, task, dtype, checkpointing=options.gradient_checkpointing,
                                    mesh=mesh)
        path_loss = path_loss if mesh is not None else path_loss.to_device(device)  # FSDP placed the shards
    path_loss.soft_targets = options.soft_target_share(task)
    return path_loss


def endpoint_storage(path_loss) -> dict:
    """Bytes of frozen endpoint tensors one process stores, and of all of them."""
    local, total = path_loss.stored_bytes()
    return {"bytes_per_process": int(local), "bytes_total": int(total)}


def split_holdout(data, n: int | None, eos: int | None = None):
    """(the examples trained on, the `n` held out for choosing the returned parameters, the record of how), or
    (data, None, None).  Text: whole documents kept out of training, spread over the data (documents end with
    `eos`; sources/splits.held_out_documents), so that no held-out window is a neighbour of one trained on;
    independent examples (images, `self` samples) spread evenly, so that sorted data (an ImageFolder's classes) is
    covered.  n = None: min(DEFAULT_HOLDOUT, an eighth of the examples)."""
    from ..sources.eval_data import EvalData
    from ..sources.splits import held_out_documents
    total = len(data.inputs)
    n = min(DEFAULT_HOLDOUT, total // 8) if n is None else n
    if n == 0:
        return data, None, None
    if n >= total:
        raise OptionError(f"--holdout {n} keeps every one of the {total} training examples out of the optimisation; "
                          "lower --holdout (0 turns the selection off) or give more --train-data")
    fit, held, record = held_out_documents(data, n, eos)
    fit, held = torch.tensor(fit, dtype=torch.long), torch.tensor(held, dtype=torch.long)
    inputs = data.inputs[fit] if isinstance(data.inputs, Tensor) else data.inputs.select(fit)  # TokenWindows
    labels = data.labels
    return (EvalData(data.task, inputs, None if labels is None else labels[fit], data.info),
            EvalData(data.task, data.inputs[held], None if labels is None else labels[held], data.info), record)


def peak_memory(device: torch.device) -> dict:
    """Peak memory of this process so far: allocated CUDA memory on a GPU (since learning began), else the
    process's peak resident set (which includes loading the models)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        return {"what": "torch.cuda.max_memory_allocated", "GiB": round(peak / 2**30, 3)}
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"what": "peak RSS of the process", "GiB": round(rss / 2**30, 3)}


def on_main_process(compute, options):
    """compute() run by the main process alone; under `accelerate launch` the other processes wait for it and
    receive its result (pickled, one broadcast), so that every process holds the same object, bit for bit.
    What learned matching starts from (weight matching: the expensive search) is computed this way."""
    from .train_loop import make_accelerator
    accelerator = make_accelerator(options)  # initialises the process group under `accelerate launch`
    if accelerator.num_processes == 1:
        return compute()
    import torch.distributed as dist
    key = f"hf-rebasin-main-result-{next(_MAIN_RESULTS)}"
    store = dist.distributed_c10d._get_default_store()
    box = [None]
    if accelerator.is_main_process:
        box = [compute()]
        store.set(key, "ready")
    else:  # wait on the store, not in a collective: the search may outlast the process group's timeout
        store.wait([key], MAIN_RESULT_WAIT)
    dist.broadcast_object_list(box, src=0)
    return box[0]


_MAIN_RESULTS = itertools.count()  # every process calls on_main_process in the same order
# how long the other processes wait; if the main process fails, `accelerate launch` (torchrun) stops them at once
MAIN_RESULT_WAIT = datetime.timedelta(days=2)


def exact_digest(tensors: dict[str, Tensor]) -> str:
    """sha256 of the names, dtypes, shapes and every byte of the tensors (bit-for-bit comparison)."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        value = tensors[key].detach().cpu().contiguous()
        h.update(f"{key}{value.dtype}{tuple(value.shape)}".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def start_differences(per_process: list[dict]) -> list[str]:
    """What the processes do not agree on: one line per key whose value differs from process 0's."""
    return [f"{key} (process {', '.join(str(r) for r, got in enumerate(per_process) if got[key] != value)} "
            f"differs from process 0)"
            for key, value in per_process[0].items() if any(got[key] != value for got in per_process)]


def check_same_start(accelerator, start: dict) -> None:
    """Under `accelerate launch`: every process must start from the same models, matching and symmetry
    parameters (digests in `start`), else their trajectories would drift apart silently."""
    if accelerator.num_processes == 1:
        return
    import torch.distributed as dist
    per_process = [None] * accelerator.num_processes
    dist.all_gather_object(per_process, start)
    problems = start_differences(per_process)
    if problems:
        raise UserError("the processes of `accelerate launch` do not start learned matching from the same "
                        f"{'; '.join(problems)}: give every process the same models and matching")


def is_main_process() -> bool:
    """False in the other processes of an `accelerate launch` run (they stop after training)."""
    from accelerate import PartialState
    return PartialState().is_main_process


__all__ = ["PathLoss", "PathOfEnds", "learn", "trajectory_settings"]
