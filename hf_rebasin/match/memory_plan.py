"""Planning the memory of learned matching before its first step (language models).

The peak of one step is estimated from the shapes alone:

    held        the frozen endpoints in the learning precision (N x P x s) and the symmetry parameters with their
                gradient and AdamW's two moments (16 bytes each);
    weights     the transformed, interpolated copy and the intermediates autograd keeps of it: ~WHOLE_LAYER_COPIES
                of the layers' weights at the end of the forward (BACKWARD_LAYER_COPIES in the backward through the
                transforms, the peak of small batches) and ~WHOLE_OUTSIDE_COPIES of the transformed tensors outside
                them (the head; only the batch's rows of the token embedding are transformed); with checkpointing
                ~CHECKPOINTED_LAYER_COPIES of one layer's weights (the layer recomputed in the backward);
    per window  activations: ACTIVATION_VALUES values of s per token, layer and unit of width (d and the FFN's),
                or, checkpointed, CHECKPOINTED_VALUES per token and layer (the stream kept between layers); the
                logits and what the loss keeps of them, VOCAB_BYTES per token and vocabulary entry (the soft
                target, fp32, SOFT_TARGET_BYTES more).

The coefficients were measured with memory_count.count_step (the project's step on fake tensors) on Pythia
configs in bf16; tests/test_memory_plan.py checks the estimate against that count at 160M, 1B and 6.9B.

The plan keeps --learn-batch-size (the effective batch, and so the trajectory: the loss of a step is the mean over
its micro-batches either way) and chooses the micro-batch (by gradient accumulation) and gradient checkpointing
to fit the device's free memory (torch.cuda.mem_get_info), or --max-memory.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..errors import OptionError

GIB = 2**30
WHOLE_LAYER_COPIES = 3.2  # while the activations are held (the forward's end)
BACKWARD_LAYER_COPIES = 4.6  # in the backward through the transforms (the peak of small batches)
EXTRA_TRANSFORM_COPIES = 1.0  # for every transformed model beyond the first (N > 2 models)
WHOLE_OUTSIDE_COPIES = 0.5
CHECKPOINTED_LAYER_COPIES = 18  # of one layer's weights (measured)
ACTIVATION_VALUES = (10.75, 2.0)  # per unit of d, per unit of the FFN width (x 1.5 gated)
CHECKPOINTED_VALUES = 1.25  # per unit of d
VOCAB_BYTES = 12.1
SOFT_TARGET_BYTES = 4
HEADROOM = 0.9  # of the free memory the plan uses (the allocator's fragmentation, other processes' growth)
MIN_MICRO_TOKENS = 2048  # below this many tokens per micro-batch, checkpointing is preferred to more accumulation


class MemoryPlanError(OptionError):
    """Nothing fits the device's memory."""


@dataclass(frozen=True)
class StepShape:
    """What the memory of a step depends on, read from the canonical shapes."""

    n_models: int
    d_model: int
    ffn_dim: int
    glu: bool
    n_layers: int
    vocab: int
    model_parameters: int  # P, one model
    layer_parameters: int  # in the decoder layers
    outside_parameters: int  # outside the layers, transformed whole (all but the token embedding)
    learned_parameters: int
    transformed: int  # models whose weights a step transforms (two models: one, the relative path)


def learned_parameter_count(spec, n_learned: int) -> int:
    """The symmetry parameters of `n_learned` ends (built on fake tensors: no memory)."""
    from .memory_count import fake_tensors
    from .params import SymmetryParams
    with fake_tensors():
        end = SymmetryParams(spec, None)
    return n_learned * sum(p.numel() for p in end.parameters() if p.requires_grad)


def step_shape(spec, shapes: dict[str, tuple], n_models: int, method: str, refine: bool = False) -> StepShape:
    """The shape of a learned-matching step; refine: of a refinement step (match/refine.py), where the trained
    parameters are the merged model's weights (fp32 with their gradient and AdamW's moments: the same 16 bytes each)
    and the transformed copy is the model's autocast copy (the learned step's coefficients: an upper bound there)."""
    def numel(shape) -> int:
        n = 1
        for size in shape:
            n *= size
        return n
    layers = sum(numel(s) for k, s in shapes.items() if k.startswith("layers."))
    embedding = numel(shapes[f"embed.{spec.token_embedding}"]) if spec.token_embedding else 0
    total = sum(numel(s) for s in shapes.values())
    learned = n_models if method == "dual" else n_models - 1
    # a token's FFN activations: the dense FFN (a MoE's shared expert) and the top-k experts it is routed to (the MoE
    # figure is this count alone: the coefficients were measured on dense models)
    ffn = spec.ffn_dim + getattr(spec, "top_k", 0) * getattr(spec, "expert_dim", 0)
    trained = total if refine else learned_parameter_count(spec, learned)
    return StepShape(n_models, spec.d_model, ffn, spec.glu, spec.n_layers, spec.n_out, total, layers,
                     total - layers - embedding, trained, 1 if n_models == 2 or refine else learned)


