"""The two model libraries hf-rebasin works with, behind one interface: how a checkpoint's configuration
is read (without its weights), how a model of that class is built without initialising weights, how the
stock loader loads one, what goes beside the weights in an output folder (config, tokenizer or timm's
preprocessing), what the inputs are, and which settings two mergeable models must share.

The rest of the package never asks which library a model comes from: it asks the backend."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ModelLoadError, UserError
from ..requirements import import_optional
from .file_checks import TOKENIZER_FILES, has_tokenizer_files
from .hub_access import hub_cache, hub_unreachable, offline_variable

if TYPE_CHECKING:
    import torch
    from torch import nn


def is_local(source: str | Path) -> bool:
    return Path(source).expanduser().exists()


def looks_like_path(source: str) -> bool:
    """A source that can only mean a local path, so that a missing one is "no such folder" at once (never a Hub
    look-up): absolute, ./ ../ ~, a backslash, a trailing '/', more than one '/' (Hub ids are owner/name), or
    owner/name whose owner is a local folder (runs/merged where runs/ exists).  A bare name (gpt2) may be a
    legacy Hub id: it is looked up, and refused in one line when the Hub cannot answer (hub_access)."""
    if source.startswith(("/", "./", "../", "~", ".\\")) or source in (".", "..") or source.endswith("/"):
        return True
    return source.count("/") > 1 or "\\" in source or (
        source.count("/") == 1 and Path(source.split("/")[0]).expanduser().is_dir())


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
    elif not is_hub_id(source):
        raise ModelLoadError(f"no such model folder: {source}")
    else:
        config_file = hub_config_file(source)
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{config_file} is not valid JSON: {error}") from error


def hub_config_file(repo_id: str) -> Path:
    """config.json of a Hub repository: from the cache when the Hub cannot be asked (hub_access), else
    downloaded; every failure one line naming the id."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError
    local = "" if "/" in repo_id else "no such local folder, and "
    why = hub_unreachable()
    if why is not None:
        cached = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache())
        if isinstance(cached, str):
            return Path(cached)
        fix = ("unset it to download the repo" if offline_variable() else
               "set HF_HUB_OFFLINE=1 to use the Hub cache alone without trying the Hub")
        raise ModelLoadError(f"{repo_id}: {local}no Hub repo of that id in the cache, and {why}: check the name; "
                             f"{fix}")
    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except RepositoryNotFoundError as error:
        raise ModelLoadError(f"{repo_id}: {local}no Hub repo of that id (or a private one: log in with `hf auth "
                             "login`)") from error
    except Exception as error:
        raise ModelLoadError(f"could not get config.json of {repo_id!r} from the Hugging Face Hub "
                             f"({type(error).__name__}: {' '.join(str(error).split())}). Is it a local folder that "
                             "does not exist, a misspelt repo id, or are you offline without a cache?") from error


def empty_weights():
    """A context in which modules get their parameters on the meta device and their buffers for real."""
    from accelerate import init_empty_weights
    return init_empty_weights(include_buffers=False)


class Backend:
    name: ClassVar[str]
    task: ClassVar[str]  # "causal-lm" or "image-classification"

    def configure(self, folder: Path, hub_config: dict):
        """(adapter, config) of a checkpoint folder, from its configuration alone."""
        raise NotImplementedError

    def build(self, loaded, changes: dict) -> nn.Module:
        """A model of loaded's class and configuration (with changes): buffers real, parameters on the meta
        device (no memory, no initialisation) until a state dict is assigned."""
        raise NotImplementedError

    def load_model(self, loaded) -> nn.Module:
        """The checkpoint loaded by the library's own loader, in fp32 (for comparisons and small models)."""
        raise NotImplementedError

    def base_prefix(self, loaded) -> str:
        """The prefix of the base model's parameters (checkpoints saved from the base model lack it)."""
        return ""

    def write_companions(self, loaded, changes: dict, dtype: torch.dtype, out_dir: Path) -> None:
        """Everything an output folder needs beside the weights (config with changes and dtype, tokenizer...)."""
        raise NotImplementedError

    def differences(self, a, b) -> list[tuple[str, Any, Any]]:
        """(field, value in a, value in b) for every library-level setting in which two models differ."""
        raise NotImplementedError

    def vocabulary_problem(self, a, b) -> str | None:
        return None


