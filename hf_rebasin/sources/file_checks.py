"""The checks of local model folders and data files that need no library: which files hold the weights, whether
each safetensors header is readable, whether each tokenizer file is valid JSON and whether the models' tokenizers
index tokens alike, whether a data file holds any text.  Standard library only: the command line runs them before
torch and transformers are imported (seconds), so that such a refusal comes within a second.  The loaders check
the same things again, for the Python API and for Hub models (whose files are downloaded later)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

from ..errors import DataError, IncompatibleModelsError, ModelLoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
NOT_WEIGHTS = {"transforms.safetensors", "training_args.bin", "optimizer.bin", "scheduler.bin"}
JSON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                        "added_tokens.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")
SMALL_DATA_BYTES = 1 << 20  # a data file up to this size is read whole to see whether it holds any text


def has_tokenizer_files(folder: Path) -> bool:
    """Whether a model folder holds a tokenizer (without one, transformers makes an empty one from the model type)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES if name not in ("special_tokens_map.json",
                                                                                     "added_tokens.json"))


def weight_files(folder: Path) -> list[Path]:
    """The files holding a checkpoint folder's weights: safetensors when there are any, else .bin."""
    for index, pattern in ((SAFETENSORS_INDEX, "*.safetensors"), (BIN_INDEX, "*.bin")):
        if (folder / index).is_file():
            try:
                shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as error:
                raise ModelLoadError(f"{folder / index} is not a valid weight index ({error})") from error
            missing = [name for name in shards if not (folder / name).is_file()]
            if missing:
                raise ModelLoadError(f"{folder} lacks {', '.join(missing[:3])}, listed in {index}: the download or "
                                     "copy is incomplete")
            return [folder / name for name in shards]
        found = sorted(p for p in folder.glob(pattern) if not p.name.startswith(".") and p.name not in NOT_WEIGHTS)
        preferred = [p for p in found if p.name.startswith(("model", "pytorch_model"))]
        if preferred or found:
            return preferred or found
    raise ModelLoadError(f"{folder} holds no weights (no *.safetensors and no *.bin files)")


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file's header cannot be read (its layout: an 8-byte little-endian length, then that many
    bytes of JSON naming each tensor's dtype, shape and byte range), or None."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than a header"
        length = struct.unpack("<Q", head)[0]
        if length > size - 8:
            return f"its header says {length:,} bytes, more than the file holds"
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return f"its header is not valid JSON: {error}"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    end = max((entry.get("data_offsets", [0, 0])[1] for key, entry in header.items()
               if key != "__metadata__" and isinstance(entry, dict)), default=0)
    if 8 + length + end > size:
        return f"truncated: its tensors need {8 + length + end:,} bytes, the file has {size:,}"
    return None


def check_weight_headers(folder: Path) -> None:
    for path in weight_files(folder):
        why = safetensors_problem(path) if path.suffix == ".safetensors" else None
        if why:
            raise ModelLoadError(f"could not load the weights of {folder}: {path.name} is not a valid safetensors "
                                 f"file ({why}). Are the weight files complete and uncorrupted?")


def check_tokenizer_files(folder: Path, source: str) -> None:
    """Every JSON file of the folder's tokenizer parses."""
    for name in JSON_TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ModelLoadError(f"{source}: its tokenizer file {name} is not valid JSON ({error}): copy the "
                                     "tokenizer the model was trained with into the folder") from error


def tokenizer_json_vocabulary(folder: Path) -> dict[str, int] | None:
    """{token: id} of a fast tokenizer's tokenizer.json (its model's vocabulary and the added tokens, as
    get_vocab() gives them), or None when the folder has none or a kind this does not read."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = (data.get("model") or {}).get("vocab") if isinstance(data, dict) else None
    if isinstance(vocab, dict):
        tokens = dict(vocab)
    elif isinstance(vocab, list):  # Unigram: [token, score] pairs, the id is the position
        tokens = {entry[0]: i for i, entry in enumerate(vocab) if isinstance(entry, list) and entry}
    else:
        return None
    tokens.update({t["content"]: t["id"] for t in data.get("added_tokens") or [] if "content" in t and "id" in t})
    return tokens


def vocabulary_difference(a: dict[str, int], b: dict[str, int], source_a: str, source_b: str) -> str | None:
    """The message for two vocabularies that index tokens differently, or None (shared with the loader's check)."""
    if a == b:
        return None
    only_a, only_b = len(set(a) - set(b)), len(set(b) - set(a))
    moved = sum(1 for tok in set(a) & set(b) if a[tok] != b[tok])
    return (f"the tokenizers of {source_a} and {source_b} differ ({only_a} tokens only in A, {only_b} only in B, "
            f"{moved} with different ids): token embeddings are not indexed alike, so the models cannot be aligned")


def check_local_models(sources: list[str], configs: list[dict]) -> None:
    """What the loader would refuse about local transformers folders, read from their files: a second model of
    another class, a corrupt weight header, a tokenizer file that is not JSON, tokenizers that differ."""
    local = [(s, Path(s).expanduser(), c) for s, c in zip(sources, configs) if Path(s).expanduser().exists()]
    classes = [(s, (c.get("architectures") or [None])[0]) for s, c in zip(sources, configs)]
    for source, cls in classes[1:]:
        if cls and classes[0][1] and cls != classes[0][1]:
            raise IncompatibleModelsError(f"different architectures: {classes[0][0]} is {classes[0][1]}, {source} is "
                                          f"{cls}")
    for source, folder, _ in local:
        check_weight_headers(folder)
        check_tokenizer_files(folder, source)  # (a folder with none: the loader says so, after the shape checks)
    if len(local) == len(sources):
        first = tokenizer_json_vocabulary(local[0][1])
        for source, folder, _ in local[1:]:
            other = tokenizer_json_vocabulary(folder)
            problem = None if first is None or other is None else vocabulary_difference(first, other, sources[0],
                                                                                          source)
            if problem:
                raise IncompatibleModelsError(problem)


def check_data_has_text(spec: str, flag: str) -> None:
    """A small local data file (or a folder of them) with nothing but whitespace is refused now."""
    path = Path(spec).expanduser()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and not
                                                 p.name.startswith(".")) if path.is_dir() else []
    if not files or any(p.suffix in (".arrow", ".parquet") or p.name in ("dataset_dict.json", "state.json")
                        for p in files):
        return
    if any(p.stat().st_size > SMALL_DATA_BYTES for p in files):
        return
    if all(not p.read_bytes().strip() for p in files):
        raise DataError(f"data spec {spec!r} contains no text; give a file or dataset with non-empty documents "
                        f"({flag})")