def estimate_peak(shape: StepShape, *, micro_batch: int, seq_len: int, checkpointing: bool, value_bytes: int,
                  soft_targets: bool) -> int:
    """Estimated peak allocated bytes of one step at `micro_batch` windows of `seq_len` tokens (module docstring)."""
    s = value_bytes
    held = shape.n_models * shape.model_parameters * s + 16 * shape.learned_parameters
    per_d, per_ffn = ACTIVATION_VALUES
    ffn = shape.ffn_dim * (1.5 if shape.glu else 1.0)
    layer_values = per_d * shape.d_model + per_ffn * ffn  # per token and layer
    extra = EXTRA_TRANSFORM_COPIES * max(0, shape.transformed - 1) * shape.layer_parameters * s
    vocab = (VOCAB_BYTES + SOFT_TARGET_BYTES * soft_targets) * shape.vocab * (seq_len - 1)
    if checkpointing:
        weights = CHECKPOINTED_LAYER_COPIES * shape.layer_parameters / shape.n_layers * s + extra
        per_window = CHECKPOINTED_VALUES * shape.d_model * shape.n_layers * s * seq_len + vocab
        return int(held + weights + micro_batch * per_window)
    outside = WHOLE_OUTSIDE_COPIES * shape.outside_parameters * s + extra
    per_window = layer_values * shape.n_layers * s * seq_len + vocab
    forward = WHOLE_LAYER_COPIES * shape.layer_parameters * s + micro_batch * per_window
    backward = BACKWARD_LAYER_COPIES * shape.layer_parameters * s
    return int(held + outside + max(forward, backward))


@dataclass
class MemoryPlan:
    """The plan of a run (recorded in barrier.json as settings["memory_plan"])."""

    device: str
    free_bytes: int
    free_from: str  # "torch.cuda.mem_get_info" or "--max-memory"
    estimated_peak_bytes: int
    micro_batch: int
    accumulation: int
    gradient_checkpointing: bool
    effective_batch: int
    processes: int
    seq_len: int
    precision: str
    planned: bool = True

    def line(self) -> str:
        return (f"hf-rebasin: memory plan: ~{readable(self.estimated_peak_bytes)} peak of "
                f"{readable(self.free_bytes)} free on {self.device} ({self.free_from}): micro-batch "
                f"{self.micro_batch} x {self.accumulation} accumulation"
                f"{f' x {self.processes} processes' if self.processes > 1 else ''} = --learn-batch-size "
                f"{self.effective_batch}, gradient checkpointing {'on' if self.gradient_checkpointing else 'off'}")

    def to_dict(self) -> dict:
        return asdict(self)


