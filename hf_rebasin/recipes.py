"""Recipes, the library side of ``hf-rebasin run`` (reading, checking, paths, each step's command; running them
is hf_rebasin/cli/recipe_command.py).

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
tokens, flop and the GPU hours they imply (an estimate from arithmetic, hf_rebasin/budget.py).

Relative paths in a recipe are taken from the folder that holds it. The bundled recipes ship inside the
package: their inputs (the example pair) are taken from the package's assets folder, their output folder
from the current folder."""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from .assets import asset, recipes_dir
from .errors import OptionError, UserError
from .options import (
    EvalOptions,
    MergeOptions,
    PushOptions,
    TokenizeOptions,
    device_problems,
    option_table,
    range_problems,
)

RECIPES_DIR = recipes_dir()
SUFFIXES = (".yaml", ".yml")
RECIPE_COPY = "recipe.yaml"  # written into the output folder after the merge: what made it

FIELDS = {  # top-level field -> (YAML type, what it means)
    "description": (str, "one line shown by `hf-rebasin run --list`"),
    "models": (list, "two or more Hub ids or local folders"),
    "method": (str, "matching method (default wm)"),
    "data": (str, "held-out data spec for the barrier (merge --data)"),
    "merge": (dict, "options of `hf-rebasin merge`"),
    "eval": (dict, "options of `hf-rebasin eval` (the step runs only when this block is present)"),
    "push": (dict, "repo_id and options of `hf-rebasin push` (the step runs only when this block is present)"),
    "out": (str, "output folder (default runs/recipes/NAME)"),
    "paper": (dict, "published numbers to compare with: source, barrier {method: nats}, note"),
    "prepare": (str, "the command that creates the recipe's local inputs (shown when they are missing)"),
    "tokenize": (dict, "a training token file made before the merge (`hf-rebasin tokenize`, with the first model's "
                       "tokenizer): data (a text spec), out (FILE.npy), tokenize's options; merge.train_data is it"),
    "launch": (dict, "num_processes: N runs the merge under `accelerate launch` over N processes (GPUs): data "
                     "parallel, or sharded with merge.fsdp"),
}
LAUNCH_FIELDS = {"num_processes": int}
PAPER_FIELDS = {"source": str, "barrier": dict, "note": str}
STEPS = ("tokenize", "merge", "eval", "push")
OPTIONS = {"tokenize": TokenizeOptions, "merge": MergeOptions, "eval": EvalOptions,
           "push": PushOptions}  # the options each block holds
# keys of a step's command that a recipe sets elsewhere (or not at all), with where they belong
NOT_IN_BLOCK = {
    "tokenize": {"force": "is decided by the run: a token file made from the same data with the same tokenizer is "
                          "kept, another one is refused"},
    "merge": {"models": "is the top-level field `models`", "method": "is the top-level field `method`",
              "data": "is the top-level field `data`", "out": "is the top-level field `out`",
              "force": "is the --force option of `hf-rebasin run`",
              "push_to_hub": "is the `push` block (push: {repo_id: ...})",
              "private": "belongs in the `push` block (push: {repo_id: ..., private: true})"},
    "eval": {"dir": "is the top-level field `out`"},
    "push": {"dir": "is the top-level field `out`"},
}
# set in the block, but not options: arguments of the command
REQUIRED_IN_BLOCK = {"push": ("repo_id",), "tokenize": ("data", "out")}
# options that name local paths (resolved like the recipe's other paths): a data spec that may be a path,
# an input that must exist, or an output folder that the step creates
PATH_OPTIONS = {("merge", "match_data"): "data", ("merge", "train_data"): "data", ("merge", "resume"): "input",
                ("merge", "checkpoint_dir"): "output", ("eval", "include_path"): "input"}
TYPE_NAMES = {str: "a string", list: "a list", dict: "a mapping (key: value lines)", bool: "true or false",
              int: "an integer", float: "a number"}


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


# --- checking: keys and YAML types, then the ranges and checks of the typed options --------------------

def unknown_key(where: str, key, allowed) -> str:
    close = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown field {where}{key!r}{hint}; allowed: {', '.join(allowed)}"


def type_problem(where: str, value, expected) -> str | None:
    ok = isinstance(value, expected) and not (isinstance(value, bool) and expected in (int, float, str))
    if expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        return None
    return f"`{where}` must be {TYPE_NAMES.get(expected, expected.__name__)}, got {value!r} ({type(value).__name__})"


