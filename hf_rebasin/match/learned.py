"""Learned matching: ``--method lm`` (single-sided, Theus et al.) and ``--method dual`` (LMC-DM, Li & Shen).

Both start from the weight-matching solution and train continuous symmetry parameters
(params.py) on the task loss along the straight path,

    theta(l) = (1 - l) * pi_A(A) + l * pi_B(B),    l ~ U(0, 1) ("uniform") or U(0.4, 0.6) ("narrow"),

with the endpoints frozen.  ``lm`` learns pi_B only (pi_A is A's weight-matching transform);
``dual`` learns both.  With the default ``--init absorbed`` the weight-matching transforms are
applied to the graphs first and the learned elements start at the identity; the transform
returned is the product compose(wm, learned), so applying it to the ORIGINAL graph gives the
learned point.  ``--init plain`` starts the parameters at the weight-matching values instead.

The loss is computed inside the forward: the transformed, interpolated canonical graph is
exported with the adapter's ``from_canonical`` (plain tensor ops) and run through one module
instance (its own weights dropped) with ``torch.func.functional_call``.

Two exact shortcuts keep a step cheap:
* the group acts linearly on the weights, so the dual path (1-l) t_a(A) + l t_b(B) is t_a applied
  to (1-l) A + l (t_a^-1 t_b)(B): dual trains through the latter (same function at every l, one
  transform per step instead of two; not with --learn-perms or a start that permutes A);
* only the token-embedding rows of the batch are transformed (the others are never looked up).
Cost: transforming the weights takes ~ d·P flops per pass (d the width, P the parameters) against
~ T·P for the model on T tokens, so an lm or dual step costs about 1 + d/T plain training steps
(measured 1.9 at T = d on a Pythia-70m shape; benchmarks/step_time.py).

Memory: this is NOT layer by layer.  Every step materialises a full transformed state dict (plus
the intermediates of the transform chain and the interpolated point, which autograd keeps for the
backward) on top of the two frozen endpoints: measured on a Pythia-70m-shaped pair at 4 x 128 tokens,
autograd keeps 650 MiB for a dual step against 378 MiB for a plain training step of one model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..canonical import Graph, interpolate
from ..cli import UserError
from ..symmetry import apply
from .params import INV_KINDS, ORTH_KINDS, SymmetryParams, compose, relative_continuous

METHOD_NAMES = ("lm", "dual")
LAMBDA_RANGES = {"uniform": (0.0, 1.0), "narrow": (0.4, 0.6)}
DEFAULT_LAMBDA = {"lm": "narrow", "dual": "uniform"}  # Theus et al. / Li & Shen
# N > 2 models: weights ~ Dirichlet(c, ..., c).  c = 1 is uniform on the simplex; c = 36 gives two models
# Beta(36, 36), whose spread (std 0.058) is that of U(0.4, 0.6)
DIRICHLET_CONCENTRATION = {"uniform": 1, "narrow": 36}


@dataclass
class LearnSettings:
    method: str = "dual"
    steps: int = 300
    lr: float = 3e-3
    warmup: int | None = None  # default: 10% of the steps
    batch_size: int = 64  # global examples per optimiser step, over all processes and accumulation
    grad_accum: int = 1
    init: str = "absorbed"
    orth: str = "cayley"
    inv: str = "polar"
    lambda_dist: str | None = None  # default per method
    learn_perms: bool = False
    seed: int = 0
    eval_every: int = 50
    eval_subset: int = 32
    eval_batch_size: int = 8
    checkpoint_every: int = 0
    checkpoint_dir: str = "runs/learned"
    resume: str | None = None
    precision: str = "auto"  # auto: bf16 autocast on CUDA (where supported), fp32 elsewhere
    device: str | None = None  # "cpu" forces the CPU; None: what accelerate picks
    train_data: str | None = None

    @property
    def lambdas(self) -> str:
        return self.lambda_dist or DEFAULT_LAMBDA[self.method]

    @property
    def warmup_steps(self) -> int:
        return max(1, self.steps // 10) if self.warmup is None else self.warmup

    def identity(self) -> dict:
        """The settings that determine the trajectory (a resumed run must match them)."""
        keep = ("method", "steps", "lr", "batch_size", "init", "orth", "inv", "learn_perms", "seed", "precision")
        out = {k: getattr(self, k) for k in keep}
        out.update(lambda_dist=self.lambdas, warmup=self.warmup_steps)
        return out


def add_learned_arguments(parser) -> None:
    g = parser.add_argument_group("learned matching (--method lm / dual)")
    g.add_argument("--steps", type=int, default=LearnSettings.steps, help="optimiser steps (default %(default)s)")
    g.add_argument("--lr", type=float, default=LearnSettings.lr, help="AdamW learning rate (default %(default)s)")
    g.add_argument("--warmup", type=int, help="linear warmup steps before the cosine decay (default 10%% of --steps)")
    g.add_argument("--learn-batch-size", type=int, default=LearnSettings.batch_size,
                   help="examples per optimiser step, summed over processes and accumulation (default %(default)s)")
    g.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation micro-steps (default 1)")
    g.add_argument("--init", choices=("absorbed", "plain"), default="absorbed",
                   help="absorbed: apply the weight-matching transforms first, learn from the identity; "
                        "plain: parameters start at the weight-matching values (default absorbed)")
    g.add_argument("--orth", choices=ORTH_KINDS, default="cayley", help="orthogonal parameterisation (default cayley)")
    g.add_argument("--inv", choices=INV_KINDS, default="polar",
                   help="parameterisation of the per-head invertible maps (default polar)")
    g.add_argument("--lambda-dist", choices=tuple(LAMBDA_RANGES),
                   help="λ per step: uniform U(0,1) or narrow U(0.4,0.6) (default: narrow for lm, uniform for dual)")
    g.add_argument("--learn-perms", action="store_true",
                   help="also learn head (KV-group) and FFN permutations, straight-through (Sinkhorn backward)")
    g.add_argument("--train-data", help="training data for lm/dual, same forms as --data "
                                        "(default: --match-data, else --data; pass a separate split!)")
    g.add_argument("--max-train-tokens", type=int, help="cap on training tokens (LMs; default all)")
    g.add_argument("--max-train-examples", type=int, help="cap on training images (default all)")
    g.add_argument("--eval-every", type=int, default=LearnSettings.eval_every,
                   help="steps between held-out midpoint-barrier estimates shown in the bar (0: off; default %(default)s)")
    g.add_argument("--eval-subset", type=int, default=LearnSettings.eval_subset,
                   help="held-out examples (windows/images) for that estimate (default %(default)s)")
    g.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every K steps (0: only on Ctrl-C)")
    g.add_argument("--checkpoint-dir", default=LearnSettings.checkpoint_dir, help="checkpoint folder (default %(default)s)")
    g.add_argument("--resume", help="resume from a checkpoint file (or the newest one in a folder)")
    g.add_argument("--learn-seed", type=int, default=0, help="seed of the data order and λ draws (default 0)")
    g.add_argument("--learn-precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="autocast of the model forward: auto = bf16 on CUDA, fp32 on CPU")


def settings_from_args(args, method: str) -> LearnSettings:
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return LearnSettings(
        method=method, steps=get("steps", LearnSettings.steps), lr=get("lr", LearnSettings.lr), warmup=get("warmup"),
        batch_size=get("learn_batch_size", LearnSettings.batch_size), grad_accum=get("grad_accum", 1),
        init=get("init", "absorbed"), orth=get("orth", "cayley"), inv=get("inv", "polar"),
        lambda_dist=get("lambda_dist"), learn_perms=bool(get("learn_perms", False)), seed=get("learn_seed", 0),
        eval_every=get("eval_every", LearnSettings.eval_every), eval_subset=get("eval_subset", LearnSettings.eval_subset),
        eval_batch_size=get("batch_size", 8), checkpoint_every=get("checkpoint_every", 0),
        checkpoint_dir=get("checkpoint_dir", LearnSettings.checkpoint_dir), resume=get("resume"),
        precision=get("learn_precision", "auto"), device=get("device"), train_data=get("train_data"))


def validate(s: LearnSettings, num_processes: int = 1) -> None:
    """Raise UserError for settings that cannot work, before any heavy work is done."""
    problems = []
    if s.method not in METHOD_NAMES:
        problems.append(f"method {s.method!r} is not a learned method ({', '.join(METHOD_NAMES)})")
    if not isinstance(s.steps, int) or not 1 <= s.steps <= 10_000_000:
        problems.append(f"--steps must be an integer in [1, 10000000], got {s.steps}")
    if not (isinstance(s.lr, (int, float)) and math.isfinite(s.lr) and 0 < s.lr <= 1):
        problems.append(f"--lr must be in (0, 1], got {s.lr} (symmetry parameters are angles and log-scales; "
                        "1e-3 .. 1e-2 is typical)")
    if s.warmup is not None and not 0 <= s.warmup < max(1, s.steps):
        problems.append(f"--warmup must be in [0, --steps), got {s.warmup}")
    if s.grad_accum < 1:
        problems.append(f"--grad-accum must be at least 1, got {s.grad_accum}")
    if s.batch_size < 1:
        problems.append(f"--learn-batch-size must be at least 1, got {s.batch_size}")
    elif s.grad_accum >= 1 and s.batch_size % (s.grad_accum * num_processes):
        problems.append(f"--learn-batch-size {s.batch_size} is not divisible by --grad-accum ({s.grad_accum}) × "
                        f"processes ({num_processes}); every micro-batch must have the same size")
    if s.init not in ("absorbed", "plain"):
        problems.append(f"--init must be absorbed or plain, got {s.init!r}")
    if s.orth not in ORTH_KINDS:
        problems.append(f"--orth must be one of {', '.join(ORTH_KINDS)}, got {s.orth!r}")
    if s.inv not in INV_KINDS:
        problems.append(f"--inv must be one of {', '.join(INV_KINDS)}, got {s.inv!r}")
    if s.lambda_dist is not None and s.lambda_dist not in LAMBDA_RANGES:
        problems.append(f"--lambda-dist must be one of {', '.join(LAMBDA_RANGES)}, got {s.lambda_dist!r}")
    if s.precision not in ("auto", "bf16", "fp32"):
        problems.append(f"--learn-precision must be auto, bf16 or fp32, got {s.precision!r}")
    for name in ("eval_every", "eval_subset", "checkpoint_every"):
        if getattr(s, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(s, name)}")
    if problems:
        raise UserError("; ".join(problems))


# --- the loss on the path ------------------------------------------------------------------------

def strip_parameters(model: nn.Module) -> nn.Module:
    """Replace the module's own weights by empty tensors: functional_call supplies every one of them,
    so the instance only contributes its code and buffers (saves one model copy of memory)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(param.new_empty(0), requires_grad=False)
    return model