def readable(size: int) -> str:
    return f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / 2**20:.0f} MiB"


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def choose(shape: StepShape, *, batch: int, processes: int, seq_len: int, value_bytes: int, soft_targets: bool,
           usable: int, min_accumulation: int = 1, checkpointing: bool = False) -> tuple[int, bool] | None:
    """(accumulation, checkpointing) that fits `usable` bytes, or None.  Preference: no checkpointing with the fewest
    micro-steps, unless they leave fewer than MIN_MICRO_TOKENS per micro-batch and checkpointing needs fewer."""
    options = [a for a in divisors(batch // processes) if a >= min_accumulation]

    def fits(accumulation: int, ckpt: bool) -> bool:
        micro = batch // (processes * accumulation)
        return estimate_peak(shape, micro_batch=micro, seq_len=seq_len, checkpointing=ckpt, value_bytes=value_bytes,
                             soft_targets=soft_targets) <= usable
    plain = next((a for a in options if fits(a, False)), None) if not checkpointing else None
    if plain is not None and (plain == options[0] or batch // (processes * plain) * seq_len >= MIN_MICRO_TOKENS):
        return plain, False
    checkpointed = next((a for a in options if fits(a, True)), None)
    if checkpointed is not None and (plain is None or checkpointed < plain):
        return checkpointed, True
    return None if plain is None else (plain, False)


def free_memory(device: torch.device, max_memory: int | None) -> tuple[int, str] | None:
    """(bytes the plan may use before the headroom, where the figure came from), or None on the CPU without
    --max-memory."""
    if max_memory is not None:
        return max_memory, "--max-memory"
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free), "torch.cuda.mem_get_info"


def too_little(shape: StepShape, *, seq_len: int, value_bytes: int, soft_targets: bool, free: int, source: str,
               device: str, processes: int) -> MemoryPlanError:
    """The one-line error when even one window per micro-step with checkpointing does not fit, naming what would."""
    smallest = estimate_peak(shape, micro_batch=1, seq_len=seq_len, checkpointing=True, value_bytes=value_bytes,
                             soft_targets=soft_targets)
    helps = []
    usable = HEADROOM * free
    shorter = next((t for t in (1024, 512, 256, 128, 64) if t < seq_len and estimate_peak(
        shape, micro_batch=1, seq_len=t, checkpointing=True, value_bytes=value_bytes,
        soft_targets=soft_targets) <= usable), None)
    if shorter:
        helps.append(f"--seq-len {shorter}")
    if soft_targets and estimate_peak(shape, micro_batch=1, seq_len=seq_len, checkpointing=True,
                                      value_bytes=value_bytes, soft_targets=False) <= usable:
        helps.append("--soft-targets 0")
    if value_bytes == 4:
        helps.append("--learn-precision bf16")
    endpoints = shape.n_models * shape.model_parameters * value_bytes
    helps.append(f"--fsdp under `accelerate launch` (the endpoints, {endpoints / GIB:.1f} GiB, sharded over GPUs)")
    if source != "--max-memory":
        helps.append("--max-memory if more memory is free than reported")
    given = "are allowed" if source == "--max-memory" else "are free"
    return MemoryPlanError(f"learned matching needs ~{smallest / GIB:.1f} GiB at one window per micro-step with "
                           f"gradient checkpointing, and {free / GIB:.1f} GiB {given} on {device} ({source})"
                           f"{' per process' if processes > 1 else ''}: try " + ", ".join(helps))


def plan_memory(shape: StepShape, *, device: str, batch: int, processes: int, seq_len: int, precision: str,
                soft_targets: bool, free: int, source: str, min_accumulation: int = 1,
                checkpointing: bool = False) -> MemoryPlan:
    """The plan for `free` bytes (MemoryPlanError when nothing fits)."""
    value_bytes = 2 if precision == "bf16" else 4
    chosen = choose(shape, batch=batch, processes=processes, seq_len=seq_len, value_bytes=value_bytes,
                    soft_targets=soft_targets, usable=int(HEADROOM * free), min_accumulation=min_accumulation,
                    checkpointing=checkpointing)
    if chosen is None:
        raise too_little(shape, seq_len=seq_len, value_bytes=value_bytes, soft_targets=soft_targets, free=free,
                         source=source, device=device, processes=processes)
    accumulation, ckpt = chosen
    micro = batch // (processes * accumulation)
    peak = estimate_peak(shape, micro_batch=micro, seq_len=seq_len, checkpointing=ckpt, value_bytes=value_bytes,
                         soft_targets=soft_targets)
    return MemoryPlan(device, free, source, peak, micro, accumulation, ckpt, batch, processes, seq_len, precision)


__all__ = ["MemoryPlan", "MemoryPlanError", "StepShape", "choose", "estimate_peak", "free_memory", "plan_memory",
           "step_shape"]


def plan_run(options, template, n_models: int, progress: bool = True, refine: bool = False) -> tuple:
    """(the options with the plan's --grad-accum and --gradient-checkpointing, the record for barrier.json) of a
    learned-matching run of `n_models` models like `template` (sources.models.Loaded; the first, widest, model),
    from its shapes before any weight is read; the plan is printed.  Not planned (and said so in the record):
    image models, --fsdp, the CPU without --max-memory, `accelerate launch` without --max-memory (every process
    must choose the same micro-batch)."""
    import dataclasses
    import os
    import sys

    from ..sources.eval_data import default_seq_len
    from .learned import autocast_dtype
    from .memory_count import meta_graph
    device = torch.device(options.resolved_device())
    processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
    max_memory = options.memory_bytes()
    skip = ("planned for language models only" if template.task != "causal-lm" else
            "--fsdp: the endpoints are sharded, not planned" if options.fsdp else
            "`accelerate launch`: planned only with --max-memory (the same on every process)"
            if processes > 1 and max_memory is None else None)
    free = None if skip else free_memory(device, max_memory)
    if free is None:
        return options, {"planned": False, "device": str(device),
                         "reason": skip or f"{device.type}: planned only with --max-memory"}
    precision = "bf16" if autocast_dtype(options, device) == torch.bfloat16 else "fp32"
    canonical = meta_graph(template)  # the shapes alone
    shape = step_shape(canonical.spec, {k: tuple(v.shape) for k, v in canonical.params.items()}, n_models,
                       options.method, refine=refine)
    plan = plan_memory(shape, device=str(device), batch=options.learn_batch_size, processes=processes,
                       seq_len=options.seq_len or default_seq_len(template), precision=precision,
                       soft_targets=refine or options.soft_target_share(template.task) > 0, free=free[0],
                       source=free[1], min_accumulation=options.grad_accum,
                       checkpointing=options.gradient_checkpointing)
    if refine and plan.gradient_checkpointing:
        raise MemoryPlanError(f"--refine-steps needs gradient checkpointing to fit {plan.micro_batch} window(s) per "
                              f"micro-step in {readable(plan.free_bytes)} ({plan.free_from}), which the refinement "
                              "does not have yet: lower --learn-batch-size or --seq-len, or use a larger GPU")
    if progress:
        print(plan.line().replace("memory plan:", "memory plan of the refinement:" if refine else "memory plan:"),
              file=sys.stderr, flush=True)
    options = dataclasses.replace(options, grad_accum=plan.accumulation,
                                  gradient_checkpointing=plan.gradient_checkpointing)
    return options, plan.to_dict()
