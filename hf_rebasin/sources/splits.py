"""Which examples learned matching trains on and which are evaluated: --data split into disjoint halves when no
training data is given, and examples compared by content (so that training data that is also evaluated is
found whatever its name)."""
from __future__ import annotations

import hashlib

import torch

from .eval_data import EvalData
from .models import Loaded


def split_in_halves(data: EvalData, template: Loaded, seed: int) -> tuple[EvalData, EvalData, str]:
    """(training half, evaluation half, how) of --data for a learned method given no --train-data.
    Text: the first half of the documents trains and the second half is evaluated.  Neighbouring windows of one
    document are nearly the same text, so splitting window by window would measure an in-sample barrier in
    disguise; the cut is the document boundary (an EOS token) nearest the middle of the windows, and the window
    holding it is dropped, so no document has text on both sides (one long document: cut at the middle).
    Images are independent examples: a random split, seeded by --learn-seed (a folder is sorted by class, so
    contiguous halves would train and evaluate on different classes)."""
    n = len(data.inputs)
    if data.task == "image-classification":
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        first, second = order[: n // 2].sort().values, order[n // 2:].sort().values
        return (subset(data, first, "train half"), subset(data, second, "eval half"),
                f"images at random, seed {seed}")
    eos = eos_token_id(template)
    holds_eos = [] if eos is None else (data.inputs == eos).any(dim=1).nonzero().flatten().tolist()
    near_middle = [k for k in holds_eos if n // 4 <= k < n - n // 4 and 0 < k < n - 1]
    if near_middle:
        cut = min(near_middle, key=lambda k: abs(k - n / 2))
        return (subset(data, slice(0, cut), "train half"), subset(data, slice(cut + 1, n), "eval half"),
                f"by document: windows 0-{cut - 1} train, {cut + 1}-{n - 1} are evaluated, window {cut} (a "
                "document boundary) is dropped")
    cut = n // 2
    return (subset(data, slice(0, cut), "train half"), subset(data, slice(cut, n), "eval half"),
            f"one document: its first {cut} windows train, the last {n - cut} are evaluated")


def eos_token_id(template: Loaded) -> int | None:
    from ..errors import UserError
    try:
        return getattr(template.backend.tokenizer(template.folder), "eos_token_id", None)
    except UserError:  # a model without a tokenizer (token files only): no document boundaries known
        return None


def example_digests(data: EvalData) -> list[str]:
    """One content digest per example (token window, or image with its label)."""
    from .eval_data import tokens_of
    if data.task == "masked-lm":  # the text, whatever its masks
        return [hashlib.sha256(x.contiguous().numpy().tobytes()).hexdigest() for x in tokens_of(data)]
    labels = data.labels if data.labels is not None else [None] * len(data.inputs)
    return [hashlib.sha256(x.contiguous().numpy().tobytes() + (b"" if y is None else str(int(y)).encode())).hexdigest()
            for x, y in zip(data.inputs, labels)]


def shared_examples(train: EvalData, data: EvalData) -> int:
    held_out = set(example_digests(data))
    return sum(digest in held_out for digest in example_digests(train))


def data_digest(data: EvalData) -> str:
    return hashlib.sha256("".join(example_digests(data)).encode()).hexdigest()[:16]


def subset(data: EvalData, part, name: str) -> EvalData:
    labels = None if data.labels is None else data.labels[part]
    inputs = data.inputs[part]
    info = {**(data.info or {}), "part": name}
    if "tokens" in info:
        info.update(tokens=int(inputs.numel()), windows=len(inputs))
    if "examples" in info:
        info["examples"] = len(inputs)
    return EvalData(data.task, inputs, labels, info)
