"""Token files: training data for learned matching that never sits in RAM.

``write_token_file`` tokenises a text spec as it is read (``data.iter_texts``: a ``datasets`` spec as a streaming
split, files one at a time) under the same protocol as ``data.token_windows`` and writes the ids as one flat
``.npy`` array (uint16 when the vocabulary fits, else uint32), with ``FILE.npy.json`` beside it saying what it holds.
``TokenWindows`` reads such a file memory-mapped: the windows of a batch are read from disk when the batch asks
for them, so 10^8-10^9 training tokens cost page cache, not process memory.  The windows are those
``token_windows`` makes of the same text (same ids, same order, same dropped tail), so content digests and
train/eval overlap checks compare them with text-derived windows directly.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError

TOKEN_FILE_SUFFIX = ".npy"
_READ_WINDOWS = 4096  # windows per read when iterating or scanning


def is_token_file(spec: str) -> bool:
    return str(spec).endswith(TOKEN_FILE_SUFFIX) and Path(spec).expanduser().is_file()


def metadata_path(path: str | Path) -> Path:
    """What a token file holds: FILE.npy.json beside FILE.npy."""
    path = Path(path).expanduser()
    return path.with_name(path.name + ".json")


class TokenWindows:
    """The windows of ``seq_len`` tokens of a token file, indexed like a LongTensor of shape (n, seq_len)
    (an int, a slice, or a tensor / array of window indices), read only when indexed."""

    def __init__(self, path: str | Path, seq_len: int, max_windows: int | None = None):
        path = Path(path).expanduser()
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as error:
            raise DataError(f"{path} is not a readable .npy token file ({error}); write one with "
                            "`hf-rebasin tokenize`") from error
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise DataError(f"{path} holds an array of shape {tuple(array.shape)} and dtype {array.dtype}; a token "
                            "file is one flat array of integer token ids (write one with `hf-rebasin tokenize`)")
        n = len(array) // seq_len
        if max_windows is not None:
            n = min(n, max_windows)
        if n < 1:
            raise DataError(f"{path} holds {len(array)} tokens, fewer than one window of --seq-len {seq_len}")
        self.path, self.array, self.seq_len, self.n = path, array, seq_len, n
        self.rows: np.ndarray | None = None  # a selection of the file's windows (select()), else all n

    def select(self, index) -> TokenWindows:
        """The windows at `index` (a view: nothing is read)."""
        chosen = copy.copy(self)
        rows = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index, dtype=np.int64).reshape(-1)
        chosen.rows = rows if self.rows is None else self.rows[rows]
        chosen.n = len(rows)
        return chosen

    def __len__(self) -> int:
        return self.n

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.seq_len)

    def numel(self) -> int:
        return self.n * self.seq_len

    def _block(self, start: int, stop: int) -> torch.Tensor:
        flat = np.asarray(self.array[start * self.seq_len:stop * self.seq_len], dtype=np.int64)
        return torch.from_numpy(flat).view(stop - start, self.seq_len)

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, (int, np.integer)):
            i = int(index) + (self.n if index < 0 else 0)
            if not 0 <= i < self.n:
                raise IndexError(f"window {index} of {self.n}")
            return self[np.array([i])][0]
        if isinstance(index, slice):
            start, stop, step = index.indices(self.n)
            if step == 1 and self.rows is None:
                return self._block(start, max(start, stop))
            index = np.arange(start, stop, step)
        rows = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index, dtype=np.int64).reshape(-1)
        if len(rows) and (rows.min() < -self.n or rows.max() >= self.n):
            raise IndexError(f"window index out of range for {self.n} windows")
        rows = rows % self.n
        if self.rows is not None:
            rows = self.rows[rows]
        positions = rows[:, None] * self.seq_len + np.arange(self.seq_len)
        return torch.from_numpy(np.asarray(self.array[positions], dtype=np.int64))

    def _chunks(self):
        for start in range(0, self.n, _READ_WINDOWS):
            yield self[start:min(self.n, start + _READ_WINDOWS)]

    def __iter__(self):
        for chunk in self._chunks():
            yield from chunk

    def max_id(self) -> int:
        return max(int(chunk.max()) for chunk in self._chunks())

    def digest(self) -> str:
        """sha256 of the ids used (their int64 bytes, as a LongTensor of the same windows would give)."""
        h = hashlib.sha256()
        for chunk in self._chunks():
            h.update(chunk.numpy().tobytes())
        return h.hexdigest()[:16]


def vocabulary_digest(tokenizer) -> str:
    """Which tokenizer: a hash of its vocabulary (token -> id)."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]