def option_problem(where: str, value, kind: type) -> str | None:
    """The YAML value of an option of type `kind`: true/false, an integer, a number, or for a string option a
    string or number (or a list of them, passed comma-joined: tasks: [piqa, sciq] is --tasks piqa,sciq)."""
    if kind is not str:
        return type_problem(where, value, kind)
    bad = [v for v in (value if isinstance(value, list) else [value])
           if isinstance(v, bool) or not isinstance(v, (str, int, float))]
    return f"`{where}` must be a string or a number, got {bad[0]!r} ({type(bad[0]).__name__})" if bad else None


def block_keys(step: str) -> dict[str, dict]:
    """{key: option_table row} of the options a step's block may set."""
    moved = NOT_IN_BLOCK.get(step, {})
    return {key: row for key, row in option_table(OPTIONS[step]).items() if key not in moved}


def check_block(step: str, block: dict) -> list[str]:
    problems = []
    options, moved, required = block_keys(step), NOT_IN_BLOCK.get(step, {}), REQUIRED_IN_BLOCK.get(step, ())
    for key, value in block.items():
        if key in moved:
            problems.append(f"`{step}.{key}` is not set in the `{step}` block: it {moved[key]}")
        elif key in required:
            problems.append(type_problem(f"{step}.{key}", value, str))
        elif key in options and value is None:
            continue  # the option's default
        elif key in options:
            problems.append(option_problem(f"{step}.{key}", value, options[key]["type"]))
        else:
            problems.append(unknown_key(f"in `{step}`: ", key, [*options, *required]))
    problems += [f"the `{step}` block needs `{key}`" for key in required if block.get(key) is None]
    return [p for p in problems if p]


def step_options(fields: dict, step: str):
    """The typed options of a step (MergeOptions, EvalOptions or PushOptions) holding what the recipe sets, as
    the command line would parse it (a list is one comma-joined string)."""
    options = block_keys(step)
    values = {key: ",".join(map(str, value)) if isinstance(value, list) else options[key]["type"](value)
              for key, value in (fields.get(step) or {}).items() if key in options and value is not None}
    if step == "merge":
        values.update(method=fields.get("method") or "wm", data=fields.get("data"))
        block = fields.get("tokenize")
        if trains(fields) and isinstance(block, dict) and isinstance(block.get("out"), str):
            values["train_data"] = block["out"]
    return OPTIONS[step](**values)


def trains(fields: dict) -> bool:
    """Whether the recipe's method learns (lm, dual): only then is a `tokenize` block run."""
    from .match import METHODS
    method = METHODS.get(fields.get("method") or "wm")
    return bool(method and method.learned)


