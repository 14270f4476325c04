"""What every form of the loss on the path shares (learned.PathLoss, the whole state dict per step, and
layered.LayeredPathLoss, layer by layer): the learnable group elements, the interpolation weights of a λ, the
task loss of a module run with given weights, and the frozen endpoints in their storage dtype."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.canonical import Graph
from ..core.symmetry import Transform
from ..sources.masking import IGNORE
from ..sources.models import lm_logits
from .blocks import blocked, from_recipe, tiled_bases, view_recipe
from .params import SymmetryParams


def strip_parameters(model: nn.Module, device=None) -> nn.Module:
    """Replace the module's own weights by empty tensors (on `device`, default their own): functional_call
    supplies every one of them, so the instance only contributes its code and buffers (saves one model copy)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                empty = torch.empty(0, dtype=param.dtype, device=device or param.device)
                module._parameters[name] = nn.Parameter(empty, requires_grad=False)
    return model


class PathOfEnds(nn.Module):
    """What every form of the loss on the path shares: the learnable group elements `ends` (keyed "0" .. "N-1";
    a model without an end is frozen as it is; they are the only trainable parameters), the interpolation
    weights of a λ, and the learned state that checkpoints and the held-out selection keep."""

    sharded = False  # the training loop runs a held-out estimate on every process only when sharded
    soft_targets = 0.0  # share of the endpoints' mixed prediction in the training target (forward)
    manual_sync = False  # DDP averages the gradients (else the loop calls sync_gradients)
    tied: dict = {}  # {parameter: parameter it is tied to} the state dicts leave out (Adapter.tied_names)

    def __init__(self, ends: dict[str, SymmetryParams], n_models: int):
        super().__init__()
        self.ends = nn.ModuleDict(ends)
        self.n_models = n_models
        self.vertices = [tuple(1.0 if j == i else 0.0 for j in range(n_models)) for i in range(n_models)]
        self.centre = tuple(1.0 / n_models for _ in range(n_models))

    def weights(self, lam) -> list[float]:
        """Interpolation weights: a λ for two models (weights 1-λ, λ), else a weight vector."""
        if isinstance(lam, (int, float)):
            return [1.0 - float(lam), float(lam)]
        weights = [float(w) for w in lam]
        if len(weights) != self.n_models:
            raise ValueError(f"got {len(weights)} interpolation weights for {self.n_models} models")
        return weights

    @property
    def sparse(self) -> bool:
        """Whether the loss takes the batch's distinct token ids (`rows`: only those embedding rows are transformed)."""
        return self.task == "causal-lm" and self.spec.token_embedding is not None

    @property
    def relative(self) -> bool:
        """Two-model dual with A's element free of permutations: train through the single-sided path with
        t_a^-1 t_b (an exact symmetry image of the dual path, at the cost of one transform)."""
        return (self.n_models == 2 and "0" in self.ends and "1" in self.ends
                and not self.ends["0"].has_permutations())

    def current_elements(self, device_type: str) -> dict[str, Transform]:
        """The group elements of this forward by end ("0" .. "N-1"; for the relative dual path only "1", t_a^-1 t_b),
        computed once, in fp32 even under autocast (their action on bf16 weights runs in the autocast dtype)."""
        with torch.autocast(device_type, enabled=False) if self.autocast_dtype else nullcontext():
            continuous = {k: end.continuous() for k, end in self.ends.items()}
            if self.relative:
                return {"1": self.ends["1"].element(continuous["1"].relative_to(continuous["0"]))}
            return {k: self.ends[k].element(c) for k, c in continuous.items()}

    def eps_and_write_factor(self, elements: dict[str, Transform], eps: list[float], weights: list[float]):
        """(the norm eps the model runs with, a factor for every residual write of the point, or None).

        The residual scale g is exact with the norm eps scaled by g^2, so the point sum_k w_k s_k W_k (s_k the
        scale of end k, 1 for a frozen one) needs eps_P = sum_k w_k eps_k s_k^2.  With learned (tensor) scales that
        is a device value the norms cannot take as their (host) eps without a sync; instead the model runs with
        E = sum_k w_k eps_k and every write of the point is divided by r = sqrt(eps_P / E): every read of the
        stream is through a norm, and norm(x / r; E) = x / sqrt(mean(x^2) + E r^2) = norm(x; eps_P), exactly."""
        scales = [elements[k].scale if k in elements else 1.0 for k in map(str, range(self.n_models))]
        if not any(isinstance(s, Tensor) for s in scales):
            return float(sum(w * e * float(s) ** 2 for w, e, s in zip(weights, eps, scales))), None
        plain = float(sum(w * e for w, e in zip(weights, eps)))
        scaled = sum(w * e * s ** 2 for w, e, s in zip(weights, eps, scales))
        # the value is exact; its gradient (the eps term's, ~eps / mean(x^2) of the scale's) is left out, as when
        # the eps was a host number: the trajectory stays what it was
        return plain, torch.rsqrt(scaled / plain).detach()

    def learned_state(self) -> dict[str, Tensor]:
        """The symmetry parameters (what checkpoints and the held-out selection keep)."""
        return self.ends.state_dict(prefix="ends.")

    def load_learned_state(self, state: dict[str, Tensor]) -> None:
        self.ends.load_state_dict({k.removeprefix("ends."): v for k, v in state.items()})

    def forward(self, inputs: Tensor, labels: Tensor | None, lam, rows: Tensor | None = None) -> Tensor:
        """The task loss at λ (or interpolation weights) on the batch.  `rows`: the batch's distinct token ids
        (the training loop finds them on the host, where that costs no sync; found here when not given).  With
        `soft_targets` s > 0, while gradients are on (training, not the held-out estimates): (1 - s) x the
        cross-entropy with the next token (label) + s x the cross-entropy with the endpoints' prediction mixed by the
        same weights, sum_k w_k softmax(logits_k), each endpoint run on the batch without gradient."""
        if self.sparse and rows is None:
            rows = torch.unique(inputs)
        target = None
        if self.soft_targets and torch.is_grad_enabled():
            with torch.no_grad():
                target = self.soft_target(inputs, self.weights(lam), rows)
        return self.task_loss(self.logits(inputs, lam, rows), inputs, labels, target)

    def soft_target(self, inputs: Tensor, weights: list[float], rows: Tensor | None) -> Tensor:
        """sum_k w_k softmax(logits_k) over the endpoints of nonzero weight, each run on its own (endpoint_logits), one
        at a time."""
        target = None
        for k, w in enumerate(weights):
            if w:
                term = w * self.endpoint_logits(inputs, k, rows).float().softmax(-1)
                target = term if target is None else target + term
        return target

    def endpoint_logits(self, inputs: Tensor, k: int, rows: Tensor | None) -> Tensor:
        """Endpoint k's predictions on the batch: the path's vertex k, which is endpoint k's frozen tensors as they
        are (the group acts exactly, so its element at k is the same function): subclasses run those without
        computing or applying any group element."""
        return self.logits(inputs, self.vertices[k], rows)

    def run_model(self, state: dict[str, Tensor], inputs: Tensor) -> Tensor:
        """self.model's predictions run with `state`: the logits of every next token but the last's (LMs), of the
        label (classifiers)."""
        from torch.func import functional_call
        tied = self.tied  # (strip_parameters undid the model's own ties)
        if tied:
            state = {**state, **{name: state[source] for name, source in tied.items() if source in state}}
        if self.task == "causal-lm":
            return functional_call(self.model, state, (), {"input_ids": inputs, "use_cache": False}).logits[:, :-1]
        if self.task == "masked-lm":  # every position's logits; the loss reads the masked ones (labels)
            return lm_logits(functional_call(self.model, state, (), {"input_ids": inputs}))
        return functional_call(self.model, state, (inputs,))

    def task_loss(self, logits: Tensor, inputs: Tensor, labels: Tensor | None, target: Tensor | None = None) -> Tensor:
        """Cross-entropy of the predictions with the next token (LMs) or the label, mixed with the cross-entropy with
        a `target` distribution (forward)."""
        log_p = logits.float().log_softmax(-1)
        truth = inputs[:, 1:] if self.task == "causal-lm" else labels
        hard = F.nll_loss(log_p.reshape(-1, log_p.shape[-1]), truth.reshape(-1), ignore_index=IGNORE)
        if target is None:
            return hard
        if self.task == "masked-lm":  # the soft target where a token is predicted
            chosen = (labels != IGNORE).to(log_p.dtype)
            soft = -((target * log_p).sum(-1) * chosen).sum() / chosen.sum().clamp_min(1.0)
            return (1.0 - self.soft_targets) * hard + self.soft_targets * soft
        soft = -(target * log_p).sum(-1).mean()
        return (1.0 - self.soft_targets) * hard + self.soft_targets * soft


