"""Learned and dual learned matching of N > 2 models: one learned group element per model.

The models are first brought into one frame by weight matching to a running average (multi.py);
the learned elements start at the identity on top of it (the "absorbed" start) and are trained on

    L( sum_i w_i t_i(theta_i) ),    w ~ Dirichlet(c, ..., c)   (c = 1 "uniform", c = 36 "narrow"),

with every endpoint frozen.  ``dual`` learns all N elements; ``lm`` keeps model 0 fixed (its frame
is the reference) and learns the other N - 1.  The returned transforms act on the ORIGINAL graphs.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from ..canonical import Graph
from ..cli import UserError
from .learned import (LearnSettings, PathLoss, _autocast_dtype, digest_data, digest_tensors, norm_modules,
                      strip_parameters, validate)
from .params import SymmetryParams, compose


class SimplexLoss(PathLoss):
    """Task loss at sum_i w_i t_i(theta_i); `lam` is the weight vector.  Ends are keyed "0" .. "N-1"."""

    def __init__(self, graphs: list[Graph], ends: dict[str, SymmetryParams], template, task: str,
                 autocast_dtype=None):
        nn.Module.__init__(self)
        from ..models import instantiate
        self.ends = nn.ModuleDict(ends)
        self.graphs = {str(k): g for k, g in enumerate(graphs)}
        self.template, self.task, self.autocast_dtype = template, task, autocast_dtype
        self.__dict__["model"] = strip_parameters(instantiate(graphs[0], template))
        self.__dict__["norms"] = norm_modules(self.model) if graphs[0].spec.scale_exact else []
        n = len(graphs)
        self.n_models = n
        self.vertices = [tuple(1.0 if j == i else 0.0 for j in range(n)) for i in range(n)]
        self.centre = tuple(1.0 / n for _ in range(n))

    @property
    def relative(self) -> bool:
        return False

    def weights(self, lam) -> list[float]:
        weights = [float(w) for w in lam]
        if len(weights) != self.n_models:
            raise ValueError(f"got {len(weights)} interpolation weights for {self.n_models} models")
        return weights


def learn_many(graphs: list[Graph], start: list, template, train, eval_data, settings: LearnSettings, *,
               progress: bool = True):
    """graphs: the original canonical graphs; start: their weight-matching transforms into one frame.
    Returns (transforms, log, settings_dict, accelerator)."""
    from ..symmetry import apply
    from .train_loop import load_checkpoint, make_accelerator, train_transforms
    if settings.init != "absorbed":
        raise UserError(f"--init {settings.init} is for two models; an N-way merge learns from the common frame "
                        "that weight matching finds (--init absorbed)")
    accelerator = make_accelerator(settings)
    validate(settings, accelerator.num_processes)
    fingerprint = {"models": [digest_tensors(g.params) for g in graphs], "train_data": digest_data(train),
                   "settings": settings.identity()}
    resume_state = load_checkpoint(settings.resume, fingerprint) if settings.resume else None
    aligned = [apply(g, t) for g, t in zip(graphs, start)]
    options = dict(orth=settings.orth, inv=settings.inv, learn_perms=settings.learn_perms)
    learned = range(len(graphs)) if settings.method == "dual" else range(1, len(graphs))
    try:
        ends = {str(k): SymmetryParams(graphs[k].spec, None, **options) for k in learned}
    except ValueError as error:
        raise UserError(str(error)) from error
    device = accelerator.device
    loss = SimplexLoss(aligned, ends, template, train.task, _autocast_dtype(settings, device)).to_device(device)
    log = train_transforms(loss, accelerator, train, eval_data, settings, fingerprint=fingerprint,
                           resume_state=resume_state, progress=progress)
    transforms = [compose(t, loss.ends[str(k)].export(), g.spec) if str(k) in loss.ends else t
                  for k, (g, t) in enumerate(zip(graphs, start))]
    out_settings = {"learned": {**dataclasses.asdict(settings), "lambda_dist": settings.lambdas,
                                "warmup": settings.warmup_steps},
                    "num_processes": accelerator.num_processes, "device": str(device),
                    "train_data": dict(train.info or {}), "notes": []}
    if train is eval_data:
        out_settings["notes"].append("learned matching was trained on the evaluation data itself (no --train-data): "
                                     "the reported barrier is an in-sample number")
    return transforms, log, out_settings, accelerator
