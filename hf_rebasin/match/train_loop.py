"""The training loop of learned matching, driven by ``accelerate``.

* data parallel: the global batch of a step is split into ``grad_accum`` micro-batches, each split
  across processes; DDP averages the gradients, so N processes follow the same trajectory as one.
* the data order and the λ of every step are functions of (seed, step) alone: a run resumed from
  a checkpoint at step k repeats exactly what an uninterrupted run does after step k.
* AdamW (no weight decay: it would pull the group elements towards an arbitrary point), linear
  warmup then cosine decay.
* checkpoints (symmetry parameters, optimiser state, step, log, fingerprint) are written atomically
  by the main process: every --checkpoint-every steps, every --checkpoint-minutes of training (the newest of those
  kept), and when stopped: the first Ctrl-C (or SIGTERM, SIGHUP: hf_rebasin/signals.py) finishes the current step
  on every process, saves a checkpoint and raises KeyboardInterrupt (signals.Stopped); a second aborts at once.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

from ..errors import UserError
from ..progress import tqdm
from ..signals import handle, interruption, restore, say

CHECKPOINT_FORMAT = "hf-rebasin-learned-matching/1"


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to 1 over `warmup` steps, then cosine decay to `min_ratio` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


LAMBDA_RANGES = {"uniform": (0.0, 1.0), "narrow": (0.4, 0.6)}
# N > 2 models: weights ~ Dirichlet(c, ..., c).  c = 1 is uniform on the simplex; c = 36 gives two models
# Beta(36, 36), whose spread (std 0.058) is that of U(0.4, 0.6)
DIRICHLET_CONCENTRATION = {"uniform": 1, "narrow": 36}


# the host reads the losses (and, over processes, agrees on a Ctrl-C) at most this many steps apart
MAX_STEPS_BETWEEN_READS = 50


def make_optimizer(params, lr: float, device: torch.device) -> torch.optim.Optimizer:
    """AdamW without weight decay (it would pull the group elements towards an arbitrary point); on CUDA the fused
    kernel (one launch for all the parameters, state steps kept on the device)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0,
                             fused=device.type == "cuda")


def host_batch(inputs: torch.Tensor, labels: torch.Tensor | None, sparse: bool) -> tuple:
    """(inputs, labels, the distinct token ids of the inputs or None), on the host: the ids are found where the batch
    is (torch.unique on a device makes the host wait for it)."""
    return inputs, labels, torch.unique(inputs) if sparse else None


def send(tensors: tuple, device: torch.device, pin: bool | None = None) -> tuple:
    """The tensors on the device; on CUDA pinned (unless `pin` is False) and sent without waiting (non_blocking)."""
    cuda = device.type == "cuda"
    pin = cuda if pin is None else pin
    return tuple(None if t is None else (t.pin_memory() if pin else t).to(device, non_blocking=cuda) for t in tensors)


def make_accelerator(options):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
    return Accelerator(cpu=options.device == "cpu", mixed_precision="no", kwargs_handlers=[ddp])


def training_device(device: str, num_processes: int, process_device: torch.device) -> torch.device:
    """Where this process trains.  One process: --device `device` resolved, cuda:N included (the device the
    evaluation uses; the Accelerator alone would pick cuda:0).  Under `accelerate launch`: the process's own
    `process_device` (cuda:LOCAL_RANK, or the CPU); options.check refuses --device cuda:N there."""
    from ..devices import resolve_device
    return process_device if num_processes > 1 else torch.device(resolve_device(device))


# --- deterministic plan of the run ---------------------------------------------------------------

class StepPlan:
    """Which examples and which λ each step uses: fresh permutations of the data, back to back."""

    def __init__(self, n_examples: int, batch_size: int, seed: int, lambda_range: tuple[float, float],
                 n_models: int = 2, concentration: int = 1):
        self.n, self.batch_size, self.seed, self.range = n_examples, batch_size, seed, lambda_range
        self.n_models, self.concentration = n_models, concentration
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 4:
                self._perms.pop(min(self._perms))
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=gen)
        return self._perms[epoch]

    def indices(self, step: int) -> torch.Tensor:
        positions = torch.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs, offsets = positions // self.n, positions % self.n
        return torch.stack([self._perm(int(e))[int(o)] for e, o in zip(epochs, offsets)])

    def lam(self, step: int) -> float | tuple[float, ...]:
        """λ of the step for two models; for N > 2 the interpolation weights, drawn from a symmetric
        Dirichlet(c) (c = `concentration`, an integer: Gamma(c, 1) is a sum of c unit exponentials)."""
        gen = torch.Generator().manual_seed(self.seed * 7_919 + 104_729 * (step + 1))
        if self.n_models > 2:
            u = torch.rand((self.n_models, self.concentration), generator=gen, dtype=torch.float64)
            gamma = -torch.log1p(-u).sum(dim=1)
            return tuple(float(w) for w in gamma / gamma.sum())
        lo, hi = self.range
        return lo + (hi - lo) * float(torch.rand((), generator=gen, dtype=torch.float64))


