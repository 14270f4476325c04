"""Small-model training: honest stand-ins for Hub checkpoints (examples, benchmarks, tests).

Two models trained by these functions from different seeds on the same data are the
"independently trained pair" that re-basin merges. Everything runs in fp32 on the CPU and is
deterministic for a given seed: the seed sets both the initialisation and the data order.
"""
from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from .export.io import staged_dir
from .match.train_loop import lr_factor
from .progress import tqdm
from .requirements import import_optional

# --- a real corpus every machine has: CPython's standard-library sources (PSF License) --------------------

STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data",
                                 "encodings"})
EOS = "<|endoftext|>"


def stdlib_files(max_bytes: int = 100_000) -> list[Path]:
    """The standard library's .py files (tests and site-packages excluded), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    eligible = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        parts = path.relative_to(root).parts
        if any(part in STDLIB_SKIPPED_DIRS or part.startswith("test") for part in parts[:-1]):
            continue
        if parts[-1].startswith("test_") or path.stat().st_size > max_bytes:
            continue
        eligible.append(path)
    return eligible


def stdlib_texts(files: list[Path]) -> list[str]:
    return [path.read_text(encoding="utf-8", errors="replace") for path in files]


def train_bpe_tokenizer(texts: list[str], vocab_size: int, model_max_length: int = 1024):
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenisation, ``<|endoftext|>`` as its only special
    token) trained on texts, as a transformers PreTrainedTokenizerFast.  Deterministic for given texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, bos_token=EOS, unk_token=EOS,
                                   model_max_length=model_max_length)


# --- training --------------------------------------------------------------------------------------------

def batch_indices(n: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """`steps` batches of example indices: fresh random permutations of range(n), back to back."""
    order = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        while len(order) < batch_size:
            order = torch.cat([order, torch.randperm(n, generator=generator)])
        yield order[:batch_size]
        order = order[batch_size:]


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norm gains or scalars)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def check_positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}.")


def run_training(model: torch.nn.Module, loss_of_batch, n_examples: int, *, seed: int, steps: int,
                 batch_size: int, lr: float, warmup: int | None, weight_decay: float, grad_clip: float,
                 log_every: int, progress: bool, desc: str, log: list | None = None) -> torch.nn.Module:
    """The shared loop: AdamW, warmup + cosine schedule, gradient clipping, tqdm with running loss (and, given a
    list `log`, {step, loss (running mean), lr} appended every log_every steps)."""
    warmup = max(1, steps // 20) if warmup is None else max(1, warmup)
    optimizer = adamw(model, lr, weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps, warmup))
    data_order = torch.Generator().manual_seed(seed)
    running = None
    model.train()
    bar = tqdm(batch_indices(n_examples, batch_size, steps, data_order), total=steps, desc=desc,
               disable=not progress, leave=False, unit="step")
    for step, index in enumerate(bar):
        loss = loss_of_batch(index)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        schedule.step()
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"training diverged at step {step} (loss {value}); lower lr (now {lr}).")
        running = value if running is None else 0.95 * running + 0.05 * value
        if step % max(1, log_every) == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{running:.3f}", lr=f"{schedule.get_last_lr()[0]:.2e}")
            if log is not None:
                log.append({"step": step, "loss": round(running, 4), "lr": schedule.get_last_lr()[0]})
    bar.close()
    return model.eval()


def train_causal_lm(config, windows: torch.Tensor, *, seed: int, steps: int, batch_size: int, lr: float,
                    warmup: int | None = None, weight_decay: float = 0.1, grad_clip: float = 1.0,
                    log_every: int = 10, progress: bool = True, log: list | None = None,
                    data_seed: int | None = None) -> torch.nn.Module:
    """Train `AutoModelForCausalLM.from_config(config)` on token windows (n, seq_len) by next-token loss.

    `torch.manual_seed(seed)` is set before the model is built, so the seed changes the
    initialisation, the data order and any dropout; the same seed gives bitwise the same weights.
    `data_seed` (default `seed`): a separate seed for the data order (two models of one initialisation
    trained on different orders, as Pythia's standard and deduplicated runs share their seed).
    `warmup` defaults to 5% of the steps. Returns the model in eval mode.
    """
    from transformers import AutoModelForCausalLM

    check_positive(steps=steps, batch_size=batch_size, lr=lr)
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.is_floating_point():
        raise ValueError("windows must be an integer tensor of token ids shaped (n, seq_len); "
                         "build it with hf_rebasin.sources.data.token_windows.")
    if len(windows) == 0 or windows.shape[1] < 2:
        raise ValueError(f"windows has shape {tuple(windows.shape)}: need at least one window of 2+ tokens.")
    if int(windows.max()) >= config.vocab_size or int(windows.min()) < 0:
        raise ValueError(f"token ids span [{int(windows.min())}, {int(windows.max())}] but the config's "
                         f"vocab_size is {config.vocab_size}; set vocab_size to len(tokenizer).")
    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_positions is not None and windows.shape[1] > max_positions:
        raise ValueError(f"windows are {windows.shape[1]} tokens long but the model has only {max_positions} "
                         "positions; use a shorter seq_len or a larger max_position_embeddings.")
    windows = windows.long()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()

    def loss_of_batch(index: torch.Tensor) -> torch.Tensor:
        batch = windows[index]
        return model(input_ids=batch, labels=batch).loss

    return run_training(model, loss_of_batch, len(windows), seed=seed if data_seed is None else data_seed,
                        steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, weight_decay=weight_decay,
                        grad_clip=grad_clip, log_every=log_every, progress=progress, desc=f"train LM (seed {seed})",
                        log=log)


def train_masked_lm(config, windows: torch.Tensor, *, architecture: str, mask_id: int, never: list[int], seed: int,
                    steps: int, batch_size: int, lr: float, warmup: int | None = None, weight_decay: float = 0.1,
                    grad_clip: float = 1.0, log_every: int = 10, progress: bool = True,
                    log: list | None = None) -> torch.nn.Module:
    """Train the masked-LM class `architecture` (BertForMaskedLM, RobertaForMaskedLM) from `config` on token windows,
    BERT's way: every step masks its batch afresh (15 % of the ordinary tokens, 80/10/10; sources/masking.py), with
    masks drawn from `seed` and the step, so the same seed gives bitwise the same weights."""
    import transformers

    from .sources.masking import mask_windows
    check_positive(steps=steps, batch_size=batch_size, lr=lr)
    windows = windows.long()
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float()
    step = iter(range(steps))

    def loss_of_batch(index: torch.Tensor) -> torch.Tensor:
        inputs, labels, _ = mask_windows(windows[index], mask_id, config.vocab_size, never,
                                         seed=seed * 1_000_003 + next(step))
        return model(input_ids=inputs, labels=labels).loss

    return run_training(model, loss_of_batch, len(windows), seed=seed, steps=steps, batch_size=batch_size, lr=lr,
                        warmup=warmup, weight_decay=weight_decay, grad_clip=grad_clip, log_every=log_every,
                        progress=progress, desc=f"train MLM (seed {seed})", log=log)


def shift_images(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by up to `max_shift` pixels in each direction, padding with zeros."""
    n, _, height, width = images.shape
    padded = F.pad(images, (max_shift, max_shift, max_shift, max_shift))
    offsets = torch.randint(0, 2 * max_shift + 1, (n, 2), generator=generator)
    return torch.stack([padded[i, :, dy:dy + height, dx:dx + width] for i, (dy, dx) in enumerate(offsets.tolist())])


def train_vit(model_args: dict, images: torch.Tensor, labels: torch.Tensor, *, seed: int, steps: int,
              batch_size: int, lr: float, warmup: int | None = None, weight_decay: float = 0.05,
              grad_clip: float = 1.0, max_shift: int = 0, label_smoothing: float = 0.0,
              log_every: int = 10, progress: bool = True) -> torch.nn.Module:
    """Train `timm.create_model("vit_tiny_patch16_224", pretrained=False, **model_args)` as a classifier.

    images: float (N, C, H, W), used as given; labels: integer (N,). `max_shift` > 0 adds random
    translations as augmentation. Deterministic for a seed (init, data order, augmentation).
    """
    timm = import_optional("timm")
    check_positive(steps=steps, batch_size=batch_size, lr=lr)
    if images.dim() != 4 or not images.is_floating_point():
        raise ValueError(f"images must be a float tensor shaped (N, C, H, W), got {images.dtype} "
                         f"{tuple(images.shape)}.")
    if labels.shape != (len(images),) or labels.is_floating_point():
        raise ValueError(f"labels must be an integer tensor shaped ({len(images)},), got {labels.dtype} "
                         f"{tuple(labels.shape)}.")
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **model_args).float()
    num_classes = model.num_classes
    if int(labels.max()) >= num_classes or int(labels.min()) < 0:
        raise ValueError(f"labels span [{int(labels.min())}, {int(labels.max())}] but the model has "
                         f"{num_classes} classes; set num_classes in model_args.")
    images, labels = images.float(), labels.long()
    augment = torch.Generator().manual_seed(seed + 1_000_003)

    def loss_of_batch(index: torch.Tensor) -> torch.Tensor:
        batch = images[index]
        if max_shift > 0:
            batch = shift_images(batch, max_shift, augment)
        return F.cross_entropy(model(batch), labels[index], label_smoothing=label_smoothing)

    return run_training(model, loss_of_batch, len(images), seed=seed, steps=steps, batch_size=batch_size,
                        lr=lr, warmup=warmup, weight_decay=weight_decay, grad_clip=grad_clip,
                        log_every=log_every, progress=progress, desc=f"train ViT (seed {seed})")


