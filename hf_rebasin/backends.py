"""The two model libraries hf-rebasin works with, behind one interface: how a checkpoint of that library
is loaded, built from a config (without initialising weights), saved in the Hub layout, what its inputs
are (a tokenizer, or timm's preprocessing) and which of its settings two mergeable models must share.

The rest of the package never asks which library a model comes from: it asks the backend."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from .errors import ModelLoadError, UserError


def is_local(source: str | Path) -> bool:
    return Path(source).expanduser().exists()


def looks_like_path(source: str) -> bool:
    """A source that can only mean a local path: absolute, ./ ../ ~, or more than one '/' (Hub ids have one)."""
    return source.startswith(("/", "./", "../", "~", ".\\")) or source in (".", "..") or source.count("/") > 1 \
        or "\\" in source


def is_hub_id(source: str) -> bool:
    """A source that names a Hub repository (owner/name or name), not a local path: the one rule for both
    loading models and what a model card may list as a base model."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    if looks_like_path(source) or is_local(source):
        return False
    try:
        validate_repo_id(source)
    except HFValidationError:
        return False
    return True


class Backend:
    name: ClassVar[str]
    task: ClassVar[str]  # "causal-lm" or "image-classification"

    def load(self, source: str, hub_config: dict):
        """(adapter, config, model in fp32, eval mode)."""
        raise NotImplementedError

    def build(self, loaded, changes: dict) -> nn.Module:
        """A model of loaded's class and configuration (with changes): buffers real, parameters on the meta
        device (no memory, no initialisation) until a state dict is assigned."""
        raise NotImplementedError

    def save(self, model: nn.Module, loaded, out_dir: Path) -> None:
        raise NotImplementedError

    def differences(self, a, b) -> list[tuple[str, Any, Any]]:
        """(field, value in a, value in b) for every library-level setting in which two models differ."""
        raise NotImplementedError

    def create_tiny(self, adapter, variant: str) -> nn.Module:
        """A freshly initialised model of one of the adapter's tiny variants."""
        raise NotImplementedError

    def save_new(self, model: nn.Module, adapter, variant: str, path: Path) -> None:
        """Save a model made by create_tiny in the Hub layout of the library."""
        raise NotImplementedError


class TransformersBackend(Backend):
    name = "transformers"
    task = "causal-lm"
    TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                       "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")

    def load(self, source: str, hub_config: dict):
        import transformers

        from .adapters import get_adapter
        architectures = hub_config.get("architectures") or []
        if not architectures:
            raise ModelLoadError(f"{source}: config.json has no 'architectures' entry, so the model class is unknown")
        adapter = get_adapter(architectures[0])
        cls = getattr(transformers, adapter.architecture)
        try:
            model = cls.from_pretrained(source, dtype=torch.float32)
        except Exception as error:  # noqa: BLE001 - every loading failure is the same user problem
            raise ModelLoadError(f"could not load the weights of {source}: {type(error).__name__}: {error}. "
                                 "Are the weight files complete and uncorrupted?") from error
        return adapter, model.config, model.eval()

    def build(self, loaded, changes: dict) -> nn.Module:
        from accelerate import init_empty_weights
        config = copy.deepcopy(loaded.config)
        for key, value in changes.items():
            setattr(config, key, value)
        with init_empty_weights(include_buffers=False):
            return type(loaded.model)(config)

    def save(self, model: nn.Module, loaded, out_dir: Path) -> None:
        model.save_pretrained(out_dir, safe_serialization=True)
        self.copy_tokenizer(loaded.source, out_dir)

    def copy_tokenizer(self, source: str, out_dir: Path) -> None:
        if is_local(source):
            for name in self.TOKENIZER_FILES:
                if (Path(source) / name).is_file() and not (out_dir / name).exists():
                    shutil.copy2(Path(source) / name, out_dir / name)
            return
        try:
            self.tokenizer(source).save_pretrained(out_dir)
        except UserError:  # a model without a tokenizer on the Hub is exported without one
            pass

    def tokenizer(self, source: str):
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(source)
        except Exception as error:  # noqa: BLE001
            raise UserError(f"{source} has no loadable tokenizer ({type(error).__name__}: {error}); "
                            "the barrier needs one to tokenise --data") from error

    def differences(self, a, b):
        values = [(key, getattr(a.config, key, None), getattr(b.config, key, None))
                  for key in a.adapter.compatibility_fields]
        return [(key, x, y) for key, x, y in values if x != y]

    def create_tiny(self, adapter, variant: str) -> nn.Module:
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_config(adapter.tiny_config(variant))

    def save_new(self, model: nn.Module, adapter, variant: str, path: Path) -> None:
        from .tiny import tiny_tokenizer
        model.save_pretrained(path, safe_serialization=True)
        tiny_tokenizer(model.config.vocab_size).save_pretrained(path)

    def vocabulary_problem(self, a, b) -> str | None:
        """Why the two models' tokenizers index tokens differently, or None."""
        try:
            va, vb = self.tokenizer(a.source).get_vocab(), self.tokenizer(b.source).get_vocab()
        except UserError:
            return None  # the barrier step reports a missing tokenizer for A; B's is not needed
        if va == vb:
            return None
        only_a, only_b = len(set(va) - set(vb)), len(set(vb) - set(va))
        moved = sum(1 for tok in set(va) & set(vb) if va[tok] != vb[tok])
        return (f"the tokenizers of {a.source} and {b.source} differ ({only_a} tokens only in A, {only_b} only in B, "
                f"{moved} with different ids): token embeddings are not indexed alike, so the models cannot be aligned")


