"""Where hf-rebasin may write, and what it may replace: one rule for every file and folder it writes (--out,
--json, tokenize's token files, --self-samples-dir, --checkpoint-dir, eval.json, push's staging).

* Never inside (or onto) a local source model, nor a local --data / --match-data / --train-data file or folder.
* Never over a file it did not write, unless --force where a command has one; a folder is replaced (--force)
  only when every file in it is one hf-rebasin wrote: an output folder records its files, with their sizes, in
  ``MANIFEST`` (written last, inside the staged folder); a file it does not list, or whose size changed, is the
  user's, and --force then refuses, naming it.  An output of an earlier version (no manifest) is replaced only
  when it holds nothing but the names a merge writes.
* Every place is proven writable before the work (a temporary file or folder made there and removed), and is
  written atomically (io.atomic_write, io.staged_dir)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputError
from ..evaluation.report import REPORT_FILE, REQUIRED
from .io import _staging_dir, atomic_write, staged_dir

MANIFEST = ".hf-rebasin.manifest.json"  # not STAGING_TAG (".hf-rebasin-"): a record, not staging
MANIFEST_FORMAT = "hf-rebasin-output/1"
# what a merge of an earlier version (no manifest) may hold: weights, transforms, report, plot, card, eval, a `run`'s
# recipe copy and the companions copied from the first model (config, generation config, tokenizer files)
LEGACY_NAMES = re.compile(r"(model|transforms)(-\d{5}-of-\d{5})?\.safetensors|(model|transforms)\.safetensors\."
                          r"index\.json|barrier\.json|barrier\.png|README\.md|eval\.json|config\.json|"
                          r"generation_config\.json|recipe\.yaml|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|"
                          r"vocab\.json|merges\.txt|tokenizer\.model|added_tokens\.json|chat_template\.jinja")
MAX_REPORT_BYTES = 64 * 2**20
LEFTOVER = re.compile(r"\..+\.(tmp|partial)")  # a temporary file of a killed write (atomic_write, ShardWriter)


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


# --- the places never written ---------------------------------------------------------------------

def local_paths(specs) -> list[Path]:
    """The specs (model sources, data specs) that name existing local files or folders, resolved."""
    found = []
    for spec in specs:
        if spec is None:
            continue
        path = Path(str(spec)).expanduser()
        if path.exists():
            found.append(path.resolve())
    return found


def check_not_protected(path: str | Path, flag: str, *, sources=(), data=()) -> None:
    """Raise OutputError if `path` (a file or folder to write) is, is inside, or holds a local source model or a
    local data file or folder."""
    path = Path(path).expanduser().resolve()
    for kind, specs in (("source model", sources), ("data", data)):
        for local in local_paths(specs):
            if _is_within(path, local) or _is_within(local, path):
                what = "folder" if local.is_dir() else "file"
                raise OutputError(f"{flag} {path} overlaps the {kind} {what} {local}: hf-rebasin never writes there; "
                                  "choose a place outside it")


# --- writable before the work ---------------------------------------------------------------------

def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def probe_folder(folder: str | Path, flag: str, *, as_folder: bool = False) -> None:
    """Prove that files (as_folder: staging folders) can be made in `folder`: make the missing folders up to it and
    a temporary file or folder there, then remove everything made.  A read-only place, /proc, a full disk or a file
    in the way is refused in one line before any work."""
    folder = Path(folder).expanduser().absolute()
    existing = nearest_existing(folder)
    if not existing.is_dir():
        raise OutputError(f"{flag} {folder}: {existing} is a file, so the folder cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {folder}: {existing} is not writable; choose a place you can write to")
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if as_folder:
            os.rmdir(tempfile.mkdtemp(prefix=".hf-rebasin-probe-", dir=folder))
        else:
            handle, name = tempfile.mkstemp(prefix=".hf-rebasin-probe-", dir=folder)
            os.close(handle)
            os.unlink(name)
    except OSError as error:
        raise OutputError(f"{flag} {folder}: nothing can be written there ({error.strerror or error}); choose a "
                          "place you can write to") from None
    finally:
        for made_folder in made:  # deepest first
            with contextlib.suppress(OSError):
                made_folder.rmdir()


def check_output_place(folder: str | Path, flag: str, *, sources=(), data=()) -> None:
    """A folder the tool writes its own files into (--self-samples-dir, --checkpoint-dir): outside the sources and
    the data, and writable."""
    check_not_protected(folder, flag, sources=sources, data=data)
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{flag} {folder} is a file, not a folder: choose a folder name")
    probe_folder(folder, flag)


def check_editable_dir(folder: str | Path, flag: str) -> None:
    """An output folder that is edited through a staging copy beside it (eval) or staged beside it (push): the
    folder and its parent must be writable."""
    folder = Path(folder).expanduser().absolute()
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {folder} is not writable; hf-rebasin writes its results into it: choose a copy "
                          "you can write to")
    probe_folder(folder.parent, flag, as_folder=True)


# --- single files ---------------------------------------------------------------------------------

def is_report_file(path: Path) -> bool:
    """Whether path holds a report hf-rebasin wrote (barrier.json's schema)."""
    try:
        if path.stat().st_size > MAX_REPORT_BYTES:  # a report is kilobytes; never read a model's weights whole
            return False
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(key in data for key in REQUIRED)


def check_output_file(path: str | Path, flag: str, *, sources=(), data=(), force: bool | None = None,
                      ours=is_report_file, make_parents: bool = False) -> None:
    """Raise OutputError if the file `path` may not be written: a folder there, inside a source model or the data,
    an existing file that `ours` does not recognise as hf-rebasin's (force=True replaces it; force=None: the
    command has no --force), or a missing (unless make_parents) or unwritable folder."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputError(f"{flag} {path} is a folder: give a file name (e.g. {path / 'barrier.json'})")
    check_not_protected(path, flag, sources=sources, data=data)
    if path.exists() and not force and not ours(path):
        fix = "pass --force to replace it or choose another name" if force is False else "choose another name"
        raise OutputError(f"{flag} {path} exists and is not a file hf-rebasin wrote: {fix}")
    parent = path.parent if str(path.parent) else Path(".")
    if make_parents:
        return probe_folder(parent, flag)
    if not parent.is_dir():
        raise OutputError(f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path}: the folder {parent} is not writable")
    probe_folder(parent, flag)


# --- output folders -------------------------------------------------------------------------------

def folder_files(folder: Path) -> dict[str, int]:
    """{relative path: size} of every file (and link) under folder, but the manifest; links are not followed."""
    files = {}
    for root, dirs, names in os.walk(folder):
        base = Path(root)
        for name in names + [d for d in dirs if (base / d).is_symlink()]:
            path = base / name
            rel = path.relative_to(folder).as_posix()
            if rel != MANIFEST:
                files[rel] = -1 if path.is_symlink() else path.stat().st_size
        for name in dirs:
            if not (base / name).is_symlink() and not any((base / name).iterdir()):
                files[(base / name).relative_to(folder).as_posix() + "/"] = -1  # an empty folder: someone made it
    return files


def write_manifest(folder: Path) -> None:
    """Record every file of a freshly staged output folder (called last, before the swap)."""
    manifest = {"format": MANIFEST_FORMAT, "files": folder_files(folder)}
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def recorded_files(folder: Path) -> dict[str, int] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    return manifest.get("files") or {}


def record_files(folder: Path, names: list[str]) -> None:
    """Add (or refresh) files hf-rebasin has just written into an output folder (eval.json, the card) to its
    manifest; an output without a manifest (an earlier version's) is left so."""
    files = recorded_files(folder)
    if files is None:
        return
    files.update({name: (folder / name).stat().st_size for name in names})
    atomic_write(folder / MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1,
                                               sort_keys=True) + "\n")


def foreign_files(folder: Path) -> list[str]:
    """The files of an output folder that hf-rebasin did not write (or that changed since), sorted."""
    recorded = recorded_files(folder)
    foreign = []
    for rel, size in sorted(folder_files(folder).items()):
        if LEFTOVER.fullmatch(Path(rel).name):
            continue
        if recorded is not None:
            if recorded.get(rel) != size or size < 0:
                foreign.append(rel + (" (changed)" if rel in recorded else ""))
        elif "/" in rel or not LEGACY_NAMES.fullmatch(rel):
            foreign.append(rel)
    return foreign


def check_output_dir(out: str | Path, *, force: bool, sources: tuple = (), data: tuple = (), flag: str = "--out",
                     probe: bool = False) -> None:
    """Raise OutputError if `out` cannot receive an output folder; with force, if it is not ours to replace.
    probe: prove it by making (and removing) the staging folder beside it, as the export will."""
    out = Path(out).expanduser().resolve()
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if out.exists() and not out.is_dir():
        raise OutputError(f"{flag} {out} is a file, not a folder: choose a folder name")
    check_not_protected(out, flag, sources=sources, data=data)
    if out.exists():
        if _is_within(cwd, out) or out in (home, Path(out.anchor)):
            raise OutputError(f"{flag} {out} is the current folder, one of its parents, the home folder or the root: "
                              "hf-rebasin never replaces those; choose a new folder name")
        empty = not any(out.iterdir())
        if not force and not empty:
            raise OutputError(f"{out} already exists; choose another {flag} or pass --force to replace it")
        if force and not empty and not (out / REPORT_FILE).is_file() and recorded_files(out) is None:
            raise OutputError(f"{out} exists and is not an hf-rebasin output (it has no {REPORT_FILE}): --force "
                              f"replaces only an earlier merge; choose another {flag}")
        foreign = foreign_files(out) if force and not empty else []
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise OutputError(f"{flag} {out} holds files hf-rebasin did not write ({shown}): --force replaces only "
                              f"what hf-rebasin wrote; move them out or choose another {flag}")
    existing = nearest_existing(out.parent)
    if not existing.is_dir():
        raise OutputError(f"{flag} {out}: {existing} is a file, so the folder cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {out}: {existing} is not writable; choose a folder you can write to")
    if probe:
        probe_output_dir(out, flag)


def probe_output_dir(out: Path, flag: str = "--out") -> None:
    """Make the folders up to `out`'s parent and a staging folder in it, then remove what was made: a place where
    no folder can be made (/proc, /sys, a read-only mount, a full disk) is refused before any work."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _staging_dir(out, "probe").rmdir()
    except OSError as error:
        raise OutputError(f"{flag} {out}: no folder can be made there ({error.strerror or error}); choose a folder "
                          "you can write to") from None
    finally:
        for folder in made:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()


@contextmanager
def atomic_output_dir(out: str | Path, *, force: bool = False, sources: tuple = (), data: tuple = ()):
    """A staged folder for an hf-rebasin output, after the --out/--force checks; its manifest is written last."""
    out = Path(out).expanduser().absolute()
    check_output_dir(out, force=force, sources=sources, data=data)
    with staged_dir(out) as tmp:
        yield tmp
        write_manifest(tmp)
