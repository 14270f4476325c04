"""Refinement after merging (``merge --refine-steps N``): every weight of the merged point (the midpoint of two
models, the centroid of N, or the point --alpha names) is trained to predict what the endpoints' ensemble predicts,
the average of their next-token (or label) distributions weighted as the merged point weights the models,

    loss(θ) = CE(p_θ, Σ_k w_k softmax(f_k)) = KL(ensemble ‖ p_θ) + the ensemble's entropy,

on the learned methods' data (`self` samples by default, or --train-data).  It is the learned-matching loop
(train_loop.train_transforms: the step plan, AdamW with warmup and cosine decay, accumulation, accelerate's data
parallelism, checkpoints every K steps / M minutes / at Ctrl-C, --resume, the held-out selection of the returned
weights) driven with a module that trains the merged model's own parameters instead of symmetry parameters:
RefineLoss has the interface of path.PathOfEnds.  The merged model is trained in its class's parameters (a stock
module, fp32 master weights, the forward under bf16 autocast where learned matching's would be), so the weights
exported are the weights trained.  Its held-out estimates are on the next token, as learned matching's are: at a
vertex of the "path" the endpoint's loss, anywhere else the refined model's."""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch
from torch import Tensor, nn

from ..errors import UserError
from .path import PathOfEnds

REFINE_STAGE = "refine"  # the "method" of the refinement's fingerprint and checkpoint names (refine-<hash>-stepN.pt)


class RefineLoss(PathOfEnds):
    """The ensemble-distillation loss of the merged `model` (trainable) against frozen `endpoints`, mixed with
    `weights` (the merged point's).  While gradients are on (the training steps) the target is the ensemble and the
    step's λ is not used; without gradients (held-out estimates) the loss is on the next token (label): at a vertex
    the endpoint's, elsewhere the model's."""

    sparse = False  # the whole model is trained: no rows of the embedding are skipped

    def __init__(self, model: nn.Module, endpoints: list[nn.Module], weights: list[float], task: str,
                 autocast_dtype: torch.dtype | None = None):
        super().__init__({}, len(endpoints))
        self.model, self.task, self.autocast_dtype = model, task, autocast_dtype
        self.endpoints = nn.ModuleList(endpoints)
        for p in self.endpoints.parameters():
            p.requires_grad_(False)
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.mix = [float(w) for w in weights]
        self.soft_targets = 1.0
        self.model_parameters = sum(p.numel() for p in model.parameters())

    def learned_state(self) -> dict[str, Tensor]:
        """The merged model's weights (what checkpoints and the held-out selection keep)."""
        return self.model.state_dict(prefix="model.")

    def load_learned_state(self, state: dict[str, Tensor]) -> None:
        self.model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})

    def stored_bytes(self) -> tuple[int, int]:
        total = sum(p.numel() * p.element_size() for p in self.endpoints.parameters())
        return total, total

    def _run(self, module: nn.Module, inputs: Tensor) -> Tensor:
        dtype = self.autocast_dtype
        with torch.autocast(inputs.device.type, dtype=dtype) if dtype else nullcontext():
            if self.task == "causal-lm":
                return module(input_ids=inputs, use_cache=False).logits[:, :-1]
            return module(inputs)

    def endpoint_logits(self, inputs: Tensor, k: int, rows: Tensor | None) -> Tensor:
        return self._run(self.endpoints[k], inputs)

    def ensemble(self, inputs: Tensor) -> Tensor:
        """Σ_k w_k softmax(f_k): the endpoints' mixed prediction (PathOfEnds.soft_target), fp32, without gradient."""
        with torch.no_grad():
            return self.soft_target(inputs, self.mix, None)

    def forward(self, inputs: Tensor, labels: Tensor | None, lam, rows: Tensor | None = None) -> Tensor:
        if torch.is_grad_enabled():
            target = self.ensemble(inputs)
            return self.task_loss(self._run(self.model, inputs), inputs, labels, target)
        weights = self.weights(lam)
        vertex = [k for k, w in enumerate(weights) if w == 1.0]
        module = self.endpoints[vertex[0]] if vertex else self.model
        return self.task_loss(self._run(module, inputs), inputs, labels)


def refine_settings(options, task: str) -> dict:
    """The settings that determine the refinement's trajectory (a resumed run must match them)."""
    return {"method": REFINE_STAGE, "steps": options.refine_steps, "lr": options.refine_lr,
            "batch_size": options.learn_batch_size, "seed": options.learn_seed, "precision": options.learn_precision,
            "warmup": loop_options(options).warmup_steps(), "holdout": options.holdout,
            "eval_every": options.eval_every, "target": "ensemble", "task": task}


