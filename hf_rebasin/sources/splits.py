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
    if data.units is not None:  # the data records each window's document (a protocol that joins without EOS)
        holds_eos = [k for k in range(n - 1) if data.units[k] != data.units[k + 1]]
    else:
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
        from .data import window_counts
        info.update(window_counts(len(inputs), int(inputs.shape[1])))
    if "examples" in info:
        info["examples"] = len(inputs)
    units = None
    if data.units is not None:
        picked = range(len(data.inputs))[part] if isinstance(part, slice) else [int(k) for k in part]
        units = [data.units[k] for k in picked]
    return EvalData(data.task, inputs, labels, info, units)


def spread_order(n: int) -> list[int]:
    """0..n-1 in an order that covers the range evenly at every prefix (the van der Corput order)."""
    bits = max(1, (n - 1).bit_length())
    keys = [int(f"{k:0{bits}b}"[::-1], 2) for k in range(n)]
    return [k for _, k in sorted(zip(keys, range(n)))]


class _Stream:
    """The token stream of consecutive windows (a LongTensor or token_files.TokenWindows), read a block at a time,
    to find the EOS tokens around a position."""
    BLOCK = 64  # windows read at a time

    def __init__(self, inputs, eos: int):
        self.inputs, self.eos = inputs, eos
        self.n, self.seq_len = len(inputs), int(inputs.shape[1])

    def last_eos_before(self, position: int) -> int:
        """The position of the last EOS before `position` (-1: none)."""
        window = (position - 1) // self.seq_len
        while window >= 0:
            start = max(0, window - self.BLOCK + 1)
            flat = self.inputs[start:window + 1].reshape(-1)[:position - start * self.seq_len]
            found = (flat == self.eos).nonzero()
            if len(found):
                return start * self.seq_len + int(found[-1])
            window, position = start - 1, start * self.seq_len
        return -1

    def first_eos_from(self, position: int) -> int:
        """The position of the first EOS at or after `position` (the stream's length: none)."""
        window = position // self.seq_len
        while window < self.n:
            stop = min(self.n, window + self.BLOCK)
            flat = self.inputs[window:stop].reshape(-1)
            skip = max(0, position - window * self.seq_len)
            found = (flat[skip:] == self.eos).nonzero()
            if len(found):
                return window * self.seq_len + skip + int(found[0])
            window = stop
        return self.n * self.seq_len


def held_out_documents(data: EvalData, n: int, eos: int | None) -> tuple[list[int], list[int], dict]:
    """(windows to train on, the `n` (or fewer) windows held out, the record of how): learned matching's held-out
    selection.  Text with document boundaries (EOS): whole documents are kept out of training, chosen spread over
    the data: each chosen window takes out every document it touches, a window wholly inside those documents can
    be held out, one partly inside is dropped, and no window trained on shares a token's document with a held-out
    one.  Independent examples (images, `self` samples: each window its own sequence) are spread evenly.  Text with
    no boundaries, or whose documents are too long to spare whole ones (more than half the windows would leave
    training): the last n windows, the window before them dropped (recorded as such)."""
    total = len(data.inputs)
    independent = data.task != "causal-lm" or (data.info or {}).get("spec") == "self"
    if independent:
        held = torch.linspace(0, total - 1, n).round().long().unique().tolist()
        what = "images" if data.task != "causal-lm" else "sampled sequences"
        return _others(total, held), held, {"how": f"independent {what}, spread evenly", "held_out": len(held),
                                            "dropped": 0}
    if data.units is not None:
        kept, held, record = _held_out_units(data.units, n)
    else:
        kept, held, record = _held_out_spans(data, n, eos)
    if len(kept) < total // 2:  # no whole documents to spare (one long document, or a few): the last windows
        held, kept = list(range(total - n, total)), list(range(max(0, total - n - 1)))
        record = {"how": ("documents too long to hold out whole: the last windows, the window before them dropped"
                          if record.get("documents") else
                          "no document boundaries: the last windows, the window before them dropped"),
                  "held_out": n, "dropped": total - n - len(kept)}
    if not kept:
        from ..errors import OptionError
        raise OptionError(f"--holdout {n} leaves no training window out of {total}; lower --holdout or give more "
                          "--train-data")
    return kept, held, record


def _held_out_spans(data: EvalData, n: int, eos: int | None) -> tuple[list[int], list[int], dict]:
    """held_out_documents where documents end with an EOS token (found around the chosen windows only)."""
    total = len(data.inputs)
    stream = None if eos is None else _Stream(data.inputs, eos)
    spans: list[tuple[int, int]] = []  # held-out token spans [start, end), whole documents
    inside: set[int] = set()
    seq_len, targets = int(data.inputs.shape[1]), torch.linspace(0, total - 1, n).round().long().tolist()
    if stream is None or stream.last_eos_before(total * seq_len) < 0:
        return [], [], {}  # no document boundaries
    for k in spread_order(len(targets)):
        window = targets[k]
        if window in inside or any(s <= window * seq_len < e for s, e in spans):
            continue
        start = stream.last_eos_before(window * seq_len) + 1
        end = stream.first_eos_from(window * seq_len + seq_len - 1) + 1
        spans.append((start, end))
        inside.update(range(-(-start // seq_len), end // seq_len))  # windows wholly inside the span
        if len(inside) >= n:
            break
    touched = {w for s, e in spans for w in range(s // seq_len, min(total, -(-e // seq_len)))}
    inside = sorted(inside)
    held = [inside[int(k)] for k in torch.linspace(0, len(inside) - 1, min(n, len(inside))).round().long()]
    held = sorted(set(held))
    record = {"how": "whole documents kept out of training", "documents": len(spans), "held_out": len(held),
              "dropped": len(touched) - len(held)}
    return _others(total, touched), held, record


def _others(total: int, left_out) -> list[int]:
    kept = torch.ones(total, dtype=torch.bool)
    kept[list(left_out)] = False
    return kept.nonzero().flatten().tolist()


def _held_out_units(units: list[int], n: int) -> tuple[list[int], list[int], dict]:
    """held_out_documents where the data records each window's document (the article of its first token): window w
    touches the documents from units[w] to units[w + 1]."""
    import numpy as np
    first = np.asarray(units)
    last = np.append(first[1:], first[-1])
    total, held_docs = len(first), np.zeros(int(last.max()) + 1, bool)
    count = np.zeros(len(held_docs) + 1, np.int64)  # held documents below each id, to test a window's range at once
    for k in spread_order(n):
        window = int(np.linspace(0, total - 1, n).round()[k])
        if held_docs[first[window]]:
            continue
        held_docs[first[window]:last[window] + 1] = True
        count[1:] = np.cumsum(held_docs)
        inside = np.flatnonzero(count[last + 1] - count[first] == last - first + 1)
        if len(inside) >= n:
            break
    touched = np.flatnonzero(count[last + 1] - count[first] > 0)
    held = sorted({int(inside[int(k)]) for k in np.linspace(0, len(inside) - 1, min(n, len(inside))).round()})
    record = {"how": "whole documents kept out of training", "documents": int(held_docs.sum()),
              "held_out": len(held), "dropped": len(touched) - len(held)}
    return _others(total, touched.tolist()), held, record
