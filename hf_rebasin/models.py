"""Loading checkpoints (Hub id or local folder), canonicalising them, and exporting a canonical
graph back as a checkpoint of the ORIGINAL class (stock ``from_pretrained`` / ``timm.create_model``)."""
from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapters import Adapter, UnsupportedModelError, get_adapter
from .canonical import Graph, Spec


class ModelLoadError(ValueError):
    """The source is not a loadable model (missing, not a model folder, corrupt weights)."""


class IncompatibleModelsError(ValueError):
    """Two models cannot be aligned with each other (different architecture, shapes or vocabulary)."""


@dataclass
class Loaded:
    source: str
    adapter: Adapter
    config: Any  # transformers PretrainedConfig; for timm, the built model (see adapters/vit.py)
    model: nn.Module
    hub_config: dict  # the raw config.json

    @property
    def spec(self) -> Spec:
        return self.adapter.spec(self.config)


def is_local(source: str | Path) -> bool:
    return Path(source).exists()


def read_config_json(source: str) -> dict:
    """config.json of a local folder or a Hub repository, with errors that say what is wrong."""
    if is_local(source):
        path = Path(source)
        if not path.is_dir():
            raise ModelLoadError(f"{source} is a file, not a model folder: pass the folder that holds "
                                 "config.json and the weights")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{source} is not a model folder: it has no config.json "
                                 "(expected a transformers or timm checkpoint saved with save_pretrained / save_for_hf)")
    else:
        from huggingface_hub import hf_hub_download
        try:
            config_file = Path(hf_hub_download(source, "config.json"))
        except Exception as error:  # noqa: BLE001 - every hub failure becomes one clear message
            raise ModelLoadError(f"could not get config.json of {source!r} from the Hugging Face Hub "
                                 f"({type(error).__name__}: {error}). Is it a local folder that does not exist, "
                                 "a misspelt repo id, or are you offline without a cache?") from error
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from error


def library_of(hub_config: dict) -> str:
    if "architectures" in hub_config or "model_type" in hub_config:
        return "transformers"
    if "architecture" in hub_config:
        return "timm"
    raise ModelLoadError("config.json names no architecture: neither a transformers ('architectures') "
                         "nor a timm ('architecture') checkpoint")


def _timm_name(source: str) -> str:
    return f"local-dir:{source}" if is_local(source) else f"hf-hub:{source}"


def load(source: str | Path) -> Loaded:
    """Load a supported model in fp32 from a Hub id or a local folder."""
    source = str(source)
    hub_config = read_config_json(source)
    if library_of(hub_config) == "timm":
        import timm
        try:
            model = timm.create_model(_timm_name(source), pretrained=True)
        except Exception as error:  # noqa: BLE001
            raise ModelLoadError(f"could not load the timm model {source}: {type(error).__name__}: {error}") from error
        adapter = get_adapter(type(model).__name__)
        model.float().eval()
        return Loaded(source, adapter, model, model, hub_config)

    import transformers
    architectures = hub_config.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"{source}: config.json has no 'architectures' entry, so the model class is unknown")
    adapter = get_adapter(architectures[0])
    cls = getattr(transformers, adapter.architecture)
    try:
        model = cls.from_pretrained(source, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001
        raise ModelLoadError(f"could not load the weights of {source}: {type(error).__name__}: {error}. "
                             "Are the weight files complete and uncorrupted?") from error
    model.eval()
    return Loaded(source, adapter, model.config, model, hub_config)


def state_dict_of(loaded: Loaded) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in loaded.model.state_dict().items()}


