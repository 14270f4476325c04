"""Named evaluation protocols (``--protocol``): the windows of a published paper's evaluation, so that a barrier
or a loss can be set beside its numbers (docs/design.md §5, "Protocols").

``default``: the project's own (data.py: documents joined with EOS, windows of --seq-len, at most
--max-eval-tokens).

``li-shen``: WikiText-103 test at 512 tokens without a sliding window, as the Hugging Face perplexity recipe cuts
it with a stride equal to the window: the split's rows (each line of the raw file with its line break, a blank line
an empty row, as the ``datasets`` WikiText loader gives them) joined with "\\n\\n", tokenised at once without special
tokens, cut into consecutive non-overlapping 512-token windows; the ragged tail is dropped (the recipe evaluates it
as a shorter last window) and the whole split is evaluated.  Each window predicts its 511 tokens after the first
(the recipe's labels are the inputs, shifted inside the model); the loss is the mean over them.  An article starts at
a title line (`` = Title = ``; a section heading is `` = = Section = = ``): a window's document, for the bootstrap
and for splits, is the article of its first token.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import DataError, OptionError

PROTOCOLS = ("default", "li-shen")
LI_SHEN_SEQ_LEN = 512
LI_SHEN_JOIN = "\n\n"
_TITLE = re.compile(r" = [^=].* = \n?")  # " = Robert Boulter = \n"; " = = Career = = \n" is a section


def is_title(row: str) -> bool:
    return _TITLE.fullmatch(row) is not None


def wikitext_rows(spec: str, text_field: str = "text") -> list[str]:
    """The rows of a WikiText split as the ``datasets`` loader gives them: a local WikiText-format file (such as
    wiki.test.raw) read line by line, blank lines as empty rows; a saved dataset or a datasets spec as stored."""
    from .data import _texts_from_dataset
    from .data_specs import is_saved_dataset, load_datasets_spec, load_saved_dataset
    path = Path(spec).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise DataError(f"--protocol li-shen: {spec} is not UTF-8 text; give a WikiText-format file "
                            "(wiki.test.raw)") from error
        rows = [line if line.strip() else "" for line in text.splitlines(keepends=True)]
    elif path.is_dir() and is_saved_dataset(path):
        rows = _texts_from_dataset(load_saved_dataset(spec, path, None), spec, text_field)
    elif path.exists():
        raise DataError(f"--protocol li-shen reads one WikiText split: {spec} is a folder; give the split's file "
                        "(wiki.test.raw), a saved dataset or a datasets spec (wikitext:wikitext-103-raw-v1:test)")
    else:
        rows = _texts_from_dataset(load_datasets_spec(spec, None), spec, text_field)
    if not any(is_title(row) for row in rows):
        raise DataError(f"--protocol li-shen: {spec} has no WikiText title line (' = Title = '); give WikiText-103 "
                        "test (wiki.test.raw or wikitext:wikitext-103-raw-v1:test)")
    return rows


def li_shen_windows(rows: list[str], tokenizer, seq_len: int = LI_SHEN_SEQ_LEN) -> tuple:
    """(windows: a LongTensor [n, seq_len], the article of each window's first token, what the report records)."""
    import numpy as np
    import torch
    text = LI_SHEN_JOIN.join(rows)
    starts, at = [], 0  # where each article starts in the joined text
    for row in rows:
        if is_title(row):
            starts.append(at)
        at += len(row) + len(LI_SHEN_JOIN)
    if getattr(tokenizer, "is_fast", False):  # tokenised at once, the articles placed by the tokens' offsets
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = encoded["input_ids"]
        first_char = np.array([begin for begin, _ in encoded["offset_mapping"]], dtype=np.int64)
    else:  # a slow tokenizer has no offsets: article by article (each cut falls before a title line's space)
        ids, first_char = [], []
        cuts = sorted({0, *starts, len(text)})
        for begin, end in zip(cuts, cuts[1:]):
            piece = tokenizer(text[begin:end], add_special_tokens=False, verbose=False)["input_ids"]
            ids += piece
            first_char += [begin] * len(piece)
        first_char = np.array(first_char, dtype=np.int64)
    n = len(ids) // seq_len
    if n < 1:
        raise DataError(f"--protocol li-shen: the data gives {len(ids)} tokens, fewer than one window of {seq_len}")
    article = np.searchsorted(np.array(starts), first_char[:n * seq_len:seq_len], side="right") - 1
    from .data import window_counts
    info = {"protocol": "li-shen", **window_counts(n, seq_len), "articles": int(len(starts)),
            "dropped_tail_tokens": len(ids) - n * seq_len, "join": LI_SHEN_JOIN, "special_tokens": False}
    windows = torch.tensor(ids[:n * seq_len], dtype=torch.long).view(n, seq_len)
    return windows, np.maximum(article, 0).tolist(), info


def check_protocol(options) -> list[str]:
    """The option problems of --protocol (MergeOptions.check)."""
    if options.protocol not in PROTOCOLS:
        return [f"unknown --protocol {options.protocol!r}; choose one of {', '.join(PROTOCOLS)}"]
    if options.protocol != "li-shen":
        return []
    problems = []
    from dataclasses import fields
    cap = next(f.default for f in fields(options) if f.name == "max_eval_tokens")
    if options.max_eval_tokens != cap:
        problems.append("--protocol li-shen evaluates the whole WikiText-103 test split: drop --max-eval-tokens")
    if options.seq_len not in (None, LI_SHEN_SEQ_LEN):
        problems.append(f"--protocol li-shen evaluates windows of {LI_SHEN_SEQ_LEN} tokens: drop --seq-len "
                        f"{options.seq_len}")
    return problems


def load_protocol_data(protocol: str, spec: str, template, text_field: str = "text"):
    """The EvalData of a named protocol's evaluation (--data), for the template's tokenizer."""
    from .eval_data import EvalData, check_seq_len
    if template.task != "causal-lm":
        raise OptionError(f"--protocol {protocol} is a language-model evaluation; {template.source} is an image "
                          "classifier: drop --protocol")
    check_seq_len(LI_SHEN_SEQ_LEN, template)
    windows, units, info = li_shen_windows(wikitext_rows(spec, text_field),
                                           template.backend.tokenizer(template.folder))
    return EvalData("causal-lm", windows, None, {"spec": spec, **info}, units)
