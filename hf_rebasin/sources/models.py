"""Loading checkpoints (Hub id or local folder), canonicalising them, and building a canonical graph back
into a model of the ORIGINAL class (stock ``from_pretrained`` / ``timm.create_model``); writing one as a
checkpoint is export/checkpoint.py.  Library specifics live in backends.py, architecture specifics in adapters/."""
from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..adapters import Adapter, StateReader
from ..core.canonical import LazyGraph, Spec
from ..errors import IncompatibleModelsError, ModelLoadError
from .backends import Backend, backend_of, is_local, read_config_json
from .checkpoints import CheckpointFiles, download


@dataclass
class Loaded:
    """A checkpoint ready to be canonicalised: its configuration, its weight files (read on demand) and the
    adapter and backend that know its class.  Nothing of the weights is in memory."""

    source: str  # as given: a Hub id or a local folder
    adapter: Adapter
    backend: Backend
    config: Any  # transformers PretrainedConfig; for timm, the model built on the meta device (see adapters/vit.py)
    hub_config: dict  # the raw config.json
    folder: Path  # the local folder (a Hub snapshot of the files hf-rebasin needs, for a Hub id)
    files: CheckpointFiles

    @property
    def spec(self) -> Spec:
        return self.adapter.spec(self.config)

    @property
    def task(self) -> str:
        return self.adapter.task or self.backend.task

    @functools.cached_property
    def model(self) -> nn.Module:
        """The checkpoint loaded by its library's own loader, in fp32 (small models, comparisons)."""
        return self.backend.load_model(self)


def load(source: str | Path) -> Loaded:
    """A supported model from a Hub id or a local folder: configuration read, weight files indexed (a Hub
    id's files downloaded), no weights in memory."""
    source = str(source)
    hub_config = read_config_json(source)
    backend = backend_of(hub_config)
    folder = Path(source).expanduser() if is_local(source) else download(source)
    adapter, config = backend.configure(folder, hub_config)
    loaded = Loaded(source, adapter, backend, config, hub_config, folder, None)
    expected = set(backend.build(loaded, {}).state_dict())
    loaded.files = CheckpointFiles(folder, expected, adapter.file_aliases(), backend.base_prefix(loaded))
    return loaded


def write_loaded(model, folder: str | Path, index: int = 0) -> str:
    """Write a model object given to the Python API as a checkpoint folder that load() reads; return its name
    (where it came from, marked as in memory: its weights may have changed since).  A transformers model is
    written with its config and tokenizer (the second item of a (model, tokenizer) pair, else the tokenizer of
    the folder or Hub id it was loaded from); a timm model with its pretrained config (preprocessing) and the
    model_args of a (model, model_args) pair."""
    model, companion = model if isinstance(model, tuple) and len(model) == 2 else (model, None)
    folder = Path(folder)
    if hasattr(model, "save_pretrained") and hasattr(model, "config"):  # transformers
        origin = getattr(model, "name_or_path", "") or type(model).__name__
        tokenizer = companion
        if tokenizer is None and origin != type(model).__name__:
            from .backends import BACKENDS, has_tokenizer_files, is_local
            if not is_local(origin) or has_tokenizer_files(Path(origin).expanduser()):
                tokenizer = BACKENDS["transformers"].tokenizer(origin)
        if tokenizer is None:
            raise ModelLoadError(f"model {index} ({type(model).__name__}) was not loaded from a folder or Hub id with "
                                 "a tokenizer: pass it as a (model, tokenizer) pair")
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    elif isinstance(model, nn.Module) and hasattr(model, "pretrained_cfg"):  # timm
        from timm.models import save_for_hf
        origin = model.pretrained_cfg.get("architecture") or type(model).__name__
        save_for_hf(model, str(folder), model_args=companion, safe_serialization=True)
    else:
        raise TypeError(f"model {index} is a {type(model).__name__}: give a folder, a Hub id, a transformers "
                        "PreTrainedModel (or a (model, tokenizer) pair) or a timm model (or a (model, model_args) "
                        "pair)")
    return f"{origin} (in memory)"


class SourceGraph(LazyGraph):
    """The canonical graph of a checkpoint, computed part by part from its files (fp32, one layer at a time).
    Made by canonicalise(), which first converts the whole checkpoint on the meta device: every parameter is
    accounted for and every shape checked before a weight is read; then every weight is read once, streamed,
    to refuse NaN or inf before any work is done."""

    def __init__(self, loaded: Loaded):
        self.loaded, self.spec = loaded, loaded.spec
        self.norm_eps = loaded.adapter.norm_eps(loaded.config)
        self.meta = {}
        shapes = loaded.adapter.to_canonical(loaded.files.meta(), loaded.config, loaded.source)
        self.shapes = {k: tuple(v.shape) for k, v in shapes.params.items()}
        loaded.files.check_finite(loaded.source)

    def _reader(self) -> StateReader:
        return StateReader(self.loaded.files, self.loaded.adapter.architecture, self.loaded.source, checked=True)

    def outside(self) -> dict[str, Tensor]:
        return self.loaded.adapter.outside_to_canonical(self._reader(), self.loaded.config, self.spec)

    def layer(self, i: int) -> dict[str, Tensor]:
        return self.loaded.adapter.layer_to_canonical(self._reader(), self.loaded.config, self.spec, i)


