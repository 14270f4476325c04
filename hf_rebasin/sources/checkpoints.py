"""A checkpoint's weights read tensor by tensor from its files, never a whole model in memory.

safetensors files are memory-mapped (``safe_open``): a tensor is read when it is asked for, in its stored
dtype, and its pages are let go when it is dropped.  A source with only ``.bin`` weights is read with
``torch.load(mmap=True, weights_only=True)``.  Sharded checkpoints are found through their index.  From the
Hub, only what is needed is downloaded: config, tokenizer files and the safetensors shards (the ``.bin``
files only when a repository has no safetensors).

Keys are given as the model class names its parameters (``lm_head.weight``); the files may name them
otherwise (GPT-NeoX checkpoints say ``embed_out.weight``, a GPT-2 saved from ``GPT2Model`` has no
``transformer.`` prefix).  ``aliases`` and ``prefix`` bridge the two."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from ..core.canonical import InterpolatedGraph, LazyGraph
from ..errors import ModelLoadError
from .file_checks import BIN_INDEX, SAFETENSORS_INDEX, weight_files
from .hub_access import hub_unreachable

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", SAFETENSORS_INDEX, "tokenizer*", "vocab.*",
             "merges.txt", "special_tokens_map.json", "added_tokens.json", "README.md", "*.model"]


def download(repo_id: str) -> Path:
    """A local snapshot of a Hub model with only the files hf-rebasin needs."""
    from huggingface_hub import HfApi, constants, snapshot_download
    try:
        if constants.HF_HUB_OFFLINE or hub_unreachable():  # what the cache holds (weight_files says what is missing)
            return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES + ["*.bin", BIN_INDEX],
                                          local_files_only=True))
        files = HfApi().list_repo_files(repo_id)  # a client made now: the endpoint as configured now
        patterns = list(HUB_FILES)
        if not any(name.endswith(".safetensors") for name in files):
            patterns += ["*.bin", BIN_INDEX]
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:  # every Hub failure is the same user problem
        raise ModelLoadError(f"could not download the weights of {repo_id!r} from the Hugging Face Hub "
                             f"({type(error).__name__}: {' '.join(str(error).split())})") from error


class CheckpointFiles(Mapping):
    """{parameter name: tensor} over a checkpoint folder's weight files, read on demand.

    `expected`: the parameter (and buffer) names of the model class; a file key that is not one of them is
    matched to one by an alias of the adapter or by the class's base-model prefix.  Keys that match nothing
    keep their file names (the adapter then refuses them as unknown parameters)."""

    def __init__(self, folder: str | Path, expected: set[str] | None = None,
                 aliases: dict[str, tuple[str, ...]] | None = None, prefix: str = ""):
        self.folder = Path(folder)
        self.files = weight_files(self.folder)
        self.location: dict[str, tuple[Path, str]] = {}  # parameter name -> (file, key in the file)
        self.shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._bin_cache: dict[Path, dict] = {}
        renamed = {alias: name for name, names in (aliases or {}).items() for alias in names}
        for path in self.files:
            for key, shape, dtype in self._header(path):
                name = key
                if expected is not None and key not in expected:
                    if renamed.get(key) in expected:
                        name = renamed[key]
                    elif prefix and f"{prefix}.{key}" in expected:
                        name = f"{prefix}.{key}"
                self.location[name] = (path, key)
                self.shapes[name] = (shape, dtype)

    def _header(self, path: Path):
        if path.suffix == ".safetensors":
            try:
                from safetensors import safe_open
                with safe_open(str(path), "pt") as handle:
                    for key in handle.keys():
                        piece = handle.get_slice(key)
                        yield key, torch.Size(piece.get_shape()), DTYPES.get(piece.get_dtype(), torch.float32)
            except Exception as error:  # a truncated or corrupt file
                raise ModelLoadError(f"could not load the weights of {self.folder}: {path.name} is not a valid "
                                     f"safetensors file ({type(error).__name__}: {error}). Are the weight files "
                                     "complete and uncorrupted?") from error
            return
        for key, value in self._bin(path).items():
            yield key, value.shape, value.dtype

    def _bin(self, path: Path) -> dict:
        if path not in self._bin_cache:
            try:
                self._bin_cache[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as error:
                raise ModelLoadError(f"could not load the weights of {self.folder}: {path.name} "
                                     f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
                                     ) from error
        return self._bin_cache[path]

    def __getitem__(self, name: str) -> Tensor:
        path, key = self.location[name]
        if path.suffix != ".safetensors":
            return self._bin(path)[key]
        from safetensors import safe_open
        with safe_open(str(path), "pt") as handle:
            return handle.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.location)

    def __len__(self) -> int:
        return len(self.location)

    def check_finite(self, source: str) -> None:
        """Read every floating tensor once and refuse NaN or inf, naming the file's own key (cheap next to any
        matching: one read of the files, a tensor at a time)."""
        for name, (path, key) in self.location.items():
            tensor = self[name]
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise ModelLoadError(f"{source} has non-finite weights (NaN or inf): {bad} value"
                                     f"{'s' if bad > 1 else ''} in {key} ({path.name})")
            del tensor

    def meta(self) -> dict[str, Tensor]:
        """The same names with empty tensors of the stored shapes and dtypes (on the meta device)."""
        return {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in self.shapes.items()}

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype most of the weights are stored in (by bytes)."""
        sizes = Counter()
        for shape, dtype in self.shapes.values():
            if dtype.is_floating_point:
                sizes[dtype] += shape.numel() * dtype.itemsize
        return sizes.most_common(1)[0][0] if sizes else torch.float32

    @property
    def nbytes(self) -> int:
        return sum(shape.numel() * dtype.itemsize for shape, dtype in self.shapes.values())


