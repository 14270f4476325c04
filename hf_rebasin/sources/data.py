"""The ``--data`` layer: turn a data spec into evaluation batches.

Text specs (``read_texts``), tried in this order:

* an existing file ending in ``.jsonl`` (or ``.json``): JSON lines (or a JSON array) of records; the text is each
  record's ``text_field``;
* any other existing file: its whole content, one document (it must decode as UTF-8);
* an existing folder written by ``datasets.Dataset.save_to_disk``: loaded with ``datasets.load_from_disk``;
* any other existing folder: every file under it, recursively, sorted by relative path, one document each;
  hidden files and folders (names starting with ``.``) are skipped, and so are files that are not UTF-8 text
  (a NUL byte in the first 8 KiB, or a decode error);
* a local-looking spec that does not exist (absolute or ``./`` / ``../`` / ``~`` path, a file suffix, or more than
  one ``/``) is an error, never a Hub lookup;
* otherwise a ``datasets`` spec ``NAME[:CONFIG[:SPLIT]]``:

  - ``NAME`` a Hub id (``wikitext:wikitext-103-raw-v1:test``, ``Salesforce/wikitext:wikitext-2-raw-v1``): calls
    ``datasets.load_dataset(NAME, CONFIG, split=SPLIT)``; the default split is ``test``;
  - ``NAME`` one of the packaged local loaders of ``datasets`` (``json``, ``csv``, ``text``, ``parquet``,
    ``arrow``, ``imagefolder``, ...): ``CONFIG`` is then a local file/glob (passed as ``data_files``) or a folder
    (passed as ``data_dir``), e.g. ``json:corpus/*.jsonl`` or ``imagefolder:pets/``; the default split is
    ``train`` (what those loaders name a single split).

  A SPLIT in the spec wins over the ``split`` argument.  Spec parts are separated by ``:``, so a path inside a
  spec cannot itself contain ``:``.

Documents that are empty or only whitespace are dropped; nothing left is an error.

The token protocol (``token_windows``) is fixed so that barrier numbers are comparable between runs: every
document is tokenised without special tokens, documents are joined with the tokenizer's EOS id (when it has one),
and the stream is cut into consecutive non-overlapping windows of exactly ``seq_len`` tokens; the ragged tail is
dropped and only the first ``max_tokens // seq_len`` windows are kept.

Image specs (``read_images``, images.py): an ImageFolder directory, an ``.npz`` with ``images`` and ``labels``, a
``save_to_disk`` folder, or a ``datasets`` spec as above whose rows have an ``image``/``img`` and a
``label``/``labels`` column.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ..errors import DataError
from .data_specs import (
    check_spec_exists,
    is_saved_dataset,
    load_datasets_spec,
    load_saved_dataset,
    looks_like_path,
)
from .images import read_images  # re-exported: the one --data layer

__all__ = ["DataError", "check_spec_exists", "read_texts", "token_windows", "load_token_windows", "read_images",
           "split_text"]

JSON_LINES_SUFFIXES = (".jsonl", ".json", ".ndjson")
_BINARY_SNIFF_BYTES = 8192


# ---------------------------------------------------------------------------------------------------------- text

def _decode_text_file(path: Path) -> str | None:
    """The file's text, or None when it is not UTF-8 text."""
    raw = path.read_bytes()
    if b"\x00" in raw[:_BINARY_SNIFF_BYTES]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _visible_files(folder: Path) -> list[Path]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(Path(root) / name for name in files if not name.startswith("."))
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _read_json_records(path: Path) -> list:
    text = _decode_text_file(path)
    if text is None:
        raise DataError(f"{path} is not a UTF-8 text file; a JSON lines file needs one JSON record per line")
    stripped = text.lstrip()
    if path.suffix == ".json" and stripped.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise DataError(f"{path} is not valid JSON ({error}); give a JSON array or one record per line") from error
        return records
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise DataError(f"{path} line {number} is not valid JSON ({error.msg}); a .jsonl file needs one JSON "
                            f"object per line") from error
    return records


def _texts_from_records(records: Iterable, where: str, text_field: str) -> Iterator[str]:
    for number, record in enumerate(records, start=1):
        if not isinstance(record, dict):
            raise DataError(f"{where} record {number} is a {type(record).__name__}, not an object with a "
                            f"{text_field!r} field")
        if text_field not in record:
            raise DataError(f"{where} record {number} has no field {text_field!r}; its fields are "
                            f"{sorted(record)}. Choose one with --text-field")
        value = record[text_field]
        if not isinstance(value, str):
            raise DataError(f"{where} record {number} field {text_field!r} is a {type(value).__name__}, not text; "
                            f"choose a text field with --text-field (fields: {sorted(record)})")
        yield value