def canonicalise(loaded: Loaded) -> SourceGraph:
    return SourceGraph(loaded)


class PlainAverage(LazyGraph):
    """A source graph that is interpolated in the checkpoint's own parameters: the point sum_k w_k model_k is the
    element-wise average of the checkpoints as loaded (method raw, the papers' raw interpolation).  Averaging the
    canonical forms instead is another, kinder model: canonicalising multiplies each norm gain into the next layer,
    and an average of products is not the product of averages."""

    def __init__(self, source, loaded: Loaded | None = None):
        self.source, self.loaded, self.spec = source, loaded or source.loaded, source.spec
        self.norm_eps, self.meta, self.shapes = source.norm_eps, {}, getattr(source, "shapes", None)

    def outside(self) -> dict[str, Tensor]:
        return self.source.outside()

    def layer(self, i: int) -> dict[str, Tensor]:
        return self.source.layer(i)

    def materialise(self) -> PlainAverage:
        return PlainAverage(self.source.materialise(), self.loaded)

    @property
    def params(self) -> dict[str, Tensor]:
        return self.source.params

    @staticmethod
    def interpolate_points(graphs: list, weights: list[float]) -> AveragedCheckpoints:
        return AveragedCheckpoints([g.loaded for g in graphs], weights)


class MixedFiles(Mapping):
    """sum_k w_k files_k, tensor by tensor, in fp32 (models of weight 0 are not read; integer tensors: the first
    model's), under the names of the first model's files."""

    def __init__(self, files: list[CheckpointFiles], weights: list[float], sources: list[str]):
        used = [(f, float(w), s) for f, w, s in zip(files, weights, sources) if w != 0.0]
        used = used or [(files[0], 1.0, sources[0])]
        self.first, self.used = files[0], used

    def __getitem__(self, name: str) -> Tensor:
        first = self.first[name]
        if not first.is_floating_point():
            return first
        total = None
        for files, w, source in self.used:
            if name not in files:
                raise IncompatibleModelsError(f"{source} has no tensor {name}: the checkpoints cannot be averaged")
            term = files[name].to(torch.float32) * w if w != 1.0 else files[name].to(torch.float32)
            total = term if total is None else total + term
        return total

    def __iter__(self) -> Iterator[str]:
        return iter(self.first)

    def __len__(self) -> int:
        return len(self.first)


class AveragedCheckpoints(LazyGraph):
    """The element-wise average sum_k w_k checkpoint_k (see PlainAverage): its canonical parts are computed from
    the averaged tensors, and building or saving it writes the averaged tensors themselves (the source's
    configuration unchanged, nothing absorbed), under the source files' own names when saved."""

    def __init__(self, loaded: list[Loaded], weights: list[float]):
        self.loaded, self.template, self.spec = loaded, loaded[0], loaded[0].spec
        self.weights = [float(w) for w in weights]
        self.norm_eps, self.meta = loaded[0].adapter.norm_eps(loaded[0].config), {}
        self.mixed = MixedFiles([m.files for m in loaded], self.weights, [m.source for m in loaded])

    def _reader(self) -> StateReader:
        return StateReader(self.mixed, self.template.adapter.architecture, self.template.source, checked=True)

    def outside(self) -> dict[str, Tensor]:
        return self.template.adapter.outside_to_canonical(self._reader(), self.template.config, self.spec)

    def layer(self, i: int) -> dict[str, Tensor]:
        return self.template.adapter.layer_to_canonical(self._reader(), self.template.config, self.spec, i)

    def checkpoint_parts(self) -> Iterator[dict[str, Tensor]]:
        """The averaged tensors one at a time, under the model class's names."""
        for name in self.mixed:
            yield {name: self.mixed[name]}


# --- building and saving the original class --------------------------------------------------------

def own_tensors(state_dict: dict[str, Tensor], dtype=torch.float32) -> dict[str, Tensor]:
    """The state dict in `dtype`, contiguous, with no two entries sharing memory (assigned parameters must
    not alias: an export writes norm weights of 1 from one tensor, and safetensors refuses shared storage)."""
    seen, out = set(), {}
    for key, value in state_dict.items():
        value = value.detach().to(dtype).contiguous()
        if value.untyped_storage().data_ptr() in seen:
            value = value.clone()
        seen.add(value.untyped_storage().data_ptr())
        out[key] = value
    return out


def state_dict_parts(graph, template: Loaded) -> Iterator[dict[str, Tensor]]:
    """The original class's state dict, part by part: outside the layers, then one layer at a time (an average
    of checkpoints: its own tensors, one at a time)."""
    if isinstance(graph, AveragedCheckpoints):  # under the class's names (a MoE's files may hold it per expert)
        yield from template.adapter.module_parts(graph.mixed)
        return
    adapter, spec = template.adapter, graph.spec
    yield adapter.outside_from_canonical(graph.outside(), template.config, spec)
    for i in range(spec.n_layers):
        yield adapter.layer_from_canonical(graph.layer(i), template.config, spec, i)


