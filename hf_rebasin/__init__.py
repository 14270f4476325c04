"""hf-rebasin: merge independently trained transformers by aligning their symmetries.

    import hf_rebasin
    result = hf_rebasin.merge(["EleutherAI/pythia-1b", "EleutherAI/pythia-1b-deduped"], "merged/", method="wm")
    print(result.report.barrier)

Options are the fields of hf_rebasin.options.MergeOptions (the flags of `hf-rebasin merge`, with _ for -)."""
from __future__ import annotations

import functools
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .requirements import check_installed_versions
from .version import __version__

check_installed_versions()


def _in_python_terms(function):
    """Errors of an API call name the keyword (`force=True`, `seq_len`) where the command line's name the flag."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        from .errors import UserError
        try:
            return function(*args, **kwargs)
        except UserError as error:
            from .options import python_terms
            error.args = (python_terms(str(error)),)
            raise
    return call


@contextmanager
def _model_folders(models):
    """(folders, names) of the models: paths and Hub ids as given; a loaded model (a transformers PreTrainedModel,
    or a (model, tokenizer) pair; a timm model, or a (model, model_args) pair) written to a temporary folder that
    is removed at the end, and named by where it came from."""
    if isinstance(models, (str, os.PathLike)):
        raise TypeError(f"models must be a list of two or more models, e.g. [{str(models)!r}, 'path/b'] (a single "
                        f"string would be read as a list of its characters), got {str(models)!r}")
    from .sources.models import write_loaded
    models = list(models)
    with tempfile.TemporaryDirectory(prefix="hf-rebasin-loaded-") as folder:
        paths, names = [], []
        for k, model in enumerate(models):
            if isinstance(model, (str, os.PathLike)):
                paths.append(str(model))
                names.append(str(model))
            else:
                paths.append(str(Path(folder) / f"model-{k}"))
                names.append(write_loaded(model, paths[-1], k))
        yield paths, names


@_in_python_terms
def merge(models, out, *, force: bool = False, push_to_hub: str | None = None, private: bool = False,
          progress: bool = True, options=None, **option_values):
    """Align the models (paths, Hub ids or loaded models), measure the barrier and write the merged model to
    `out` (an hf-rebasin output folder: model, barrier.json, barrier.png, transforms.safetensors, README.md).
    Returns a MergeResult."""
    from .options import MergeOptions
    from .pipeline import run
    options = options or MergeOptions(**option_values)
    with _model_folders(models) as (paths, names):
        return run(paths, options, out=out, force=force, push_to=push_to_hub, private=private, progress=progress,
                   names=names)


@_in_python_terms
def barrier(models, *, json_path=None, progress: bool = True, options=None, **option_values):
    """Align the models and measure the barrier, writing nothing (but the report to json_path, if given)."""
    from .options import MergeOptions
    from .pipeline import run
    options = options or MergeOptions(**option_values)
    with _model_folders(models) as (paths, names):
        return run(paths, options, json_path=json_path, progress=progress, names=names)


@_in_python_terms
def tokenize(data, model, out, *, text_field: str = "text", split: str | None = None, max_tokens: int | None = None,
             force: bool = False, progress: bool = True) -> dict:
    """Tokenise a text spec (as --data takes it) with the model's tokenizer into a token file `out` (.npy, read
    memory-mapped by --train-data); a datasets spec is read as a streaming split.  Returns what the file holds."""
    from .errors import UserError
    from .export.ownership import check_output_file
    from .sources.backends import BACKENDS
    from .sources.token_files import metadata_path, write_token_file
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {max_tokens}")
    check_output_file(out, "--out", sources=(model,), data=(data,), force=force, ours=lambda path: False,
                      make_parents=True)
    tokenizer = BACKENDS["transformers"].tokenizer(str(model))
    record = write_token_file(str(data), tokenizer, out, text_field=text_field, split=split, max_tokens=max_tokens,
                              tokenizer_name=str(model), progress=progress)
    return {**record, "file": str(out), "metadata": str(metadata_path(out))}


def load(source):
    """A supported model (Hub id or local folder), loaded in fp32 with its adapter and backend."""
    from .sources.models import load as load_model
    return load_model(source)


def describe(source) -> dict:
    """Architecture, sizes and symmetry group of a model, from its config alone."""
    from .describe import describe as describe_model
    return describe_model(source)


__all__ = ["__version__", "barrier", "describe", "load", "merge", "tokenize"]