def stacked(graphs: list[Graph], device) -> tuple[dict[str, Tensor], list[Graph]]:
    """(every tensor of the endpoints on `device`, stacked along a leading model axis; the endpoints as graphs of views
    of those stacks): no second copy (a key or a block at a time), the layout of `stored` (a layer's blocks stacked
    whole, each endpoint's tensors views of its own), and one batched forward runs every endpoint at once
    (`batched_soft_target`)."""
    first, n = graphs[0].params, len(graphs)
    stacks, views, bases, blocks = {}, [{} for _ in graphs], {}, tiled_bases(first)
    for key, value in first.items():
        recipe = view_recipe(value) if id(value._base) in blocks else None
        if recipe is None or any(view_recipe(g.params[key]) != recipe for g in graphs[1:]):
            stacks[key] = torch.stack([g.params[key].to(device) for g in graphs])
            for k in range(n):
                views[k][key] = stacks[key][k]
            continue
        if id(value._base) not in bases:
            bases[id(value._base)] = torch.stack([g.params[key]._base.to(device) for g in graphs])
        base = bases[id(value._base)]
        stacks[key] = from_recipe(base, recipe, lead=((n, base.stride(0)),))
        for k in range(n):
            views[k][key] = from_recipe(base[k], recipe)
    return stacks, [g.replace(v) for g, v in zip(graphs, views)]