@torch.no_grad()
def causal_lm_loss(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over all windows (each predicts seq_len - 1 tokens)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size].long()
        logits = model(input_ids=batch).logits[:, :-1].float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


@torch.no_grad()
def classifier_metrics(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
                       batch_size: int = 256) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of an image classifier."""
    model.eval()
    total, correct = 0.0, 0
    for start in range(0, len(images), batch_size):
        logits = model(images[start:start + batch_size].float()).float()
        target = labels[start:start + batch_size].long()
        total += F.cross_entropy(logits, target, reduction="sum").item()
        correct += int((logits.argmax(-1) == target).sum())
    return total / len(images), correct / len(images)


def write_atomically(out_dir: str | Path, write) -> Path:
    """Call write(tmp_dir) on a temporary folder beside out_dir, then move it into place (io.staged_dir): an
    existing out_dir is replaced only once the new folder is complete; on any failure it is left as it was."""
    out_dir = Path(out_dir).resolve()
    with staged_dir(out_dir) as tmp:
        write(tmp)
    return out_dir


def save_lm(model: torch.nn.Module, tokenizer, out_dir: str | Path) -> Path:
    """Write a transformers model (safetensors) and its tokenizer to out_dir in the Hub layout."""
    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    return write_atomically(out_dir, write)


def save_vit(model: torch.nn.Module, model_args: dict, out_dir: str | Path, model_config: dict | None = None) -> Path:
    """Write a timm model in the Hub layout; reload with timm.create_model("local-dir:" + out_dir, pretrained=True).

    `model_config` is passed to timm's save_for_hf (e.g. {"pretrained_cfg": {"tag": ...}, "label_names": [...]}).
    """
    from timm.models import save_for_hf

    def write(folder: Path) -> None:
        save_for_hf(model, str(folder), model_config=model_config, model_args=model_args, safe_serialization=True)

    return write_atomically(out_dir, write)