def _texts_from_dataset(dataset, spec: str, text_field: str) -> list[str]:
    columns = list(dataset.column_names)
    if text_field not in columns:
        raise DataError(f"dataset {spec!r} has no column {text_field!r}; its columns are {columns}. "
                        f"Choose one with --text-field")
    texts = dataset[text_field]
    texts = list(texts) if not isinstance(texts, list) else texts
    if texts and not isinstance(texts[0], str):
        raise DataError(f"dataset {spec!r} column {text_field!r} holds {type(texts[0]).__name__}, not text; "
                        f"choose a text column with --text-field (columns: {columns})")
    return texts


def read_texts(spec: str, *, text_field: str = "text", split: str | None = None) -> list[str]:
    """The documents named by ``spec`` (see the module docstring for the spec forms), in a fixed order."""
    spec = str(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() in JSON_LINES_SUFFIXES:
            texts = list(_texts_from_records(_read_json_records(path), str(path), text_field))
        else:
            text = _decode_text_file(path)
            if text is None:
                raise DataError(f"{path} is not a UTF-8 text file; give a .txt file, a folder of text files, "
                                f"a .jsonl file with a {text_field!r} field, or a datasets spec")
            texts = [text]
    elif path.is_dir():
        if is_saved_dataset(path):
            texts = _texts_from_dataset(load_saved_dataset(spec, path, split), spec, text_field)
        else:
            texts = [text for file in _visible_files(path) if (text := _decode_text_file(file)) is not None]
    elif looks_like_path(spec):
        raise DataError(f"no such file or folder: {spec!r}; give an existing .txt/.jsonl file or folder of text "
                        f"files, or a datasets spec NAME[:CONFIG[:SPLIT]] (e.g. wikitext:wikitext-103-raw-v1:test)")
    else:
        texts = _texts_from_dataset(load_datasets_spec(spec, split), spec, text_field)
    texts = [text for text in texts if text and not text.isspace()]
    if not texts:
        raise DataError(f"data spec {spec!r} contains no text; give a file or dataset with non-empty documents")
    return texts


def iter_texts(spec: str, *, text_field: str = "text", split: str | None = None) -> Iterator[str]:
    """The documents of ``spec`` in ``read_texts``'s order, read as they are consumed: a .jsonl file line by line,
    a folder file by file, a saved dataset row by row and a ``datasets`` spec as a streaming split (so a corpus
    larger than memory can be tokenised).  A plain text file is one document, read whole."""
    spec = str(spec)
    path = Path(spec).expanduser()
    found = False
    if path.is_file() and path.suffix.lower() in JSON_LINES_SUFFIXES and not _is_json_array(path):
        documents = _texts_from_records(_jsonl_records(path), str(path), text_field)
    elif path.is_dir() and not is_saved_dataset(path):
        documents = (text for file in _visible_files(path) if (text := _decode_text_file(file)) is not None)
    elif path.is_file() or looks_like_path(spec):
        documents = iter(read_texts(spec, text_field=text_field, split=split))
    else:
        dataset = (load_saved_dataset(spec, path, split) if path.is_dir()
                   else load_datasets_spec(spec, split, streaming=True))
        documents = _texts_from_records(dataset, f"dataset {spec!r}", text_field)
    for text in documents:
        if text and not text.isspace():
            found = True
            yield text
    if not found:
        raise DataError(f"data spec {spec!r} contains no text; give a file or dataset with non-empty documents")


def _is_json_array(path: Path) -> bool:
    """A .json file holding one JSON array (read whole), not JSON lines: judged from its first 4 KiB."""
    if path.suffix != ".json":
        return False
    with open(path, "rb") as head:
        return head.read(4096).lstrip().startswith(b"[")


def _jsonl_records(path: Path) -> Iterator:
    with open(path, encoding="utf-8", errors="strict") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path} line {number} is not valid JSON ({error.msg}); a .jsonl file needs one JSON "
                                f"object per line") from error


# -------------------------------------------------------------------------------------------------------- tokens

_CHUNK_CHARS = 200_000  # long documents are tokenised piece by piece, split at line breaks (see _chunks)
_BATCH_PIECES = 64
_PROGRESS_MIN_CHARS = 8_000_000  # a progress bar for inputs that take more than a few seconds

# A line break with non-space characters on both sides: for byte-level BPE tokenizers (GPT-2, GPT-NeoX, LLaMA-3,
# OLMo) the pre-tokeniser always makes such a '\n' its own piece, so cutting right after it does not change the ids.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")
# Else a single space between two non-space characters: the pre-tokeniser ends the previous piece before it and
# starts the next piece with it (" word"), so cutting before it is safe too.  (Not a space inside a run of
# spaces, as in indented code: the run is split as "   " + " x", which a cut inside it would change.)
_SAFE_SPACE = re.compile(r"(?<=\S) (?=\S)")


def _last_cut(text: str, begin: int, end: int) -> int | None:
    """The last safe cut in (begin, end): a safe line break if there is one, else a safe space."""
    for pattern in (_SAFE_CUT, _SAFE_SPACE):
        cuts = [m.start() for m in pattern.finditer(text, begin, end) if m.start() > begin]
        if cuts:
            return cuts[-1]
    return None