def loop_options(options):
    """The options the training loop reads, with the refinement's steps and learning rate."""
    import dataclasses
    warmup = None if options.warmup is None else min(options.warmup, options.refine_steps - 1)
    return dataclasses.replace(options, steps=options.refine_steps, lr=options.refine_lr, warmup=warmup)


def refine(point, template, endpoint_loader, n_models: int, weights: list[float], train, eval_data, options, *,
           progress: bool = True, on_step=None) -> tuple[nn.Module, dict]:
    """Train the merged `point` (a graph, or an average of checkpoints) towards the endpoints' ensemble;
    endpoint_loader(k) gives endpoint k (run_data.endpoint_loader).  Returns (the refined model, fp32 on the host
    of the main process, in eval mode; its record for barrier.json).  Under `accelerate launch` every process
    must start from the same point (refused otherwise)."""
    from ..sources.models import instantiate
    from .learned import (
        autocast_dtype,
        check_same_start,
        digest_data,
        digest_tensors,
        exact_digest,
        peak_memory,
        split_holdout,
        tf32_matmuls,
    )
    from .train_loop import load_checkpoint, make_accelerator, train_transforms, training_device
    if train is None:
        raise UserError("--refine-steps trains on data and got none: pass --train-data")
    accelerator = make_accelerator(options)
    device = training_device(options.device, accelerator.num_processes, accelerator.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dtype = autocast_dtype(options, device)
    model = instantiate(point, template).float()
    endpoints = [endpoint_loader(k).to(dtype or torch.float32).eval() for k in range(n_models)]  # the learning dtype
    loss = RefineLoss(model, endpoints, weights, train.task, dtype).to(device)
    fingerprint = {"models": [digest_tensors(model.state_dict())], "train_data": digest_data(train),
                   "settings": refine_settings(options, train.task)}
    check_same_start(accelerator, {"point": exact_digest(model.state_dict())})
    resume_state = load_checkpoint(options.resume, fingerprint) if options.resume else None
    from ..sources.splits import eos_token_id
    train, holdout, held_record = split_holdout(train, options.holdout,
                                                eos_token_id(template) if train.task == "causal-lm" else None)
    tf32 = device.type == "cuda" and dtype is None
    start = time.perf_counter()
    with tf32_matmuls(tf32):
        log = train_transforms(loss, accelerator, train, eval_data, loop_options(options), fingerprint=fingerprint,
                               resume_state=resume_state, progress=progress, on_step=on_step, holdout=holdout,
                               device=device)
    seconds = time.perf_counter() - start
    accelerator.wait_for_everyone()
    # predicted tokens (a window of T tokens predicts T - 1), or images
    per_step = options.learn_batch_size * (train.inputs.shape[1] - 1 if train.task == "causal-lm" else 1)
    record = {"steps": options.refine_steps, "lr": options.refine_lr, "batch_size": options.learn_batch_size,
              "warmup": loop_options(options).warmup_steps(), "target": "ensemble", "weights": loss.mix,
              "tokens" if train.task == "causal-lm" else "images": options.refine_steps * per_step,
              "train_s": seconds, "resumed_from": resume_state["path"] if resume_state else None,
              "precision": "bf16" if dtype == torch.bfloat16 else "fp32", "tf32": tf32, "device": str(device),
              "num_processes": accelerator.num_processes, "trained_parameters": loss.model_parameters,
              "train_data": dict(train.info or {}), "holdout": held_record, "peak_memory": peak_memory(device),
              "log": log}
    if not accelerator.is_main_process:
        accelerator.end_training()
    return model.to("cpu").eval(), record


def resumes_refinement(resume: str | None) -> bool:
    """Whether --resume names the refinement's checkpoint (a file) or a folder holding one: the matching before it
    then runs from its start (a learned method's own checkpoints are not read)."""
    from pathlib import Path

    from .train_loop import read_checkpoint
    if resume is None:
        return False
    path = Path(resume)
    if path.is_dir():
        return any(path.glob(f"{REFINE_STAGE}-*-step*.pt"))
    return read_checkpoint(path)["fingerprint"]["settings"].get("method") == REFINE_STAGE if path.is_file() else False


__all__ = ["RefineLoss", "refine", "resumes_refinement"]
