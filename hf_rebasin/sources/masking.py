"""The masked-LM protocol (docs/design.md §5): token windows masked once, by a fixed seed, as BERT was trained —
15 % of the ordinary tokens of each window chosen, of those 80 % replaced by the mask token, 10 % by a random token,
10 % left as they are — and the loss is the cross-entropy of the original tokens at the chosen positions.  The masks
are drawn when the data is loaded, so every λ, every point of a simplex and every method of a run (and every run on
the same data) sees the same masked inputs; barrier.json records the scheme, the seed and the counts."""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import UserError

MASK_RATE, MASK_SHARE, RANDOM_SHARE, MASK_SEED = 0.15, 0.8, 0.1, 0
IGNORE = -100  # the label of a position that is not predicted (PyTorch's ignore_index)


def mask_token_id(tokenizer, source: str) -> int:
    mask = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if mask is None:
        raise UserError(f"{source}: a masked LM is evaluated by masking tokens, and its tokenizer has no mask token "
                        "(mask_token): copy the tokenizer the model was trained with into the folder")
    return int(mask)


def special_ids(tokenizer) -> list[int]:
    """Ids never masked: the tokenizer's special tokens (document separators, padding, CLS/SEP)."""
    return sorted({int(i) for i in getattr(tokenizer, "all_special_ids", []) or [] if i is not None})


def mask_windows(windows: Tensor, mask_id: int, vocab_size: int, never: list[int],
                 seed: int = MASK_SEED) -> tuple[Tensor, Tensor, dict]:
    """(masked inputs, labels, the record for barrier.json) of token windows (n, T)."""
    gen = torch.Generator().manual_seed(seed)
    n, t = windows.shape
    chosen = torch.rand(n, t, generator=gen) < MASK_RATE
    if never:
        chosen &= ~torch.isin(windows, torch.tensor(never, dtype=windows.dtype))
    kind = torch.rand(n, t, generator=gen)
    random_ids = torch.randint(0, vocab_size, (n, t), generator=gen, dtype=windows.dtype)
    inputs = windows.clone()
    to_mask = chosen & (kind < MASK_SHARE)
    to_random = chosen & (kind >= MASK_SHARE) & (kind < MASK_SHARE + RANDOM_SHARE)
    inputs[to_mask] = mask_id
    inputs[to_random] = random_ids[to_random]
    labels = torch.where(chosen, windows, torch.full_like(windows, IGNORE))
    record = {"scheme": "BERT 80/10/10", "rate": MASK_RATE, "seed": seed, "mask_token_id": mask_id,
              "predicted": int(chosen.sum()), "masked": int(to_mask.sum()), "random": int(to_random.sum()),
              "kept": int((chosen & ~to_mask & ~to_random).sum()), "never_masked_ids": never}
    if record["predicted"] == 0:
        raise UserError(f"masking {n} window(s) of {t} tokens chose no token to predict: give more text")
    return inputs, labels, record


def original_tokens(inputs: Tensor, labels: Tensor | None) -> Tensor:
    """The unmasked windows of masked-LM data (the labels where a token was chosen, the inputs elsewhere)."""
    return inputs if labels is None else torch.where(labels != IGNORE, labels, inputs)


def example_labels(inputs: Tensor, gen: torch.Generator) -> Tensor:
    """Labels for example windows (tests, the CUDA rule checks): the token itself at about a third of the positions,
    at least one per window, IGNORE elsewhere."""
    chosen = torch.rand(inputs.shape, generator=gen) < 0.3
    chosen[:, 0] = True
    return torch.where(chosen, inputs, torch.full_like(inputs, IGNORE))
