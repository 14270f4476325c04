"""Writing files and folders so that nothing is lost and nothing is left half-written.

* ``atomic_write``: a temporary file beside the target, then ``os.replace``.
* ``atomic_output_dir``: an output folder is built in a temporary sibling and swapped into place at the end.
  An existing folder is replaced by an atomic exchange (Linux ``renameat2(RENAME_EXCHANGE)``; elsewhere two
  renames with the old folder restored on failure) and removed only after the new one is in place: at every
  moment the target holds either the whole old output or the whole new one.
* ``edited_dir``: edit an existing folder (eval) through a hard-linked staging copy swapped in the same way;
  ``linked_copy``: such a copy that is only read (what push uploads) and then removed.
* Where an output may go and what ``--force`` may replace: ownership.py.
Output folders and files follow the umask, like any file the user makes."""
from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import OutputError

if TYPE_CHECKING:
    import torch

STAGING_TAG = ".hf-rebasin-"  # temporary siblings: .NAME.hf-rebasin-PID-XXXX
DEFAULT_SHARD_BYTES = 5 * 10**9  # "5GB", as transformers' save_pretrained


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write data to path through a temporary file in the same folder (the old file stays until the end)."""
    path = Path(path)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _staging_dir(target: Path, kind: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING_TAG}{os.getpid()}-{kind}-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it private; the output is an ordinary folder
    return tmp


def follow_umask(folder: Path) -> None:
    """Give every file and folder under `folder` the mode a new one gets from the umask (some writers, such as
    safetensors, make their files private)."""
    mask = current_umask()
    for path in folder.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def remove_stale_staging(target: Path) -> None:
    """Remove temporary siblings of target left by hf-rebasin processes that no longer run (killed ones).
    A replacement without renameat2 moves the old output aside (kind "old") before the new one takes its place:
    if that process was killed between the two renames, the old output is put back, never removed."""
    prefix = f".{target.name}{STAGING_TAG}"
    for sibling in sorted(target.parent.glob(f"{glob.escape(prefix)}*")):
        pid, _, kind = sibling.name[len(prefix):].partition("-")
        if not pid.isdigit() or _running(int(pid)):
            continue
        if kind.startswith("old-") and sibling.is_dir() and not os.path.lexists(target):
            sibling.rename(target)
        elif sibling.is_dir():
            shutil.rmtree(sibling, ignore_errors=True)
        else:
            sibling.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this file system cannot exchange
        return False
    raise OSError(error, os.strerror(error), str(b))


def replace_dir(new: Path, target: Path) -> None:
    """Put the folder `new` at `target`; an existing target is removed only once `new` is in place."""
    if not target.exists():
        new.rename(target)
        return
    if _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old output
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING_TAG}{os.getpid()}-old-", dir=target.parent))
    old.rmdir()
    target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged_dir(out: Path):
    """Yield a temporary folder beside `out`; it replaces `out` only when the block succeeds (else it is removed
    and `out` is left as it was)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    tmp = _staging_dir(out, "new")
    try:
        yield tmp
        follow_umask(tmp)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _link_tree(folder: Path, stage: Path) -> None:
    for path in folder.rglob("*"):
        target = stage / path.relative_to(folder)
        if path.is_dir():
            target.mkdir(exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)


@contextmanager
def linked_copy(folder: str | Path, kind: str = "copy"):
    """Yield a temporary copy of `folder` beside it (files hard-linked, so nothing is copied), removed at the
    end.  Write into it only by replacing files (atomic_write), never in place: the files are shared."""
    folder = Path(folder).absolute()
    remove_stale_staging(folder)
    stage = _staging_dir(folder, kind)
    try:
        _link_tree(folder, stage)
        yield stage
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)


@contextmanager
def edited_dir(folder: str | Path):
    """Yield a linked copy of `folder` that replaces `folder` only when the block succeeds."""
    folder = Path(folder).absolute()
    with linked_copy(folder, "edit") as stage:
        yield stage
        replace_dir(stage, folder)


# --- sharded safetensors ---------------------------------------------------------------------------

def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}
    number = text.strip().upper().rstrip()
    unit = number.lstrip("0123456789.")
    try:
        value = float(number[: len(number) - len(unit)])
    except ValueError:
        raise OutputError(f"{text!r} is not a size: write e.g. 5GB, 500MB or 2GiB") from None
    if unit.strip() not in units or value <= 0:
        raise OutputError(f"{text!r} is not a size: write e.g. 5GB, 500MB or 2GiB")
    return int(value * units[unit.strip()])


class ShardWriter:
    """Write tensors, added one at a time, into safetensors shards of at most max_bytes (a tensor larger than
    that gets a shard of its own): PREFIX.safetensors when one shard holds everything, else
    PREFIX-00001-of-0000N.safetensors and PREFIX.safetensors.index.json, as the Hub's checkpoints.  Only the
    shard being filled is held in memory; shards are written under temporary names and renamed at the end."""

    def __init__(self, folder: str | Path, prefix: str = "model", max_bytes: int = DEFAULT_SHARD_BYTES,
                 metadata: dict | None = None):
        self.folder, self.prefix, self.max_bytes = Path(folder), prefix, max_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes, self.total_bytes = 0, 0
        self.shards: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.detach().contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file
        if not self.pending:
            return
        path = self.folder / f".{self.prefix}-shard{len(self.shards) + 1:05d}.partial"
        save_file(self.pending, str(path), metadata=self.metadata)
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        self._flush()
        if len(self.shards) == 1:
            final = [self.folder / f"{self.prefix}.safetensors"]
        else:
            n = len(self.shards)
            final = [self.folder / f"{self.prefix}-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        weight_map = {}
        for (path, names), target in zip(self.shards, final):
            os.chmod(path, 0o666 & ~current_umask())
            path.rename(target)
            weight_map.update({name: target.name for name in names})
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            atomic_write(self.folder / f"{self.prefix}.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        return final

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind, error, trace) -> bool:
        if kind is None:
            self.close()
        else:
            for path, _ in self.shards:
                path.unlink(missing_ok=True)
        return False