# --- checkpoints ---------------------------------------------------------------------------------

def run_tag(method: str, fingerprint: dict) -> str:
    """File-name prefix of one run's checkpoints: the method and a hash of models, data and settings."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:8]
    return f"{method}-{digest}"


def checkpoint_path(directory: str | Path, tag: str, step: int) -> Path:
    return Path(directory) / f"{tag}-step{step:07d}.pt"


def save_checkpoint(path: Path, state: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _step_of(path: Path) -> int:
    return int(path.stem.rsplit("step", 1)[1])


def _newest_checkpoint(folder: Path, tag: str) -> Path:
    mine = sorted(folder.glob(f"{tag}-step*.pt"), key=_step_of)
    if mine:
        return mine[-1]
    others = sorted(folder.glob("*-step*.pt"))
    if others:
        raise UserError(f"--resume {folder}: its checkpoints ({', '.join(p.name for p in others[:3])}"
                        f"{', ...' if len(others) > 3 else ''}) belong to other runs (other method, models, data or "
                        "settings); pass one of the files to see what differs")
    raise UserError(f"--resume {folder}: the folder holds no checkpoint (*-stepNNNNNNN.pt)")


def read_checkpoint(path: str | Path) -> dict:
    """A checkpoint file's content (UserError, one line, if it is not one); no check of what it belongs to."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--resume {path}: no such checkpoint file")
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of a foreign file
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # any unreadable file is the same user problem
        text = str(error)  # torch wraps the reason in paragraphs of weights_only advice: keep the reason
        reason = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n")[0] \
            if "WeightsUnpickler error:" in text else (text.strip().splitlines() or [""])[0]
        raise UserError(f"--resume {path} is not a readable checkpoint ({type(error).__name__}: "
                        f"{' '.join(reason.split())})") from error
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"--resume {path} is not a hf-rebasin learned-matching checkpoint")
    return state


def load_checkpoint(path: str | Path, fingerprint: dict) -> dict:
    """Read a checkpoint and check it belongs to these models, data and settings (UserError if not)."""
    path = Path(path)
    if path.is_dir():
        path = _newest_checkpoint(path, run_tag(fingerprint["settings"]["method"], fingerprint))
    state = read_checkpoint(path)
    saved = state["fingerprint"]
    problems = []
    if saved["models"] != fingerprint["models"]:
        problems.append("it was made for other models (A/B weights differ)")
    if saved["train_data"] != fingerprint["train_data"]:
        problems.append("it was trained on other data (--train-data / --seq-len / caps differ)")
    for key, now in fingerprint["settings"].items():
        then = saved["settings"].get(key)
        if then != now:
            problems.append(f"{key} was {then!r}, now {now!r}")
    if problems:
        raise UserError(f"cannot resume from {path}: " + "; ".join(problems) +
                        ". Resume with the same models, data and settings, or start a new run without --resume.")
    state["path"] = str(path)
    return state


# --- Ctrl-C ---------------------------------------------------------------------------------------