def canonicalise(loaded: Loaded) -> Graph:
    graph = loaded.adapter.to_canonical(state_dict_of(loaded), loaded.config)
    bad = [k for k, v in graph.params.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise ModelLoadError(f"{loaded.source} has non-finite weights (NaN or inf) in {', '.join(bad[:5])}"
                             + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
    return graph


# --- building the original class from a canonical graph ----------------------------------------

def instantiate(graph: Graph, template: Loaded) -> nn.Module:
    """A model of the template's class holding the graph's weights."""
    state_dict, changes = template.adapter.from_canonical(graph, template.config)
    state_dict = {k: v.detach().to(torch.float32).contiguous() for k, v in state_dict.items()}
    if template.adapter.library == "timm":
        import timm
        model = copy.deepcopy(template.model) if not changes else timm.create_model(
            template.hub_config["architecture"], pretrained=False,
            **{**template.hub_config.get("model_args", {}), **changes})
    else:
        from transformers.initialization import no_init_weights
        config = copy.deepcopy(template.config)
        for key, value in changes.items():
            setattr(config, key, value)
        with no_init_weights():
            model = type(template.model)(config)
    model.load_state_dict(state_dict, strict=True)
    return model.float().eval()


def save(model: nn.Module, template: Loaded, out_dir: str | Path) -> None:
    """Write a checkpoint that loads with the stock loader of its class, plus tokenizer/preprocessing."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if template.adapter.library == "timm":
        from safetensors.torch import save_file
        hub_config = copy.deepcopy(template.hub_config)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out_dir / "model.safetensors"))
        (out_dir / "config.json").write_text(json.dumps(hub_config, indent=2))
        return
    model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer(template.source, out_dir)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")


def copy_tokenizer(source: str, out_dir: Path) -> None:
    if is_local(source):
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file() and not (out_dir / name).exists():
                shutil.copy2(Path(source) / name, out_dir / name)
        return
    try:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(source).save_pretrained(out_dir)
    except Exception:  # noqa: BLE001 - a model without a tokenizer on the Hub is exported without one
        pass


def export(graph: Graph, template: Loaded, out_dir: str | Path) -> nn.Module:
    model = instantiate(graph, template)
    save(model, template, out_dir)
    return model


def load_exported(out_dir: str | Path) -> nn.Module:
    """Load an exported folder with nothing but the stock loader of its library."""
    return load(out_dir).model


# --- compatibility of two models ------------------------------------------------------------

def check_compatible(a: Loaded, b: Loaded) -> None:
    """Raise IncompatibleModelsError naming every field in which the two models differ."""
    if a.adapter.architecture != b.adapter.architecture:
        raise IncompatibleModelsError(f"different architectures: {a.source} is {a.adapter.architecture}, "
                                      f"{b.source} is {b.adapter.architecture}")
    sa, sb = a.spec, b.spec
    fields = [f for f in sa.__dataclass_fields__ if f != "notes" and getattr(sa, f) != getattr(sb, f)]
    if a.adapter.library == "transformers":
        keys = ("use_parallel_residual", "hidden_act", "activation_function", "clip_qkv", "rope_parameters",
                "rope_theta", "max_position_embeddings", "n_positions")
        fields += [k for k in keys if getattr(a.config, k, None) != getattr(b.config, k, None)]
    else:
        args_a, args_b = a.hub_config.get("model_args", {}), b.hub_config.get("model_args", {})
        fields += [f"model_args.{k}" for k in sorted(set(args_a) | set(args_b)) if args_a.get(k) != args_b.get(k)]
        fields += [k for k in ("architecture", "global_pool") if a.hub_config.get(k) != b.hub_config.get(k)]
    if fields:
        detail = "; ".join(f"{f}: {_field(a, sa, f)} vs {_field(b, sb, f)}" for f in dict.fromkeys(fields))
        hint = " (vocabularies differ: the models were trained with different tokenizers)" if "n_out" in fields \
            and a.adapter.library == "transformers" else ""
        raise IncompatibleModelsError(f"{a.source} and {b.source} differ in {detail}{hint}. Only models of one "
                                      "configuration can be aligned.")


def _field(loaded: Loaded, spec: Spec, field: str):
    if field in spec.__dataclass_fields__:
        return getattr(spec, field)
    if field.startswith("model_args."):
        return loaded.hub_config.get("model_args", {}).get(field.split(".", 1)[1])
    if field in loaded.hub_config and loaded.adapter.library == "timm":
        return loaded.hub_config.get(field)
    return getattr(loaded.config, field, None)



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