class TransformersBackend(Backend):
    name = "transformers"
    task = "causal-lm"

    def configure(self, folder: Path, hub_config: dict):
        from transformers import AutoConfig

        from ..adapters import get_adapter
        architectures = hub_config.get("architectures") or []
        if not architectures:
            raise ModelLoadError(f"{folder}: config.json has no 'architectures' entry, so the model class is unknown")
        adapter = get_adapter(architectures[0])
        try:
            config = AutoConfig.from_pretrained(folder)
        except Exception as error:  # a config transformers cannot read is the user's to fix
            raise ModelLoadError(f"{folder}/config.json cannot be read by transformers ({type(error).__name__}: "
                                 f"{' '.join(str(error).split())})") from error
        return adapter, config

    def model_class(self, loaded):
        import transformers
        return getattr(transformers, loaded.adapter.architecture)

    def build(self, loaded, changes: dict) -> nn.Module:
        config = copy.deepcopy(loaded.config)
        for key, value in changes.items():
            setattr(config, key, value)
        with empty_weights():
            return self.model_class(loaded)(config)

    def load_model(self, loaded) -> nn.Module:
        import torch
        try:
            return self.model_class(loaded).from_pretrained(loaded.folder, dtype=torch.float32).eval()
        except Exception as error:
            raise ModelLoadError(f"could not load the weights of {loaded.source}: {type(error).__name__}: {error}. "
                                 "Are the weight files complete and uncorrupted?") from error

    def base_prefix(self, loaded) -> str:
        return self.model_class(loaded).base_model_prefix

    def write_companions(self, loaded, changes: dict, dtype: torch.dtype, out_dir: Path) -> None:
        config = copy.deepcopy(loaded.config)
        for key, value in changes.items():
            setattr(config, key, value)
        config.dtype = dtype
        config.architectures = [loaded.adapter.architecture]
        config.save_pretrained(out_dir)
        for name in ("generation_config.json", *TOKENIZER_FILES):
            if (loaded.folder / name).is_file():
                shutil.copy2(loaded.folder / name, out_dir / name)

    def tokenizer(self, source: str | Path):
        from transformers import AutoTokenizer
        if is_local(source) and Path(source).expanduser().is_dir() and not has_tokenizer_files(
                Path(source).expanduser()):
            raise UserError(f"{source} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): copy the "
                            "tokenizer the model was trained with into the folder")
        try:
            return AutoTokenizer.from_pretrained(source)
        except Exception as error:
            reason = " ".join(str(error).split())
            raise UserError(f"{source} has no loadable tokenizer ({type(error).__name__}: {reason}); one is needed "
                            "to tokenise text (--data, --train-data, tokenize)") from error

    def differences(self, a, b):
        """The adapter's facts by meaning (config_facts), not the config's attributes by spelling: a config written
        by transformers 4 (rotary_pct, rotary_emb_base) and one by 5 (rope_parameters) that mean the same agree."""
        fa, fb = a.adapter.config_facts(a.config), b.adapter.config_facts(b.config)
        keys = [*fa, *(k for k in fb if k not in fa)]
        return [(key, fa.get(key), fb.get(key)) for key in keys if fa.get(key) != fb.get(key)]

    def vocabulary_problem(self, a, b) -> str | None:
        """Why the two models' tokenizers index tokens differently, or None."""
        for model in (a, b):  # transformers would make an empty tokenizer from the model type: not the problem
            if not has_tokenizer_files(model.folder):
                return (f"{model.source} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...), so "
                        "hf-rebasin cannot check that the models index tokens alike: copy the tokenizer the model "
                        "was trained with into the folder")
        from .file_checks import vocabulary_difference
        vocabularies = []
        for model in (a, b):  # each model's tokenizer: one that cannot be loaded is refused, B's as A's
            try:
                vocabularies.append(self.tokenizer(model.folder).get_vocab())
            except UserError as error:
                return str(error).replace(str(model.folder), str(model.source), 1)
        return vocabulary_difference(*vocabularies, a.source, b.source)


class TimmBackend(Backend):
    name = "timm"
    task = "image-classification"

    @staticmethod
    def timm_name(source: str | Path) -> str:
        return f"local-dir:{source}" if is_local(source) else f"hf-hub:{source}"

    def configure(self, folder: Path, hub_config: dict):
        from ..adapters import get_adapter
        timm = import_optional("timm")
        try:
            with empty_weights():
                model = timm.create_model(self.timm_name(folder), pretrained=False)
        except Exception as error:
            raise ModelLoadError(f"could not build the timm model of {folder}: {type(error).__name__}: {error}") \
                from error
        return get_adapter(type(model).__name__), model

    def build(self, loaded, changes: dict) -> nn.Module:
        timm = import_optional("timm")
        args = {**loaded.hub_config.get("model_args", {}), **changes}
        with empty_weights():
            return timm.create_model(loaded.hub_config["architecture"], pretrained=False, **args)

    def load_model(self, loaded) -> nn.Module:
        timm = import_optional("timm")
        try:
            return timm.create_model(self.timm_name(loaded.folder), pretrained=True).float().eval()
        except Exception as error:
            raise ModelLoadError(f"could not load the timm model {loaded.source}: {type(error).__name__}: {error}") \
                from error

    def write_companions(self, loaded, changes: dict, dtype: torch.dtype, out_dir: Path) -> None:
        config = copy.deepcopy(loaded.hub_config)
        if changes:  # create_model(architecture, **model_args) must build the exported layout
            config["model_args"] = {**config.get("model_args", {}), **changes}
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))

    def differences(self, a, b):
        args_a, args_b = a.hub_config.get("model_args", {}), b.hub_config.get("model_args", {})
        out = [(f"model_args.{k}", args_a.get(k), args_b.get(k)) for k in sorted(set(args_a) | set(args_b))
               if args_a.get(k) != args_b.get(k) and k not in a.adapter.bias_args]
        return out + [(k, a.hub_config.get(k), b.hub_config.get(k)) for k in ("architecture", "global_pool")
                      if a.hub_config.get(k) != b.hub_config.get(k)]

    def preprocessing(self, model) -> dict:
        return import_optional("timm.data").resolve_data_config({}, model=model)


BACKENDS: dict[str, Backend] = {b.name: b for b in (TransformersBackend(), TimmBackend())}


def backend_of(hub_config: dict) -> Backend:
    """The library a config.json belongs to."""
    if "architectures" in hub_config or "model_type" in hub_config:
        return BACKENDS["transformers"]
    if "architecture" in hub_config:
        return BACKENDS["timm"]
    raise ModelLoadError("config.json names no architecture: neither a transformers ('architectures') "
                         "nor a timm ('architecture') checkpoint")
