"""The checks of a merge or barrier request that need no weights (and, but for `--seq-len`'s context and a
`--resume` file, no torch): options, the sources' configs, the data specs, the output place.  They run before
the first expensive step, and the command line runs them before it imports the pipeline, so that a refusal
comes within a second."""
from __future__ import annotations

import warnings
from pathlib import Path

from .errors import ModelLoadError, OptionError, RebasinWarning
from .sources.data_specs import check_spec_exists
from .sources.file_checks import check_data_has_text, check_local_models


def check_request(models: list[str], options, *, out=None, force: bool = False, json_path=None,
                  push_to: str | None = None) -> None:
    """Raise a UserError for the first problem of the request (every option problem at once)."""
    from .export.ownership import check_output_dir, check_output_file
    options.check(len(models), export=out is not None)
    if out is not None:
        check_output_dir(out, force=force, sources=tuple(models), data=data_specs(options), probe=True)
    if json_path is not None:
        check_output_file(json_path, "--json", sources=tuple(models), data=data_specs(options))
    if push_to is not None:
        from .hub.push import check_push_target
        check_push_target(push_to)
    preflight(models, options)
    from .options import HARMLESS_WHEN_IGNORED, MergeOptions, fields_of, flag_of
    flags = {f.name: flag_of(f) for f in fields_of(MergeOptions)}
    for name, why in options.ignored(export=out is not None).items():
        if name in HARMLESS_WHEN_IGNORED:
            warnings.warn(f"{flags[name]} {why}: it is not used", RebasinWarning, stacklevel=2)


def sibling_folder(missing: str, models: list[str]) -> str | None:
    """A folder of that name beside another model's folder (`merge model-a pair/model-b`: pair/model-a)."""
    name = Path(missing).name
    for other in models:
        folder = Path(other).expanduser()
        if other != missing and name and folder.is_dir() and (folder.parent / name / "config.json").is_file():
            return str(folder.parent / name)
    return None


def data_specs(options) -> tuple:
    """The data specs of a request (local files and folders among them are never written to)."""
    return (options.data, options.match_data, options.train_data)


def check_output_places(models: list[str], options, task: str) -> None:
    """The folders a run writes its own files into, when it does: --self-samples-dir (unless a cache is there
    already), --checkpoint-dir (learned methods: Ctrl-C writes a checkpoint there)."""
    from .export.ownership import check_output_place
    from .match import METHODS
    where = {"sources": tuple(models), "data": data_specs(options)}
    samples = Path(options.self_samples_dir).expanduser()
    if (options.self_sampled(task) or options.refine_sampled(task)) and not any(samples.glob("self-*.npy")):
        check_output_place(samples, "--self-samples-dir", **where)
    method = METHODS.get(options.method)
    if method is not None and (method.learned or options.refine_steps):
        check_output_place(options.checkpoint_dir, "--checkpoint-dir", **where)


SELF_MASKED_LM = ("sampling text from the models needs a causal LM, which generates left to right; a masked LM "
                  "only fills in masked tokens of a given text and has no distribution over whole sequences to draw "
                  "from (Gibbs-style sampling from its conditionals is not a measured scheme here). Give real text "
                  "(--train-data / --match-data), or nothing: learned and activation matching then split --data in "
                  "halves by document")


def masked_lm(config: dict) -> bool:
    """Whether a transformers config.json is of a masked LM (by the adapters' source: no torch)."""
    from .architectures import masked_lm_architectures
    return (config.get("architectures") or [None])[0] in masked_lm_architectures()


def preflight(models: list[str], options) -> None:
    """The checks that need configs but no weights: every source is a model of one library, the data can be
    read for it, the window fits its context, a checkpoint to resume from exists."""
    from .sources.backends import backend_of, read_config_json
    configs = []
    for source in models:
        try:
            configs.append(read_config_json(source))
        except ModelLoadError as error:
            hint = sibling_folder(source, models)
            if hint:
                error.args = (f"{error} (did you mean {hint}?)",)
            raise
    backends = {backend_of(config).name for config in configs}
    if len(backends) > 1:
        raise OptionError(f"the models come from different libraries ({', '.join(sorted(backends))}): only models of "
                          "one architecture can be merged")
    if backends == {"transformers"}:
        check_local_models(models, configs)
    if backends == {"timm"} and not options.data:
        raise OptionError("--data is required for image models (an ImageFolder, an .npz or a Hub dataset)")
    from .options import SELF_DATA
    if options.data == SELF_DATA:
        raise OptionError(f"--data {SELF_DATA}: the barrier is measured on held-out data, never on samples of the "
                          f"models; give real data (a folder named {SELF_DATA} is ./{SELF_DATA})")
    for flag, spec in (("--match-data", options.match_data), ("--train-data", options.train_data)):
        if spec == SELF_DATA and backends == {"transformers"} and any(masked_lm(config) for config in configs):
            raise OptionError(f"{flag} {SELF_DATA}: {SELF_MASKED_LM}")
        if spec == SELF_DATA and backends == {"timm"}:
            raise OptionError(f"{flag} {SELF_DATA} samples text from the models, and these are image classifiers "
                              "(timm): a classifier maps images to labels and cannot generate images to match on. "
                              f"Give {flag} images (an ImageFolder, an .npz or a datasets spec)")
    if backends == {"timm"}:  # options.check took the models for language models, which sample by default
        late = options.refused_as_ignored(task="image-classification")
        if late:
            raise OptionError("; ".join(late))
    for flag, spec in (("--data", options.data), ("--match-data", options.match_data),
                       ("--train-data", options.train_data)):
        if spec and (spec != SELF_DATA or flag == "--data"):
            check_spec_exists(spec, flag)
            check_data_has_text(spec, flag)
    if backends == {"transformers"} and not options.data:
        from .options import DEFAULT_LM_DATA
        from .sources.data_specs import check_hub_dataset
        check_hub_dataset(DEFAULT_LM_DATA, "--data", default=True)
    check_output_places(models, options, "image-classification" if backends == {"timm"} else "causal-lm")
    if backends == {"transformers"} and options.seq_len is not None:
        from .sources.eval_data import check_context
        positions = configs[0].get("max_position_embeddings") or configs[0].get("n_positions")
        check_context(options.seq_len, positions if isinstance(positions, int) else None)  # before transformers
        from transformers import AutoConfig

        from .adapters import get_adapter
        from .sources.eval_data import check_context
        hub_config = read_config_json(models[0])
        adapter = get_adapter((hub_config.get("architectures") or [""])[0])
        config = AutoConfig.from_pretrained(models[0])
        check_context(options.seq_len, adapter.context_length(config))
    if options.resume and not Path(options.resume).expanduser().exists():
        raise OptionError(f"--resume {options.resume}: no such checkpoint file or folder")
    if options.resume and Path(options.resume).expanduser().is_file():  # readable, and a checkpoint at all
        from .match.train_loop import read_checkpoint
        read_checkpoint(Path(options.resume).expanduser())