def batched_soft_target(path: PathOfEnds, stacks: dict[str, Tensor], first: Graph, inputs: Tensor,
                        weights: list[float]) -> Tensor:
    """PathOfEnds.soft_target with every endpoint run by one batched forward: torch.func.vmap over the model axis of
    `stacks` (the adapter's conversion and the model's forward, each op once for all endpoints instead of once per
    endpoint); the same values to float rounding (the batched products may sum in another order).  The endpoints
    share one norm eps (`first`'s; the caller checks)."""
    from torch.func import vmap
    adapter, config, dtype = path.template.adapter, path.template.config, path.autocast_dtype

    def logits(params: dict[str, Tensor]) -> Tensor:
        state_dict, _ = adapter.from_canonical(first.replace(params), config)
        return path.run_model(state_dict, inputs)

    with torch.autocast(inputs.device.type, dtype=dtype) if dtype else nullcontext():
        for module, attr in path.norms:
            setattr(module, attr, first.norm_eps)
        batched = vmap(logits)(stacks)
    # one endpoint's probabilities at a time (fp32 straight from its logits), added into the mixture in place: the
    # peak is the logits, the mixture and one endpoint's probabilities, as when the endpoints ran one by one
    (first_weight, k0), *others = [(w, k) for k, w in enumerate(weights) if w]
    target = torch.softmax(batched[k0], -1, dtype=torch.float32).mul_(first_weight)
    for w, k in others:
        target.add_(torch.softmax(batched[k], -1, dtype=torch.float32), alpha=w)
    return target


def stored(graph: Graph, dtype: torch.dtype | None) -> Graph:
    """The graph with its floating-point tensors in `dtype` (kept when None), contiguous, and each layer's reads and
    writes in one block each (blocks.blocked; a layer at a time): the whole model and the layered path
    (FrozenTensors) hold one layout, so that their products (action.py), whose CPU rounding depends on the layout,
    give the same steps."""
    def kept(v: Tensor) -> Tensor:  # one copy at most (`to` keeps a tensor of the same dtype as it is)
        if not v.is_floating_point():
            return v
        return v.contiguous() if dtype in (None, v.dtype) else v.to(dtype, memory_format=torch.contiguous_format)
    parts: dict[str, dict[str, Tensor]] = {}
    for key, value in graph.params.items():
        parts.setdefault(".".join(key.split(".")[:2]) if key.startswith("layers.") else "", {})[key] = value
    params: dict[str, Tensor] = {}
    for part in parts.values():
        params.update(blocked({k: kept(v) for k, v in part.items()}))
    return graph.replace({k: params[k] for k in graph.params})