def norm_modules(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of every norm epsilon in the model (LayerNorm.eps, RMSNorm.variance_epsilon)."""
    out = []
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            out.append((module, "eps"))
        elif isinstance(getattr(module, "variance_epsilon", None), float):
            out.append((module, "variance_epsilon"))
    return out


class PathLoss(nn.Module):
    """Task loss at theta(l); the learnable group elements are the only parameters (what DDP averages)."""

    def __init__(self, graph_a: Graph, graph_b: Graph, ends: dict[str, SymmetryParams], template, task: str,
                 autocast_dtype: torch.dtype | None = None):
        super().__init__()
        from ..models import instantiate
        self.ends = nn.ModuleDict(ends)
        self.graphs = {"a": graph_a, "b": graph_b}
        self.template, self.task, self.autocast_dtype = template, task, autocast_dtype
        self.__dict__["model"] = strip_parameters(instantiate(graph_a, template))  # not a submodule
        self.__dict__["norms"] = norm_modules(self.model) if graph_a.spec.scale_exact else []

    n_models = 2
    vertices = (0.0, 1.0)  # the endpoints and the midpoint, as `lam` values (for the held-out estimate)
    centre = 0.5

    def weights(self, lam) -> list[float]:
        return [1.0 - float(lam), float(lam)]

    def to_device(self, device) -> "PathLoss":
        self.to(device)
        self.model.to(device)
        self.graphs = {k: g.replace({n: v.to(device) for n, v in g.params.items()}) for k, g in self.graphs.items()}
        return self

    def endpoint(self, name: str, graphs: dict | None = None) -> Graph:
        graph = (graphs or self.graphs)[name]
        return self.ends[name].apply(graph) if name in self.ends else graph

    @property
    def relative(self) -> bool:
        """Dual with A's element free of permutations: train through the single-sided path with
        t_a^-1 t_b (an exact symmetry image of the dual path, at the cost of one transform)."""
        return ("a" in self.ends and not self.ends["a"].has_permutations()
                and not self.ends["b"].has_learned_permutations())

    def end_graphs(self, graphs: dict[str, Graph]) -> list[Graph]:
        if self.relative:
            a, b = self.ends["a"], self.ends["b"]
            relative = relative_continuous(a._continuous(), b._continuous(), b.spec)
            return [graphs["a"], b.apply(graphs["b"], relative)]
        return [self.endpoint(name, graphs) for name in graphs]

    def point(self, lam, rows: Tensor | None = None) -> Graph:
        """The point of the path that is trained on.  With `rows` (the token ids of the batch) only those rows
        of the token embedding are transformed and interpolated: the others are never looked up, so the
        loss is the same, at T·d² instead of V·d² for the embedding."""
        first = next(iter(self.graphs.values()))
        key = f"embed.{first.spec.token_embedding}"
        graphs = self.graphs
        if rows is not None:
            graphs = {k: g.replace({**g.params, key: g.params[key][rows]}) for k, g in graphs.items()}
        point = interpolate(self.end_graphs(graphs), self.weights(lam))
        if rows is not None:  # unused rows: the first model's own (any value would do)
            full = first.params[key].index_put((rows,), point.params[key])
            point = point.replace({**point.params, key: full})
        return point

    def forward(self, inputs: Tensor, labels: Tensor | None, lam: float) -> Tensor:
        from torch.func import functional_call
        sparse = self.task == "causal-lm" and next(iter(self.graphs.values())).spec.token_embedding is not None
        point = self.point(lam, torch.unique(inputs) if sparse else None)
        state_dict, _ = self.template.adapter.from_canonical(point, self.template.config)
        for module, attr in self.norms:  # the residual scale g is exact only with eps scaled by g^2
            setattr(module, attr, point.norm_eps)
        device = inputs.device
        autocast = torch.autocast(device.type, dtype=self.autocast_dtype) if self.autocast_dtype else _nothing()
        with autocast:
            if self.task == "causal-lm":
                out = functional_call(self.model, state_dict, (), {"input_ids": inputs, "use_cache": False})
                logits = out.logits[:, :-1].float()
                return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), inputs[:, 1:].reshape(-1))
            logits = functional_call(self.model, state_dict, (inputs,)).float()
            return F.cross_entropy(logits, labels)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# --- fingerprints (for resume) -----------------------------------------------------------------

def digest_tensors(tensors: dict[str, Tensor]) -> str:
    """A cheap content hash: names, shapes, float64 sums and a strided sample of every tensor."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        v = tensors[key].detach().cpu()
        flat = v.reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].double()
        h.update(f"{key}{tuple(v.shape)}{float(flat.double().sum()):.10e}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def digest_data(data) -> str:
    tensors = {"inputs": data.inputs}
    if data.labels is not None:
        tensors["labels"] = data.labels
    return digest_tensors(tensors)


# --- the method ----------------------------------------------------------------------------------

def _autocast_dtype(s: LearnSettings, device: torch.device) -> torch.dtype | None:
    if s.precision == "fp32":
        return None
    if s.precision == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError("--learn-precision bf16: this GPU does not support bfloat16; use fp32")
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None


def starting_points(a: Graph, b: Graph, wm, s: LearnSettings):
    """(graph_a, graph_b, start_a, start_b): the graphs the learned elements act on and where each
    learned element starts (None: the identity).  For lm, A is frozen as apply(A, wm.transform_a)."""
    if s.init == "absorbed":
        ga, gb = apply(a, wm.transform_a), apply(b, wm.transform_b)
        return ga, gb, None, None
    ga = apply(a, wm.transform_a) if s.method == "lm" else a
    return ga, b, (None if s.method == "lm" else wm.transform_a), wm.transform_b


def learn_transforms(a: Graph, b: Graph, template, train, eval_data, settings: LearnSettings, *,
                     progress: bool = True, on_step=None, wm=None, wm_rounds: int = 10):
    """Learned (lm) or dual learned (dual) matching; returns MatchResult(t_a, t_b, log, settings) whose
    transforms act on the ORIGINAL graphs a and b."""
    from . import MatchResult
    from .train_loop import load_checkpoint, make_accelerator, train_transforms
    from .weight import weight_matching
    accelerator = make_accelerator(settings)
    validate(settings, accelerator.num_processes)
    fingerprint = {"models": [digest_tensors(a.params), digest_tensors(b.params)], "train_data": digest_data(train),
                   "settings": settings.identity()}
    resume_state = load_checkpoint(settings.resume, fingerprint) if settings.resume else None

    if wm is None:
        wm = weight_matching(a, b, max_rounds=wm_rounds, progress=progress and accelerator.is_main_process)
    graph_a, graph_b, start_a, start_b = starting_points(a, b, wm, settings)
    options = dict(orth=settings.orth, inv=settings.inv, learn_perms=settings.learn_perms)
    try:
        ends = {"b": SymmetryParams(b.spec, start_b, **options)}
        if settings.method == "dual":
            ends["a"] = SymmetryParams(a.spec, start_a, **options)
    except ValueError as error:
        raise UserError(str(error)) from error
    device = accelerator.device
    path_loss = PathLoss(graph_a, graph_b, ends, template, train.task, _autocast_dtype(settings, device))
    path_loss.to_device(device)

    log = train_transforms(path_loss, accelerator, train, eval_data, settings, fingerprint=fingerprint,
                           resume_state=resume_state, progress=progress, on_step=on_step)

    learned = {name: end.export() for name, end in path_loss.ends.items()}
    if settings.init == "absorbed":
        t_a = compose(wm.transform_a, learned["a"], a.spec) if "a" in learned else wm.transform_a
        t_b = compose(wm.transform_b, learned["b"], b.spec)
    else:
        t_a = learned.get("a", wm.transform_a)
        t_b = learned["b"]
    out_settings = {"learned": {**dataclasses.asdict(settings), "lambda_dist": settings.lambdas,
                                "warmup": settings.warmup_steps},
                    "wm": wm.settings, "num_processes": accelerator.num_processes, "device": str(device),
                    "train_data": dict(train.info or {}), "notes": []}
    if train is eval_data:
        out_settings["notes"].append("learned matching was trained on the evaluation data itself (no --train-data): "
                                     "the reported barrier is an in-sample number")
    wm_log = [{"stage": "wm", **entry} for entry in wm.log]
    return MatchResult(t_a, t_b, wm_log + log, out_settings), accelerator


def training_data(settings: LearnSettings, cli_args, template, fallback, eval_data, progress: bool = True):
    """The data learned matching trains on: --train-data, else `fallback` (the match data); warns when that
    is the evaluation data itself."""
    method = settings.method
    train = fallback
    if settings.train_data:
        from ..merge import load_eval_data
        get = lambda name, default=None: getattr(cli_args, name, default)  # noqa: E731
        train = load_eval_data(settings.train_data, template, seq_len=get("seq_len"),
                               max_tokens=get("max_train_tokens"), max_examples=get("max_train_examples"),
                               text_field=get("text_field", "text"))
    if train is None:
        raise UserError(f"--method {method} trains on data and got none: pass --train-data (a text file/folder, "
                        ".jsonl, a datasets spec, or images for ViTs)")
    if train is eval_data and progress:
        print(f"hf-rebasin: warning: --method {method} trains on the evaluation data (--data); pass --train-data "
              "with a separate split for an honest held-out barrier", file=sys.stderr)
    return train


def continue_on_main_process(accelerator) -> None:
    """After training under `accelerate launch`: evaluation and export run once, on the main process."""
    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
        if not accelerator.is_main_process:
            accelerator.end_training()
            raise SystemExit(0)


def _entry(method: str, a: Graph, b: Graph, *, progress: bool = True, data=None, template=None,
           cli_args=None, eval_data=None, **_):
    settings = settings_from_args(cli_args, method) if cli_args is not None else LearnSettings(method=method)
    validate(settings)
    if template is None:
        raise UserError(f"--method {method} needs the model template (the loaded model A) to run the task loss")
    train = training_data(settings, cli_args, template, data, eval_data, progress)
    result, accelerator = learn_transforms(a, b, template, train, eval_data, settings, progress=progress,
                                           wm_rounds=getattr(cli_args, "rounds", 10))
    continue_on_main_process(accelerator)
    return result


def lm(a: Graph, b: Graph, **kwargs):
    """Learned matching (Theus et al.): B's continuous symmetries trained on the path loss."""
    return _entry("lm", a, b, **kwargs)


def dual(a: Graph, b: Graph, **kwargs):
    """Dual learned matching (LMC-DM, Li & Shen): both endpoints carry learned transforms."""
    return _entry("dual", a, b, **kwargs)


__all__ = ["LearnSettings", "PathLoss", "add_learned_arguments", "dual", "learn_transforms", "lm",
           "settings_from_args", "validate"]
