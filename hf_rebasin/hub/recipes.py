"""Recipes, the library side of ``hf-rebasin run`` (reading, paths, each step's command; the fields and their
checks are recipe_checks.py, running the steps is hf_rebasin/cli/recipe_command.py).

A recipe names the models (two or more Hub ids or local folders), the matching method, the held-out data
and the options of each step. Its `merge`, `eval` and `push` blocks hold options of the commands of the
same name, written with `_` for `-` (``max_eval_tokens: 4096`` is ``--max-eval-tokens 4096``): the keys,
types and ranges of the typed options (hf_rebasin/options.py), so a new option is usable in recipes at once
and a bad value is refused before anything runs. Every step runs the ordinary command (``hf-rebasin merge
...``), so ``--dry-run`` shows exactly what would happen and any step can be repeated by hand.

Learned matching at a real budget: a `tokenize` block (data, out, and the options of ``hf-rebasin tokenize``)
writes the training token file before the merge (kept when it exists for the same data and tokenizer) and is
the merge's ``train_data``; ``launch: {num_processes: N}`` runs the merge under ``accelerate launch`` over N
processes (GPUs), data parallel or, with ``merge.fsdp``, sharded.  The dry run prints the training budget:
tokens, flop and the GPU hours they imply (an estimate from arithmetic, hf_rebasin/hub/budget.py).

Relative paths in a recipe are taken from the folder that holds it. The bundled recipes ship inside the
package: their inputs (the example pair) are taken from the package's assets folder, their output folder
from the current folder."""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..assets import asset, recipes_dir
from ..errors import UserError
from .recipe_checks import (
    PATH_OPTIONS,
    REQUIRED_IN_BLOCK,
    block_keys,
    check_fields,
    num_processes,
    step_options,
    trains,
)

RECIPES_DIR = recipes_dir()
SUFFIXES = (".yaml", ".yml")
RECIPE_COPY = "recipe.yaml"  # written into the output folder after the merge: what made it


# --- reading ---------------------------------------------------------------------------------------

class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is written twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def bundled() -> dict[str, Path]:
    return {p.stem: p for p in sorted(RECIPES_DIR.glob("*.y*ml")) if p.suffix in SUFFIXES}