def build(graph, template: Loaded) -> nn.Module:
    """An empty model of the template's class with the graph's configuration (parameters on meta)."""
    return template.backend.build(template, config_changes(graph, template))


def config_changes(graph, template: Loaded) -> dict:
    """What the export changes in the template's config (nothing for an average of checkpoints)."""
    if isinstance(graph, AveragedCheckpoints):
        return {}
    return template.adapter.export_config_changes(graph, template.config)


def fill(model: nn.Module, graph, template: Loaded) -> nn.Module:
    """Assign the graph's weights (fp32) to a model built by build(), part by part; the norm eps follows the
    graph's (the residual scale g is exact only with eps scaled by g^2)."""
    names = set()
    for part in state_dict_parts(graph, template):
        model.load_state_dict(own_tensors(part), strict=False, assign=True)
        names.update(part)
    tied = template.task == "masked-lm" and model.config.tie_word_embeddings  # a tie the export keeps (BERT's decoder)
    if (isinstance(graph, AveragedCheckpoints) or tied) and hasattr(model, "tie_weights"):
        model.tie_weights()  # a tied checkpoint stores the shared tensor once
        names.update(name for name, value in model.state_dict().items() if value.device.type != "meta")
    missing = sorted(set(model.state_dict()) - names - {n for n, _ in model.named_buffers()})
    if missing:
        raise ValueError(f"{template.adapter.architecture} export: no canonical value for {missing[:5]}")
    if graph.spec.scale_exact:
        for module, attr in template.adapter.norm_modules(model):
            setattr(module, attr, graph.norm_eps)
    return model.eval()


def lm_logits(output) -> Tensor:
    """The token logits of a language model's output (BertForPreTraining calls them prediction_logits)."""
    logits = getattr(output, "logits", None)
    return output.prediction_logits if logits is None else logits


def instantiate(graph, template: Loaded) -> nn.Module:
    """A model of the template's class holding the graph's weights (fp32, eval mode)."""
    return fill(build(graph, template), graph, template)


# --- compatibility --------------------------------------------------------------------------------

WIDTH_FIELDS = ("model_args.embed_dim", "model_args.num_heads", "model_args.mlp_ratio")  # timm: the Spec checks them


def check_compatible(a: Loaded, b: Loaded, shapes: bool = True) -> None:
    """Raise IncompatibleModelsError naming every field in which the two models differ (with shapes=False, the
    widths may differ: a narrower model that will be embedded into the wider one's configuration)."""
    if a.adapter.architecture != b.adapter.architecture:
        raise IncompatibleModelsError(f"different architectures: {a.source} is {a.adapter.architecture}, "
                                      f"{b.source} is {b.adapter.architecture}")
    sa, sb = a.spec, b.spec
    differences = [(f, getattr(sa, f), getattr(sb, f)) for f in sa.__dataclass_fields__
                   if f != "notes" and getattr(sa, f) != getattr(sb, f)] if shapes else []
    differences += [d for d in a.backend.differences(a, b) if shapes or d[0] not in WIDTH_FIELDS]
    if differences:
        detail = "; ".join(f"{field}: {x} vs {y}" for field, x, y in dict((d[0], d) for d in differences).values())
        hint = " (vocabularies differ: the models were trained with different tokenizers)" if any(
            d[0] == "n_out" for d in differences) and a.task == "causal-lm" else ""
        raise IncompatibleModelsError(f"{a.source} and {b.source} differ in {detail}{hint}. Only models of one "
                                      "configuration can be aligned.")
    problem = a.backend.vocabulary_problem(a, b)
    if problem:
        raise IncompatibleModelsError(problem)


def canonical_shapes(graph) -> dict[str, tuple]:
    return getattr(graph, "shapes", None) or {k: tuple(v.shape) for k, v in graph.params.items()}


def check_same_structure(a, b, names: tuple[str, str] = ("A", "B")) -> None:
    """Canonical graphs must have the same tensors and shapes to be aligned and interpolated
    (e.g. LLaMA checkpoints with and without attention biases cannot)."""
    sa, sb = canonical_shapes(a), canonical_shapes(b)
    only_a, only_b = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
    shapes = [k for k in sa.keys() & sb.keys() if sa[k] != sb[k]]
    problems = [f"only in {names[0]}: {', '.join(only_a[:4])}" if only_a else "",
                f"only in {names[1]}: {', '.join(only_b[:4])}" if only_b else "",
                "different shapes: " + ", ".join(f"{k} {sa[k]} vs {sb[k]}" for k in sorted(shapes)[:4])
                if shapes else ""]
    problems = [p for p in problems if p]
    if problems:
        raise IncompatibleModelsError("the models' canonical tensors differ (" + "; ".join(problems) +
                                      "): they are not two checkpoints of one configuration")