class TimmBackend(Backend):
    name = "timm"
    task = "image-classification"

    @staticmethod
    def timm_name(source: str) -> str:
        return f"local-dir:{source}" if is_local(source) else f"hf-hub:{source}"

    def load(self, source: str, hub_config: dict):
        import timm

        from .adapters import get_adapter
        try:
            model = timm.create_model(self.timm_name(source), pretrained=True)
        except Exception as error:  # noqa: BLE001
            raise ModelLoadError(f"could not load the timm model {source}: {type(error).__name__}: {error}") from error
        return get_adapter(type(model).__name__), model, model.float().eval()

    def build(self, loaded, changes: dict) -> nn.Module:
        import timm
        from accelerate import init_empty_weights
        args = {**loaded.hub_config.get("model_args", {}), **changes}
        with init_empty_weights(include_buffers=False):
            return timm.create_model(loaded.hub_config["architecture"], pretrained=False, **args)

    def save(self, model: nn.Module, loaded, out_dir: Path) -> None:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out_dir / "model.safetensors"))
        (out_dir / "config.json").write_text(json.dumps(loaded.hub_config, indent=2))

    def differences(self, a, b):
        args_a, args_b = a.hub_config.get("model_args", {}), b.hub_config.get("model_args", {})
        out = [(f"model_args.{k}", args_a.get(k), args_b.get(k)) for k in sorted(set(args_a) | set(args_b))
               if args_a.get(k) != args_b.get(k)]
        return out + [(k, a.hub_config.get(k), b.hub_config.get(k)) for k in ("architecture", "global_pool")
                      if a.hub_config.get(k) != b.hub_config.get(k)]

    def vocabulary_problem(self, a, b) -> str | None:
        return None

    def create_tiny(self, adapter, variant: str) -> nn.Module:
        import timm
        return timm.create_model(adapter.timm_name, pretrained=False, **adapter.tiny_config(variant))

    def save_new(self, model: nn.Module, adapter, variant: str, path: Path) -> None:
        from timm.models import save_for_hf
        save_for_hf(model, str(path), model_args=adapter.tiny_config(variant), safe_serialization=True)

    def preprocessing(self, model) -> dict:
        import timm.data
        return timm.data.resolve_data_config({}, model=model)


BACKENDS: dict[str, Backend] = {b.name: b for b in (TransformersBackend(), TimmBackend())}


def backend_of(hub_config: dict) -> Backend:
    """The library a config.json belongs to."""
    if "architectures" in hub_config or "model_type" in hub_config:
        return BACKENDS["transformers"]
    if "architecture" in hub_config:
        return BACKENDS["timm"]
    raise ModelLoadError("config.json names no architecture: neither a transformers ('architectures') "
                         "nor a timm ('architecture') checkpoint")