def open_token_windows(spec: str, seq_len: int, vocab_size: int, max_tokens: int | None = None,
                       flag: str = "--train-data", tokenizer=None) -> tuple[TokenWindows, dict]:
    """A token file's windows, checked against the model's tokenizer (when given, against the vocabulary the
    file's .json records) and its embedding size (every id must have a row), and its ``data`` record."""
    windows = TokenWindows(spec, seq_len, None if max_tokens is None else max_tokens // seq_len)
    meta_file = metadata_path(spec)
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    if tokenizer is not None and meta.get("vocabulary_digest") not in (None, vocabulary_digest(tokenizer)):
        raise DataError(f"{flag} {spec} was tokenised with the tokenizer of {meta.get('tokenizer')!r}, not this "
                        "model's (their vocabularies differ). Tokenise the text again with this model: "
                        "hf-rebasin tokenize DATA --model MODEL --out FILE.npy")
    top = windows.max_id()
    if top >= vocab_size:
        raise DataError(f"{flag} {spec} holds token id {top}, outside this model's vocabulary of {vocab_size:,} ids: "
                        "it was tokenised for another model. Tokenise the text again with `hf-rebasin tokenize`")
    from .data import window_counts
    info = {"spec": str(spec), **window_counts(len(windows), seq_len), "memory_mapped": True}
    if meta.get("source"):
        info["tokenized_from"] = meta["source"]
    return windows, info


def write_token_file(spec: str, tokenizer, out: str | Path, *, text_field: str = "text", split: str | None = None,
                     max_tokens: int | None = None, tokenizer_name: str = "", progress: bool = True) -> dict:
    """Tokenise ``spec`` as it is read and write ``out`` (.npy) and its .json; returns the .json record.
    Written to temporary files renamed at the end: a failure or Ctrl-C leaves nothing behind."""
    from ..progress import tqdm
    from .data import iter_texts, token_stream

    def chunks():
        count = 0
        with tqdm(desc="tokenising", unit="tok", unit_scale=True, disable=not progress) as bar:
            for _, ids in token_stream(iter_texts(spec, text_field=text_field, split=split), tokenizer):
                if max_tokens is not None:
                    ids = ids[:max_tokens - count]
                yield ids
                count += len(ids)
                bar.update(len(ids))
                if max_tokens is not None and count >= max_tokens:
                    break

    record = {"format": "hf-rebasin-tokens/1", "source": str(spec), "text_field": text_field, "split": split,
              "max_tokens": max_tokens}
    return write_ids(chunks(), tokenizer, out, record, tokenizer_name=tokenizer_name)


def write_ids(chunks, tokenizer, out: str | Path, record: dict, *, tokenizer_name: str = "") -> dict:
    """Write the token ids of ``chunks`` (an iterable of id sequences, consumed once) as the token file ``out``
    (.npy) and its .json: ``record`` plus what every token file records (tokenizer, vocabulary digest, dtype,
    count); returns the .json record.  Temporary files renamed at the end: a failure leaves nothing behind."""
    out = Path(out).expanduser()
    if out.suffix != TOKEN_FILE_SUFFIX:
        raise DataError(f"--out {out}: a token file is written as .npy (e.g. {out.with_suffix('.npy').name})")
    vocab_size = len(tokenizer)
    dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw, partial = out.with_name(f".{out.name}.ids.partial"), out.with_name(f".{out.name}.partial")
    meta_partial = out.with_name(f".{out.name}.json.partial")
    count = 0
    try:
        with open(raw, "wb") as sink:
            for ids in chunks:
                sink.write(np.asarray(ids, dtype=dtype).tobytes())
                count += len(ids)
        with open(partial, "wb") as target, open(raw, "rb") as source:
            np.lib.format.write_array_header_1_0(target, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                          "fortran_order": False, "shape": (count,)})
            while chunk := source.read(1 << 24):
                target.write(chunk)
        record = {"format": "hf-rebasin-tokens/1", **record, "tokenizer": tokenizer_name, "vocab_size": vocab_size,
                  "vocabulary_digest": vocabulary_digest(tokenizer), "eos_token_id": tokenizer.eos_token_id,
                  "dtype": dtype.name, "tokens": count}
        meta_partial.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(partial, out)
        os.replace(meta_partial, metadata_path(out))
    finally:
        for leftover in (raw, partial, meta_partial):
            leftover.unlink(missing_ok=True)
    return record
