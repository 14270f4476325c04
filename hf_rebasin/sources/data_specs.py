"""Where a data spec points (the rules data.py's docstring lists): a local path, a folder written by datasets'
``save_to_disk``, or a ``datasets`` spec NAME[:CONFIG[:SPLIT]] (a Hub id, or a packaged local loader such as
``json:corpus/*.jsonl``).  Shared by the text (data.py) and image (images.py) readers; every failure is a
DataError naming the spec."""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import DataError
from .hub_access import cache_only, cached_dataset, hub_unreachable

HUB_DEFAULT_SPLIT = "test"
LOCAL_LOADER_DEFAULT_SPLIT = "train"


def is_packaged_loader(name: str) -> bool:
    """Whether NAME of a datasets spec is one of datasets' packaged local loaders (json, csv, text, ...), found
    from its files without importing datasets (seconds)."""
    import importlib.util
    spec = importlib.util.find_spec("datasets")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return bool(name) and "/" not in name and any((Path(f) / "packaged_modules" / name).is_dir() for f in folders)


def packaged_loaders() -> frozenset[str]:
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
        return frozenset(_PACKAGED_DATASETS_MODULES)
    except ImportError:  # private name moved: fall back to the stable core set
        return frozenset({"json", "csv", "text", "parquet", "arrow", "pandas", "imagefolder", "audiofolder"})


def looks_like_path(spec: str) -> bool:
    """True for specs that can only mean a local path (so a missing one is 'no such file', not a Hub id)."""
    if spec.startswith(("/", "./", "../", "~", ".\\", "..\\")) or spec in (".", ".."):
        return True
    if ":" in spec:  # NAME:CONFIG[:SPLIT] is a datasets spec
        return False
    if spec.count("/") > 1 or "\\" in spec:  # Hub ids have at most one '/' (owner/name)
        return True
    return bool(re.search(r"\.[A-Za-z0-9]{1,8}$", spec)) and not re.fullmatch(r"[\w.-]+/[\w.-]+", spec)


def parse_datasets_spec(spec: str) -> tuple[str, str | None, str | None]:
    parts = spec.split(":")
    if len(parts) > 3 or not parts[0] or any(part == "" for part in parts[1:]):
        raise DataError(f"data spec {spec!r} is not an existing local path and not a datasets spec of the form "
                        f"NAME[:CONFIG[:SPLIT]] (e.g. wikitext:wikitext-103-raw-v1:test or json:corpus.jsonl)")
    name = parts[0]
    config = parts[1] if len(parts) > 1 else None
    spec_split = parts[2] if len(parts) > 2 else None
    return name, config, spec_split


def is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


def load_saved_dataset(spec: str, folder: Path, split: str | None):
    import datasets
    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as error:  # any failure here is a bad data folder
        raise DataError(f"could not load the saved dataset {spec!r} ({type(error).__name__}: {error}); "
                        f"it should be a folder written by datasets' save_to_disk") from error
    if isinstance(loaded, datasets.DatasetDict):
        chosen = split or (HUB_DEFAULT_SPLIT if HUB_DEFAULT_SPLIT in loaded else None)
        if chosen is None and len(loaded) == 1:
            chosen = next(iter(loaded))
        if chosen not in loaded:
            raise DataError(f"the saved dataset {spec!r} has splits {sorted(loaded)}; "
                            f"pick one with split=... (not {chosen!r})")
        loaded = loaded[chosen]
    return loaded


def load_datasets_spec(spec: str, split: str | None, streaming: bool = False):
    """``datasets.load_dataset`` for a NAME[:CONFIG[:SPLIT]] spec (an IterableDataset read as it goes with
    `streaming`); every failure becomes a DataError."""
    import datasets
    name, config, spec_split = parse_datasets_spec(spec)
    kwargs: dict = {}
    if name in packaged_loaders():
        if config is None:
            raise DataError(f"data spec {spec!r} names the local datasets loader {name!r} but no files; "
                            f"write it as {name}:PATH_OR_GLOB[:SPLIT]")
        local = Path(config).expanduser()
        if local.is_dir():
            kwargs["data_dir"] = str(local)
        else:
            kwargs["data_files"] = str(local)
        chosen_split = spec_split or split or LOCAL_LOADER_DEFAULT_SPLIT
        call = (name,)
    else:
        chosen_split = spec_split or split or HUB_DEFAULT_SPLIT
        call = (name, config) if config is not None else (name,)
    try:
        if streaming:
            kwargs["streaming"] = True
        with cache_only():  # the Hub unreachable: the caches alone, no retries
            return datasets.load_dataset(*call, split=chosen_split, **kwargs)
    except Exception as error:  # offline, unknown id, bad split, bad files: all the user's to fix
        offline = bool(getattr(datasets.config, "HF_HUB_OFFLINE", False)) or any(
            os.environ.get(var, "").lower() in ("1", "true", "yes", "on")
            for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        hint = " (offline mode is on: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if offline else ""
        detail = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise DataError(
            f"data spec {spec!r} is neither an existing local path nor a loadable datasets spec "
            f"(load_dataset{call!r}, split={chosen_split!r}{', ' + repr(kwargs) if kwargs else ''} failed{hint}: "
            f"{type(error).__name__}: {detail}). Give a local .txt/.jsonl file or folder, or a dataset id of the "
            f"form NAME[:CONFIG[:SPLIT]] that is reachable (or already in the datasets cache)") from error


def check_spec_exists(spec: str, flag: str = "--data") -> None:
    """A local-looking spec that does not exist is an error now (never a Hub lookup, never after the work), and so
    is a path that is neither a file nor a folder (/dev/null, a pipe, a socket)."""
    path = Path(spec).expanduser()
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise DataError(f"{flag} {spec} is not a regular file or folder (a device, pipe or socket): give a .txt or "
                        ".jsonl file, a folder of text files, or a datasets spec NAME[:CONFIG[:SPLIT]]")
    if looks_like_path(spec) and not path.exists():
        raise DataError(f"{flag} {spec}: no such file or folder")
    if not path.exists():
        check_hub_dataset(spec, flag)


def check_hub_dataset(spec: str, flag: str = "--data", default: bool = False) -> None:
    """A datasets spec naming a Hub dataset, while the Hub cannot be reached and no cache holds it: refused now,
    in one line (loading it would retry for half a minute)."""
    name = spec.split(":")[0]
    if not name or is_packaged_loader(name):
        return
    why = hub_unreachable()
    if why is None or cached_dataset(name):
        return
    given = f"{flag} {spec}" + (" (the default for language models)" if default else "")
    raise DataError(f"{given}: the Hub dataset {name} is in no local cache, and {why}: give local data "
                    f"({flag} FILE.txt, a folder of .txt files or a .jsonl), or connect to download it")