def find_recipe(source: str | Path) -> Path:
    """A recipe file path, or the bare name of a bundled recipe (pythia-1b -> recipes/pythia-1b.yaml)."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    names = bundled()
    if str(source) in names:
        return names[str(source)]
    close = difflib.get_close_matches(str(source), names, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise UserError(f"no recipe file {source} and no bundled recipe of that name{hint}; "
                    f"see the bundled ones with `hf-rebasin run --list`")


def read_yaml(path: Path) -> dict:
    try:
        fields = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise UserError(f"recipe {path} is not valid YAML: {' '.join(str(error).split())}") from error
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"recipe {path} cannot be read: {error}") from error
    if fields is None:
        raise UserError(f"recipe {path} is empty: it needs at least `models` (two or more Hub ids or folders)")
    if not isinstance(fields, dict):
        raise UserError(f"recipe {path} must be a mapping of fields (models:, method:, ...), "
                        f"not {type(fields).__name__}")
    return fields


def apply_overrides(fields: dict, overrides: list[str]) -> dict:
    """--set KEY=VALUE (KEY dotted: merge.alpha, push.repo_id; VALUE read as YAML: 0.3, true, [a, b], null).
    Local paths given this way are taken from the current folder, as on any command line."""
    for text in overrides:
        key, sep, value_text = text.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set expects KEY=VALUE (e.g. merge.alpha=0.3 or method=raw), got {text!r}")
        try:
            value = yaml.safe_load(value_text)
        except yaml.YAMLError:
            value = value_text
        parts = key.strip().split(".")
        target = fields
        for depth, part in enumerate(parts[:-1]):
            if target.get(part) is None:
                target[part] = {}
            if not isinstance(target[part], dict):
                raise UserError(f"--set {text}: {'.'.join(parts[:depth + 1])} is not a block, so it has no "
                                f"field {parts[depth + 1]!r}")
            target = target[part]
        target[parts[-1]] = from_current_folder(tuple(parts), value)
    return fields


def from_current_folder(key: tuple[str, ...], value):
    """An overriding value with its local paths made absolute against the current folder."""
    cwd = Path.cwd()
    if key == ("models",) and isinstance(value, list):
        return [str(resolve_path("model", m, cwd)[1] or m) if isinstance(m, str) else m for m in value]
    kind = {("data",): "data", ("out",): "output"}.get(key) or PATH_OPTIONS.get(key)
    if kind is None or not isinstance(value, str):
        return value
    local = resolve_path("data", value, cwd)[1] if kind == "data" else local_path(value, cwd)
    return str(local) if local is not None else value


# --- paths ------------------------------------------------------------------------------------------

def shown(path: Path) -> str:
    """A path as the commands get it: relative to the current folder when inside it, else absolute."""
    path = Path(os.path.abspath(path))
    try:
        return str(path.relative_to(Path.cwd())) or "."
    except ValueError:
        return str(path)


def local_path(text: str, base: Path) -> Path:
    path = Path(text).expanduser()
    return path if path.is_absolute() else base / path


def is_hub_id(text: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    if text.startswith(("/", "./", "../", "~", ".\\")) or text.count("/") > 1 or "\\" in text:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def resolve_path(kind: str, text: str, base: Path, out_base: Path | None = None) -> tuple[str, Path | None]:
    """(what the command gets, the local path to check or None) for a path of a recipe: a "model" (a Hub id
    stays one, without contacting the Hub), "data" (a datasets spec NAME[:CONFIG[:SPLIT]] stays one), an
    "input" that must exist, or an "output" folder that the step creates (taken from out_base)."""
    from ..sources.data_specs import looks_like_path
    path = local_path(text, out_base or base if kind == "output" else base)
    if not path.exists() and (kind == "model" and is_hub_id(text) or kind == "data" and not looks_like_path(text)):
        return text, None
    return shown(path), None if kind == "output" else path


# --- the recipe -----------------------------------------------------------------------------------------

@dataclass
class Recipe:
    name: str
    path: Path
    base: Path  # relative input paths are taken from here (a bundled recipe's: the package's assets folder)
    fields: dict  # as written, with --set applied
    out_base: Path  # relative output folders are taken from here (a bundled recipe's: the current folder)

    @property
    def out(self) -> Path:
        return local_path(self.fields.get("out") or f"runs/recipes/{self.name}", self.out_base)

    def block(self, step: str) -> dict | None:
        return self.fields.get(step) if step != "merge" else (self.fields.get("merge") or {})

    @property
    def token_file(self) -> Path | None:
        """The token file the `tokenize` step writes (None: no such step, or a method that does not learn)."""
        block = self.fields.get("tokenize")
        return local_path(block["out"], self.out_base) if block is not None and trains(self.fields) else None


def load_recipe(source: str | Path, overrides: list[str] = (), *, check_paths: bool = True) -> Recipe:
    """Read and check a recipe; every problem found is reported in one UserError."""
    path = find_recipe(source)
    fields = apply_overrides(read_yaml(path), list(overrides))
    folder = path.resolve().parent
    packaged = folder == RECIPES_DIR.resolve()  # never write into the installed package
    recipe = Recipe(path.stem, path, asset() if packaged else folder, fields, Path.cwd() if packaged else folder)
    problems = check_fields(fields)
    if not problems and check_paths:
        problems = missing_paths(recipe)
    if problems:
        prepare = fields.get("prepare") if isinstance(fields.get("prepare"), str) else None
        hint = f"\n(the recipe's inputs are made by: {prepare}, run in {recipe.base})" if prepare and any(
            "does not exist" in p for p in problems) else ""
        head = f"recipe {shown(path)} has {len(problems)} problem{'s' if len(problems) > 1 else ''}:"
        raise UserError(head + "".join(f"\n  - {p}" for p in problems) + hint)
    return recipe


def missing_paths(recipe: Recipe) -> list[str]:
    problems = []
    where = f"(relative paths are taken from {recipe.base})"
    for i, text in enumerate(recipe.fields["models"]):
        shown_as, path = resolve_path("model", text, recipe.base)
        if path is not None and not path.is_dir():
            problems.append(f"`models[{i}]`: the local model folder {shown_as} does not exist {where}"
                            if not path.exists() else f"`models[{i}]`: {shown_as} is a file, not a model folder")
    checks = [("data", "data", recipe.fields.get("data")),
              ("tokenize.data", "data", (recipe.fields.get("tokenize") or {}).get("data"))]
    checks += [(f"{step}.{key}", kind, (recipe.block(step) or {}).get(key))
               for (step, key), kind in PATH_OPTIONS.items()]
    for label, kind, text in checks:
        if isinstance(text, str):
            shown_as, path = resolve_path(kind, text, recipe.base)
            if path is not None and not path.exists():
                problems.append(f"`{label}`: {shown_as} does not exist {where}")
    return problems


def option_argv(recipe: Recipe, step: str) -> list[str]:
    """The --flags of a (checked) block, in the order it lists them; a true/false option is its flag or nothing."""
    options, argv = block_keys(step), []
    # what the method ignores (the training budget of a dual recipe run with `--set method=wm`) is left out of the
    # merge command, as the tokenize step is left out
    ignored = step_options(recipe.fields, step).ignored() if step == "merge" else {}
    for key, value in recipe.block(step).items():
        if key in REQUIRED_IN_BLOCK.get(step, ()) or value is None or key in ignored:
            continue
        flag, kind = options[key]["flag"], options[key]["type"]
        if kind is bool:
            argv += [flag] if value else []
            continue
        if (step, key) in PATH_OPTIONS:
            value = resolve_path(PATH_OPTIONS[step, key], value, recipe.base, recipe.out_base)[0]
        argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return argv


def commands(recipe: Recipe, force: bool = False) -> dict[str, list[str]]:
    """The argv of `hf-rebasin` for each step the recipe has: {"tokenize": [...], "merge": [...], "eval": [...],
    "push": [...]} (the merge is launched by `launcher(recipe)`)."""
    fields, out = recipe.fields, shown(recipe.out)
    models = [resolve_path("model", m, recipe.base)[0] for m in fields["models"]]
    steps, merge = {}, ["merge", *models, "--method", fields.get("method") or "wm"]
    if fields.get("data"):
        merge += ["--data", resolve_path("data", fields["data"], recipe.base)[0]]
    if recipe.token_file is not None:
        block = recipe.block("tokenize")
        steps["tokenize"] = ["tokenize", resolve_path("data", block["data"], recipe.base)[0], "--model", models[0],
                             "--out", shown(recipe.token_file), *option_argv(recipe, "tokenize")]
        merge += ["--train-data", shown(recipe.token_file)]
    steps["merge"] = [*merge, *option_argv(recipe, "merge"), "--out", out, *(["--force"] if force else [])]
    if recipe.block("eval") is not None:
        steps["eval"] = ["eval", out, *option_argv(recipe, "eval")]
    if recipe.block("push") is not None:
        steps["push"] = ["push", out, recipe.block("push")["repo_id"], *option_argv(recipe, "push")]
    return steps


def launcher(recipe: Recipe) -> list[str]:
    """What runs the merge step's argv: [] (hf-rebasin itself, in this process), or `accelerate launch` over
    launch.num_processes processes (the flags docs/gpus-and-memory.md gives for one machine;
    `ACCELERATE_USE_CPU=true` runs them on CPUs)."""
    n = num_processes(recipe.fields)
    if n == 1:
        return []
    return ["accelerate", "launch", "--multi_gpu", "--num_processes", str(n), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_rebasin.cli"]


def token_file_problem(recipe: Recipe) -> str | None:
    """Why an existing token file cannot be kept for this recipe (None: none exists, or it holds what the tokenize
    step would write: the same data, text field, split and cap, with the first model's tokenizer)."""
    import json

    from ..sources.token_files import metadata_path
    path = recipe.token_file
    if path is None or not path.exists():
        return None
    block, meta_file = recipe.block("tokenize"), metadata_path(path)
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    data = resolve_path("data", block["data"], recipe.base)[0]
    wanted = {"source": data, "tokenizer": resolve_path("model", recipe.fields["models"][0], recipe.base)[0],
              "text_field": block.get("text_field") or "text", "split": block.get("split"),
              "max_tokens": block.get("max_tokens")}
    found = {key: meta.get(key) for key in wanted}
    same_place = lambda x: Path(x).resolve() if isinstance(x, str) and Path(x).exists() else x
    if all(same_place(found[key]) == same_place(wanted[key]) for key in wanted):
        return None
    return (f"the token file {shown(path)} exists but was not made by this recipe's `tokenize` block (it holds "
            f"{found}, the block asks for {wanted}): delete it, or set tokenize.out to another file")


def budget(recipe: Recipe):
    """The learned-matching budget of the recipe (hf_rebasin/hub/budget.py), or a string saying why it is unknown."""
    from .budget import training_budget
    if not trains(recipe.fields):
        return None
    options = step_options(recipe.fields, "merge")
    model = resolve_path("model", recipe.fields["models"][0], recipe.base)[0]
    try:
        return training_budget(model, options.steps, options.learn_batch_size, options.seq_len,
                               num_processes(recipe.fields), options.gradient_checkpointing)
    except Exception as error:  # noqa: BLE001 - the config cannot be read here (offline, no such folder)
        reason = " ".join(str(error).split())
        return f"unknown until the config of {model} can be read ({type(error).__name__}: {reason})"
