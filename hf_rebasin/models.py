"""Loading checkpoints (Hub id or local folder), canonicalising them, and building / saving a canonical
graph as a checkpoint of the ORIGINAL class (stock ``from_pretrained`` / ``timm.create_model``).
Library specifics live in backends.py, architecture specifics in adapters/."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapters import Adapter
from .backends import Backend, backend_of, is_local, looks_like_path
from .canonical import Graph, Spec
from .errors import IncompatibleModelsError, ModelLoadError


@dataclass
class Loaded:
    source: str
    adapter: Adapter
    backend: Backend
    config: Any  # transformers PretrainedConfig; for timm, the built model (see adapters/vit.py)
    model: nn.Module
    hub_config: dict  # the raw config.json

    @property
    def spec(self) -> Spec:
        return self.adapter.spec(self.config)

    @property
    def task(self) -> str:
        return self.backend.task


def read_config_json(source: str) -> dict:
    """config.json of a local folder or a Hub repository, with errors that say what is wrong."""
    if is_local(source):
        path = Path(source).expanduser()
        if not path.is_dir():
            raise ModelLoadError(f"{source} is a file, not a model folder: pass the folder that holds "
                                 "config.json and the weights")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{source} is not a model folder: it has no config.json (expected a transformers "
                                 "or timm checkpoint saved with save_pretrained / save_for_hf)")
    elif looks_like_path(source):
        raise ModelLoadError(f"no such model folder: {source}")
    else:
        from huggingface_hub import hf_hub_download
        try:
            config_file = Path(hf_hub_download(source, "config.json"))
        except Exception as error:  # noqa: BLE001 - every hub failure becomes one clear message
            raise ModelLoadError(f"could not get config.json of {source!r} from the Hugging Face Hub "
                                 f"({type(error).__name__}: {' '.join(str(error).split())}). Is it a local folder that "
                                 "does not exist, a misspelt repo id, or are you offline without a cache?") from error
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from error


def load(source: str | Path) -> Loaded:
    """Load a supported model in fp32 from a Hub id or a local folder."""
    source = str(source)
    hub_config = read_config_json(source)
    backend = backend_of(hub_config)
    adapter, config, model = backend.load(source, hub_config)
    return Loaded(source, adapter, backend, config, model, hub_config)


def canonicalise(loaded: Loaded) -> Graph:
    state_dict = {k: v.detach() for k, v in loaded.model.state_dict().items()}
    return loaded.adapter.to_canonical(state_dict, loaded.config, loaded.source)


def instantiate(graph: Graph, template: Loaded) -> nn.Module:
    """A model of the template's class holding the graph's weights (fp32, eval mode)."""
    state_dict, changes = template.adapter.from_canonical(graph, template.config)
    model = template.backend.build(template, changes)
    model.load_state_dict(own_tensors(state_dict), strict=True, assign=True)
    return model.float().eval()


def own_tensors(state_dict: dict[str, torch.Tensor], dtype=torch.float32) -> dict[str, torch.Tensor]:
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


def save(model: nn.Module, template: Loaded, out_dir: str | Path) -> None:
    """Write a checkpoint that loads with the stock loader of its class, plus tokenizer/preprocessing."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    template.backend.save(model, template, out_dir)


def export(graph: Graph, template: Loaded, out_dir: str | Path) -> nn.Module:
    model = instantiate(graph, template)
    save(model, template, out_dir)
    return model


def load_exported(out_dir: str | Path) -> nn.Module:
    """Load an exported folder with nothing but the stock loader of its library."""
    return load(out_dir).model


# --- compatibility --------------------------------------------------------------------------------

def check_compatible(a: Loaded, b: Loaded) -> None:
    """Raise IncompatibleModelsError naming every field in which the two models differ."""
    if a.adapter.architecture != b.adapter.architecture:
        raise IncompatibleModelsError(f"different architectures: {a.source} is {a.adapter.architecture}, "
                                      f"{b.source} is {b.adapter.architecture}")
    sa, sb = a.spec, b.spec
    differences = [(f, getattr(sa, f), getattr(sb, f)) for f in sa.__dataclass_fields__
                   if f != "notes" and getattr(sa, f) != getattr(sb, f)]
    differences += a.backend.differences(a, b)
    if differences:
        detail = "; ".join(f"{field}: {x} vs {y}" for field, x, y in dict((d[0], d) for d in differences).values())
        hint = " (vocabularies differ: the models were trained with different tokenizers)" if any(
            d[0] == "n_out" for d in differences) and a.task == "causal-lm" else ""
        raise IncompatibleModelsError(f"{a.source} and {b.source} differ in {detail}{hint}. Only models of one "
                                      "configuration can be aligned.")
    problem = a.backend.vocabulary_problem(a, b)
    if problem:
        raise IncompatibleModelsError(problem)


def check_same_structure(a: Graph, b: Graph, names: tuple[str, str] = ("A", "B")) -> None:
    """Canonical graphs must have the same tensors and shapes to be aligned and interpolated
    (e.g. LLaMA checkpoints with and without attention biases cannot)."""
    only_a = sorted(set(a.params) - set(b.params))
    only_b = sorted(set(b.params) - set(a.params))
    shapes = [k for k in a.params.keys() & b.params.keys() if a.params[k].shape != b.params[k].shape]
    problems = [f"only in {names[0]}: {', '.join(only_a[:4])}" if only_a else "",
                f"only in {names[1]}: {', '.join(only_b[:4])}" if only_b else "",
                "different shapes: " + ", ".join(f"{k} {tuple(a.params[k].shape)} vs {tuple(b.params[k].shape)}"
                                                 for k in sorted(shapes)[:4]) if shapes else ""]
    problems = [p for p in problems if p]
    if problems:
        raise IncompatibleModelsError("the models' canonical tensors differ (" + "; ".join(problems) +
                                      "): they are not two checkpoints of one configuration")