def _chunks(text: str, size: int) -> list[str]:
    """Pieces of about `size` characters that tokenise to the same ids as the whole text: cut only where
    the pre-tokeniser cuts anyway (a piece is longer than `size` when no such place comes sooner)."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = _last_cut(text, start + size // 2, start + size) or _last_cut(text, start, start + size)
        if cut is None:
            found = _SAFE_CUT.search(text, start + size) or _SAFE_SPACE.search(text, start + size)
            if found is None:
                break
            cut = found.start()
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def token_stream(texts: Iterable[str], tokenizer) -> Iterator[tuple[int, list[int]]]:
    """The token ids of the documents under the fixed protocol, a batch of pieces at a time: (characters, ids).
    Documents are tokenised without special tokens in pieces (``_chunks``) and joined with EOS."""
    eos = getattr(tokenizer, "eos_token_id", None)
    batch: list[tuple[int, str]] = []  # (document index, piece); EOS goes wherever the document index changes
    previous_doc = None

    def encode(batch):
        nonlocal previous_doc
        encoded = tokenizer([piece for _, piece in batch], add_special_tokens=False, verbose=False)["input_ids"]
        ids: list[int] = []
        for (doc, _), piece_ids in zip(batch, encoded):
            if previous_doc is not None and doc != previous_doc and eos is not None:
                ids.append(eos)
            previous_doc = doc
            ids.extend(piece_ids)
        return sum(len(piece) for _, piece in batch), ids

    for doc, text in enumerate(texts):
        for piece in _chunks(text, _CHUNK_CHARS):
            batch.append((doc, piece))
            if len(batch) == _BATCH_PIECES:
                yield encode(batch)
                batch = []
    if batch:
        yield encode(batch)


def token_windows(texts: list[str], tokenizer, seq_len: int, max_tokens: int | None = None,
                  max_tokens_flag: str = "--max-eval-tokens") -> torch.Tensor:
    """LongTensor (n_windows, seq_len): the fixed windowing protocol of the module docstring."""
    from ..progress import tqdm

    if isinstance(texts, str):
        texts = [texts]
    if seq_len < 1:
        raise DataError(f"--seq-len must be at least 1, got {seq_len}")  # (merge checks for at least 2 first)
    if max_tokens is not None and max_tokens < seq_len:
        raise DataError(f"{max_tokens_flag} {max_tokens} is smaller than --seq-len {seq_len}; no full window fits. "
                        f"Raise {max_tokens_flag} or lower --seq-len")
    needed = None if max_tokens is None else (max_tokens // seq_len) * seq_len
    n_chars = sum(map(len, texts))
    ids: list[int] = []
    bar = tqdm(total=n_chars, desc="tokenising", unit="char", unit_scale=True, disable=n_chars < _PROGRESS_MIN_CHARS)
    try:
        for chars, batch_ids in token_stream(texts, tokenizer):
            ids.extend(batch_ids)
            bar.update(chars)
            if needed is not None and len(ids) >= needed:
                break
    finally:
        bar.close()

    n_windows = len(ids) // seq_len
    if needed is not None:
        n_windows = min(n_windows, needed // seq_len)
    if n_windows < 1:
        raise DataError(f"the data gives only {len(ids)} tokens, fewer than one window of --seq-len {seq_len}; "
                        f"use a smaller --seq-len or more text")
    return torch.tensor(ids[:n_windows * seq_len], dtype=torch.long).view(n_windows, seq_len)


def window_counts(windows: int, seq_len: int) -> dict:
    """The counts a report gives of token windows: ``tokens`` the predicted tokens (every window predicts all its
    tokens but the first), ``input_tokens`` the tokens read, ``windows`` and ``seq_len``."""
    return {"tokens": windows * (seq_len - 1), "input_tokens": windows * seq_len, "seq_len": seq_len,
            "windows": windows}


def load_token_windows(spec: str, tokenizer, seq_len: int, max_tokens: int | None = None, text_field: str = "text",
                       max_tokens_flag: str = "--max-eval-tokens") -> tuple[torch.Tensor, dict]:
    """``read_texts`` then ``token_windows``; also the ``data`` record for barrier.json."""
    windows = token_windows(read_texts(spec, text_field=text_field), tokenizer, seq_len, max_tokens, max_tokens_flag)
    return windows, {"spec": spec, **window_counts(windows.shape[0], seq_len)}


def split_text(text: str, fractions: tuple[float, float, float] = (0.9, 0.05, 0.05)) -> tuple[str, str, str]:
    """A fixed contiguous split by characters: the first ``fractions[0]`` of the text is train, the next
    ``fractions[1]`` val, the rest test.  Boundaries are ``floor(len * f0)`` and ``floor(len * (f0 + f1))``."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or not math.isclose(sum(fractions), 1.0, abs_tol=1e-9):
        raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {fractions}")
    first = math.floor(len(text) * fractions[0])
    second = max(first, math.floor(len(text) * (fractions[0] + fractions[1])))
    return text[:first], text[first:second], text[second:]