def num_processes(fields: dict) -> int:
    launch = fields.get("launch")
    value = launch.get("num_processes") if isinstance(launch, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def in_recipe_terms(step: str, text: str) -> str:
    """An options message with each --flag written as the recipe field that sets it (`merge.seq_len`, `method`)."""
    fields = {row["flag"]: key for key, row in option_table(OPTIONS[step]).items()}
    pattern = "|".join(map(re.escape, sorted(fields, key=len, reverse=True)))

    def field_name(match: re.Match) -> str:  # `method`, `data`: top-level fields; the others in the block
        key = fields[match.group(0)]
        return f"`{key}`" if key in NOT_IN_BLOCK.get(step, {}) and key in FIELDS else f"`{step}.{key}`"
    return re.sub(rf"(?<![\w-])(?:{pattern})(?![\w-])", field_name, text)


def option_problems(step: str, options, n_models: int | None = None, processes: int = 1) -> list[str]:
    """options.py's checks of a step's options in recipe terms: without n_models each value out of its range,
    choices or devices (one problem each); with it, also what the step's own check refuses (values that do not
    go together, one line), so that it is found before anything runs."""
    problems = range_problems(options)
    if hasattr(options, "device"):
        problems += device_problems(options.device, f"`{step}.device`")
    if n_models is not None and not problems:
        try:
            options.check(n_models=n_models, num_processes=processes, refuse_ignored=False) if step == "merge" \
                else options.check()
        except OptionError as error:
            problems = [str(error)]
    return [in_recipe_terms(step, p) for p in problems]


def check_paper(paper: dict) -> list[str]:
    problems = [type_problem(f"paper.{key}", value, PAPER_FIELDS[key]) if key in PAPER_FIELDS else
                unknown_key("in `paper`: ", key, PAPER_FIELDS) for key, value in paper.items()]
    if isinstance(paper.get("barrier"), dict):
        problems += [type_problem(f"paper.barrier.{m}", v, float) for m, v in paper["barrier"].items()]
    return [p for p in problems if p]


def check_launch(launch: dict) -> list[str]:
    problems = [unknown_key("in `launch`: ", key, LAUNCH_FIELDS) for key in launch if key not in LAUNCH_FIELDS]
    value = launch.get("num_processes")
    if value is not None and (type_problem("launch.num_processes", value, int) or value < 1):
        problems.append(type_problem("launch.num_processes", value, int) or
                        f"`launch.num_processes` must be at least 1, got {value}")
    return problems


def check_tokenize(fields: dict) -> list[str]:
    from .token_files import TOKEN_FILE_SUFFIX  # numpy and torch: not for --help
    block, problems = fields["tokenize"], []
    if isinstance(block.get("out"), str) and not block["out"].endswith(TOKEN_FILE_SUFFIX):
        problems.append(f"`tokenize.out` must name a {TOKEN_FILE_SUFFIX} file (a token file), got {block['out']!r}")
    if isinstance(fields.get("merge"), dict) and fields["merge"].get("train_data") is not None:
        problems.append("`merge.train_data` and the `tokenize` block both name the training data: drop one "
                        "(with a `tokenize` block the merge trains on tokenize.out)")
    return problems


def check_fields(fields: dict) -> list[str]:
    from .match import METHODS
    problems = [unknown_key("", key, FIELDS) if key not in FIELDS else type_problem(key, value, FIELDS[key][0])
                for key, value in fields.items() if key not in FIELDS or value is not None]
    problems = [p for p in problems if p]
    models = fields.get("models")
    if models is None:
        problems.append("`models` is missing: list two or more Hub ids or local folders "
                        "(models: [EleutherAI/pythia-70m, EleutherAI/pythia-70m-deduped])")
    elif isinstance(models, list):
        if len(models) < 2:
            problems.append(f"`models` lists {len(models)} model; a merge needs two or more")
        problems += [f"`models[{i}]` must be a Hub id or a folder (a string), got {m!r}"
                     for i, m in enumerate(models) if not isinstance(m, str) or not m.strip()]
    method = fields.get("method")
    if isinstance(method, str) and method not in METHODS:
        close = difflib.get_close_matches(method, list(METHODS), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(f"unknown method {method!r}{hint}; choose one of {', '.join(METHODS)}")
    # the blocks to check (merge: also when left out, all defaults); the others are absent, or not mappings (said above)
    blocks = [step for step in STEPS if isinstance(fields.get(step), dict) or step == "merge" and not fields.get(step)]
    for step in blocks:
        problems += check_block(step, fields.get(step) or {}) or option_problems(step, step_options(fields, step))
    if isinstance(fields.get("paper"), dict):
        problems += check_paper(fields["paper"])
    if isinstance(fields.get("launch"), dict):
        problems += check_launch(fields["launch"])
    if isinstance(fields.get("tokenize"), dict):
        problems += check_tokenize(fields)
    if isinstance(fields.get("merge"), dict) and fields["merge"].get("fsdp") and num_processes(fields) == 1:
        problems.append("`merge.fsdp` shards the endpoints over the processes of the merge, and this recipe runs it in "
                        "one: set `launch.num_processes` to the number of GPUs (launch: {num_processes: 4}), or "
                        "drop merge.fsdp")
    if not problems:  # every value is in range: what the steps' own checks refuse, found before anything runs
        problems = [p for step in blocks
                    for p in option_problems(step, step_options(fields, step), len(models), num_processes(fields))]
    return problems


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
    from .data import _looks_like_path
    path = local_path(text, out_base or base if kind == "output" else base)
    if not path.exists() and (kind == "model" and is_hub_id(text) or kind == "data" and not _looks_like_path(text)):
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
    launch.num_processes processes (the flags the README gives for one machine; `ACCELERATE_USE_CPU=true` runs them
    on CPUs)."""
    n = num_processes(recipe.fields)
    if n == 1:
        return []
    return ["accelerate", "launch", "--multi_gpu", "--num_processes", str(n), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_rebasin.cli"]


def token_file_problem(recipe: Recipe) -> str | None:
    """Why an existing token file cannot be kept for this recipe (None: none exists, or it holds what the tokenize
    step would write: the same data, text field, split and cap, with the first model's tokenizer)."""
    import json

    from .token_files import metadata_path
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
    same_place = lambda x: Path(x).resolve() if isinstance(x, str) and Path(x).exists() else x  # noqa: E731
    if all(same_place(found[key]) == same_place(wanted[key]) for key in wanted):
        return None
    return (f"the token file {shown(path)} exists but was not made by this recipe's `tokenize` block (it holds "
            f"{found}, the block asks for {wanted}): delete it, or set tokenize.out to another file")


def budget(recipe: Recipe):
    """The learned-matching budget of the recipe (hf_rebasin/budget.py), or a string saying why it is unknown."""
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