class InterruptFlag:
    """First SIGINT, SIGTERM or SIGHUP: remember it (the loop stops after the current step); second: raise it."""

    def __init__(self, announce: bool):
        self.requested, self.signum, self.announce, self.previous = False, signal.SIGINT, announce, {}

    def _handler(self, signum, frame):
        if self.requested:
            raise interruption(signum)
        self.requested, self.signum = True, signum
        if self.announce:
            what, again = ("", "Ctrl-C") if signum == signal.SIGINT else (f"{signal.Signals(signum).name}: ", "it")
            say(f"{chr(10) * sys.stderr.isatty()}hf-rebasin: {what}stopping after this step and saving a checkpoint "
                f"({again} again to abort now)")

    def stop(self) -> KeyboardInterrupt:
        """What the loop raises once it has saved the checkpoint."""
        return interruption(self.signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = handle(self._handler)
        return self

    def __exit__(self, *exc):
        restore(self.previous)
        return False


class TimedCheckpoints:
    """A checkpoint every `minutes` of training (0: none), the newest kept: what a run killed without warning
    (SIGKILL after a scheduler's grace period, a lost node, out of memory) loses at most."""

    def __init__(self, minutes: float):
        self.every_s, self.since, self.last = 60.0 * minutes, time.monotonic(), None

    def due(self) -> bool:
        return self.every_s > 0 and time.monotonic() - self.since >= self.every_s

    def saved(self, path: Path, replace: bool) -> None:
        """`path` was just written; the timed checkpoint before it is removed when `replace`."""
        if replace and self.last is not None and self.last != path:
            self.last.unlink(missing_ok=True)
        self.last = path if replace else self.last
        self.since = time.monotonic()


# --- held-out estimate ---------------------------------------------------------------------------

@torch.no_grad()
def path_loss_at(path_loss, data, lam: float, batch_size: int, device) -> float:
    total, count = 0.0, 0
    for start in range(0, len(data.inputs), batch_size):
        x = data.inputs[start:start + batch_size].to(device)
        y = None if data.labels is None else data.labels[start:start + batch_size].to(device)
        total += float(path_loss(x, y, lam)) * len(x)
        count += len(x)
    return total / max(count, 1)


def _subset(data, n: int):
    from ..sources.eval_data import EvalData
    if data is None or n <= 0:
        return None
    labels = None if data.labels is None else data.labels[:n]
    return EvalData(data.task, data.inputs[:n], labels, data.info)


# --- the loop ------------------------------------------------------------------------------------

def train_transforms(path_loss, accelerator, train, eval_data, s, *, fingerprint: dict, resume_state: dict | None,
                     progress: bool = True, on_step=None, holdout=None, device=None) -> list[dict]:
    """Train path_loss's parameters for s.steps steps (s: MergeOptions) on `device` (default the accelerator's);
    returns the log (list of dicts).  With `holdout` (training examples never trained on), path_loss ends with
    the parameters whose midpoint loss on them was lowest among the start, every s.eval_every steps and the last
    step."""
    device, main = device or accelerator.device, accelerator.is_main_process
    rank, world = accelerator.process_index, accelerator.num_processes
    params = [p for p in path_loss.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, s.lr, device)
    start, log, best = 0, [], None
    if resume_state is not None:
        path_loss.load_learned_state(resume_state["params"])
        optimizer.load_state_dict(resume_state["optimizer"])
        start, log, best = int(resume_state["step"]), list(resume_state["log"]), resume_state.get("best")
    model = path_loss  # layered: the loop averages the gradients itself (path_loss.sync_gradients)
    if not path_loss.manual_sync and world > 1:  # one process needs no DDP (and prepare_model would move it)
        with warnings.catch_warnings():  # torch deprecates broadcast_buffers; accelerate has no other way to say it
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            model = accelerator.prepare_model(path_loss)
    everywhere = path_loss.sharded  # a sharded forward needs every process: held-out estimates run on all
    micro = s.learn_batch_size // (s.grad_accum * world)
    distribution = s.learned_lambda_dist(path_loss.n_models, train.task)
    plan = StepPlan(len(train.inputs), s.learn_batch_size, s.learn_seed, LAMBDA_RANGES[distribution],
                    path_loss.n_models, DIRICHLET_CONCENTRATION[distribution])
    held_out = _subset(eval_data, s.eval_subset) if s.eval_every > 0 else None
    log_every = max(1, s.steps // 100)
    stage = fingerprint.get("settings", {}).get("method", s.method)  # the method, or "refine" (match/refine.py)
    tag = run_tag(stage, fingerprint)
    ends: list[float] | None = None
    postfix: dict[str, str] = {}

    def state(step: int) -> dict:
        return {"format": CHECKPOINT_FORMAT, "step": step, "params": path_loss.learned_state(),
                "optimizer": optimizer.state_dict(), "log": log, "fingerprint": fingerprint, "best": best}

    def select(step: int) -> None:
        """Keep the parameters if their midpoint loss on the held-out training examples is the lowest so far."""
        nonlocal best
        if holdout is None or not (main or everywhere):
            return
        loss = path_loss_at(path_loss, holdout, path_loss.centre, s.batch_size, device)
        log.append({"step": step, "holdout_midpoint_loss": loss})
        if best is None or loss < best["loss"]:
            best = {"step": step, "loss": loss,
                    "params": {k: v.detach().clone() for k, v in path_loss.learned_state().items()}}
        postfix["best"] = f"{best['loss']:.4f}@{best['step']}"

    def estimate(step: int) -> None:
        nonlocal ends
        select(step)
        if held_out is None or not (main or everywhere):
            return
        if ends is None:  # the endpoints are exact symmetries of the models: their losses never change
            ends = [path_loss_at(path_loss, held_out, v, s.batch_size, device) for v in path_loss.vertices]
        mid = path_loss_at(path_loss, held_out, path_loss.centre, s.batch_size, device)
        barrier = mid - sum(ends) / len(ends)
        log.append({"step": step, "heldout_midpoint_loss": mid, "heldout_midpoint_barrier": barrier})
        postfix["mid-barrier"] = f"{barrier:.4f}"

    if start == 0:
        estimate(0)
    what = "refining" if stage == "refine" else f"{stage} matching"
    bar = tqdm(total=s.steps, initial=start, desc=what, disable=not (progress and main), leave=False, unit="step")
    bar.set_postfix(postfix)
    running = None
    pending: list[tuple] = []  # (step, its loss as a device tensor, λ, lr) of the steps not read yet
    read_every = min(log_every, MAX_STEPS_BETWEEN_READS)

    def read() -> bool:
        """Read the losses of the pending steps (and, over processes, whether any process was interrupted) with one
        transfer: the host waits for the device here only, every `read_every` steps.  Returns the stop flag."""
        nonlocal running
        flag = torch.tensor([float(interrupt.requested)], device=device)
        values = torch.cat([torch.stack([loss for _, loss, _, _ in pending]), flag])
        if world > 1:
            values = accelerator.reduce(values, reduction="sum")
            values[:-1] /= world
        *losses, stop = values.tolist()
        for (done, _, lam, lr), loss in zip(pending, losses):
            if not math.isfinite(loss):
                raise UserError(f"{what} diverged at step {done} (loss {loss}); lower "
                                f"{'--refine-lr' if stage == 'refine' else '--lr'} (now {s.lr})")
            running = loss if running is None else 0.9 * running + 0.1 * loss
            if (done - 1) % log_every == 0 or done == s.steps:
                log.append({"step": done, "loss": loss, "lambda": lam, "lr": lr})
        lam = pending[-1][2]
        postfix.update(loss=f"{running:.4f}",
                       lam=f"{lam:.2f}" if isinstance(lam, float) else "/".join(f"{w:.2f}" for w in lam))
        pending.clear()
        return stop > 0

    timed = TimedCheckpoints(s.checkpoint_minutes)
    with InterruptFlag(announce=main) as interrupt:
        for step in range(start, s.steps):
            for group in optimizer.param_groups:
                group["lr"] = s.lr * lr_factor(step, s.steps, s.warmup_steps())
            lam = plan.lam(step)
            index = plan.indices(step).view(s.grad_accum, world, micro)
            step_loss = torch.zeros((), device=device)
            for m in range(s.grad_accum):
                part = index[m, rank]
                labels = None if train.labels is None else train.labels[part]
                x, y, rows = send(host_batch(train.inputs[part], labels, path_loss.sparse), device)
                last = m == s.grad_accum - 1
                with nullcontext() if last or world == 1 or path_loss.manual_sync else accelerator.no_sync(model):
                    loss = model(x, y, lam, rows)
                    accelerator.backward(loss / s.grad_accum)
                step_loss = step_loss + loss.detach() / s.grad_accum
            if path_loss.manual_sync:
                path_loss.sync_gradients(world)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done = step + 1
            pending.append((done, step_loss, lam, optimizer.param_groups[0]["lr"]))
            evaluate_now = bool(s.eval_every and done % s.eval_every == 0) or done == s.steps
            every_k = bool(s.checkpoint_every and done % s.checkpoint_every == 0)
            # one process may stop at any step; several agree on it when they read (the same steps on all)
            stop = world == 1 and interrupt.requested
            read_now = stop or evaluate_now or done % read_every == 0 or every_k
            if read_now:
                stop = read() or stop
            if evaluate_now:
                estimate(done)
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            # a timed checkpoint only where the losses were read (the log is whole), by the main process alone
            timed_now = main and read_now and done < s.steps and not stop and timed.due()
            if main and (every_k or timed_now):
                path = save_checkpoint(checkpoint_path(s.checkpoint_dir, tag, done), state(done))
                timed.saved(path, replace=not every_k)
            if on_step is not None:
                on_step(done, step_loss)
            if stop:
                bar.close()
                if main:
                    path = save_checkpoint(checkpoint_path(s.checkpoint_dir, tag, done), state(done))
                    print(f"hf-rebasin: saved {path} after step {done}/{s.steps}; continue with --resume {path}",
                          file=sys.stderr)
                accelerator.wait_for_everyone()
                raise interrupt.stop()
    bar.close()
    if best is not None:
        path_loss.load_learned_state(best["params"])
        log.append({"selected_step": best["step"], "holdout_midpoint_loss": best["loss"]})
    return log