class SpilledGraph(LazyGraph):
    """A lazy graph computed once and kept in files, fp32, one safetensors file per part (the tensors outside the
    layers, then each layer), so that evaluating many points of a path reads it instead of recomputing it."""

    def __init__(self, graph, folder: str | Path):
        from safetensors.torch import save_file
        self.folder, self.spec, self.norm_eps = Path(folder), graph.spec, graph.norm_eps
        self.meta = dict(getattr(graph, "meta", {}) or {})
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shapes = {}
        for name, part in graph.parts():
            self.shapes.update({k: tuple(v.shape) for k, v in part.items()})
            save_file(_contiguous(part), str(self.folder / f"{name}.safetensors"))
            del part

    def _read(self, name: str) -> dict[str, Tensor]:
        from safetensors.torch import load_file
        return load_file(str(self.folder / name))

    def outside(self) -> dict[str, Tensor]:
        return self._read("outside.safetensors")

    def layer(self, i: int) -> dict[str, Tensor]:
        return self._read(f"layer-{i:05d}.safetensors")


def _contiguous(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """fp32, contiguous, storage of its own (what save_file accepts), replaced one tensor at a time so that the
    part is not held twice."""
    for k in list(tensors):
        tensors[k] = tensors[k].detach().float().contiguous().clone()
    return tensors


def canonical_bytes(graph) -> int:
    """Bytes of the graph in fp32 (from its shapes when it knows them, else from its tensors)."""
    shapes = known_shapes(graph)
    if shapes is not None:
        return 4 * sum(math.prod(shape) for shape in shapes.values())
    if isinstance(graph, LazyGraph) and "_materialised" not in graph.__dict__:  # part by part, never whole
        return 4 * sum(v.numel() for _, part in graph.parts() for v in part.values())
    return 4 * sum(v.numel() for v in graph.params.values())


def known_shapes(graph) -> dict[str, tuple] | None:
    """The canonical shapes a lazy graph knows without computing a tensor: its own, or those of the graph it
    transforms (same shapes) or of the first graph it interpolates."""
    from ..core.symmetry import TransformedGraph
    shapes = getattr(graph, "shapes", None)
    if shapes is not None:
        return shapes
    if isinstance(graph, TransformedGraph):
        return known_shapes(graph.base)
    if isinstance(graph, InterpolatedGraph):
        return known_shapes(graph.graphs[0])
    return None
