"""``hf-rebasin run RECIPE``: run a YAML recipe (merge, then eval and push when the recipe asks for them).

A recipe names the models (two or more Hub ids or local folders), the matching method, the held-out data
and the options of each step. Its `merge`, `eval` and `push` blocks hold options of the commands of the
same name, written with `_` for `-` (``max_eval_tokens: 4096`` is ``--max-eval-tokens 4096``); the
allowed keys are read from those commands, so a new option is usable in recipes at once. Every step runs
the ordinary command (``hf-rebasin merge ...``), so ``--dry-run`` shows exactly what would happen and any
step can be repeated by hand.

Relative paths in a recipe are taken from the folder that holds it. The bundled recipes ship inside the
package: their inputs (the example pair) are taken from the package's assets folder, their output folder
from the current folder."""
from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
import sys
import traceback
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from .assets import asset, recipes_dir
from .cli import UserError

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
}
PAPER_FIELDS = {"source": str, "barrier": dict, "note": str}
STEPS = ("merge", "eval", "push")
# keys of a step's command that a recipe sets elsewhere (or not at all), with where they belong
NOT_IN_BLOCK = {
    "merge": {"models": "is the top-level field `models`", "method": "is the top-level field `method`",
              "data": "is the top-level field `data`", "out": "is the top-level field `out`",
              "force": "is the --force option of `hf-rebasin run`",
              "push_to_hub": "is the `push` block (push: {repo_id: ...})",
              "private": "belongs in the `push` block (push: {repo_id: ..., private: true})"},
    "eval": {"dir": "is the top-level field `out`"},
    "push": {"dir": "is the top-level field `out`"},
}
REQUIRED_IN_BLOCK = {"push": ("repo_id",)}
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
        return [str(model_source(m, cwd)[1] or m) if isinstance(m, str) else m for m in value]
    kind = {("data",): "data", ("out",): "output"}.get(key) or PATH_OPTIONS.get(key)
    if kind is None or not isinstance(value, str):
        return value
    local = data_source(value, cwd)[1] if kind == "data" else local_path(value, cwd)
    return str(local) if local is not None else value


# --- checking ---------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def command_parsers() -> dict[str, argparse.ArgumentParser]:
    from .cli import build_parser
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise RuntimeError("hf-rebasin has no sub-commands")


def options_of(command: str) -> dict[str, argparse.Action]:
    """The recipe keys of a command's --options (`--max-eval-tokens` -> max_eval_tokens)."""
    options = {}
    for action in command_parsers()[command]._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and action.dest != "help":
            options[longs[0][2:].replace("-", "_")] = action
    return options


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


def is_flag(action: argparse.Action) -> bool:
    return action.nargs == 0


def option_problem(where: str, value, action: argparse.Action) -> str | None:
    if value is None:
        return None
    if is_flag(action):
        return type_problem(where, value, bool)
    values = value if isinstance(value, list) else [value]
    for item in values:
        if action.type in (int, float):
            problem = type_problem(where, item, action.type)
        elif isinstance(item, bool) or not isinstance(item, (str, int, float)):
            problem = f"`{where}` must be a string or a number, got {item!r} ({type(item).__name__})"
        else:
            problem = None
        if problem:
            return problem
        if action.choices is not None and str(item) not in {str(c) for c in action.choices}:
            return f"`{where}` must be one of {', '.join(map(str, action.choices))}, got {item!r}"
    if isinstance(value, list) and action.type in (int, float) and action.nargs not in ("+", "*"):
        return f"`{where}` takes one value, got a list {value!r}"
    return None


def check_block(step: str, block: dict) -> list[str]:
    problems = []
    options = options_of(step)
    moved = NOT_IN_BLOCK.get(step, {})
    allowed = [k for k in options if k not in moved] + list(REQUIRED_IN_BLOCK.get(step, ()))
    for key, value in block.items():
        if key in moved:
            problems.append(f"`{step}.{key}` is not set in the `{step}` block: it {moved[key]}")
        elif key in REQUIRED_IN_BLOCK.get(step, ()):
            problems.append(type_problem(f"{step}.{key}", value, str))
        elif key in options:
            problems.append(option_problem(f"{step}.{key}", value, options[key]))
        else:
            problems.append(unknown_key(f"in `{step}`: ", key, allowed))
    for key in REQUIRED_IN_BLOCK.get(step, ()):
        if block.get(key) is None:
            problems.append(f"the `{step}` block needs `{key}`")
    return [p for p in problems if p]


def check_paper(paper: dict) -> list[str]:
    problems = []
    for key, value in paper.items():
        if key not in PAPER_FIELDS:
            problems.append(unknown_key("in `paper`: ", key, PAPER_FIELDS))
            continue
        problems.append(type_problem(f"paper.{key}", value, PAPER_FIELDS[key]))
        if key == "barrier" and isinstance(value, dict):
            problems += [type_problem(f"paper.barrier.{m}", v, float) for m, v in value.items()]
    return [p for p in problems if p]


def check_fields(fields: dict) -> list[str]:
    from .match import METHODS
    problems = []
    for key, value in fields.items():
        if key not in FIELDS:
            problems.append(unknown_key("", key, FIELDS))
        elif value is not None:
            problems.append(type_problem(key, value, FIELDS[key][0]))
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
    for step in STEPS:
        if isinstance(fields.get(step), dict):
            problems += check_block(step, fields[step])
    if isinstance(fields.get("paper"), dict):
        problems += check_paper(fields["paper"])
    return problems


# --- paths ------------------------------------------------------------------------------------------

def is_bundled(recipe_path: Path) -> bool:
    return recipe_path.resolve().parent == RECIPES_DIR.resolve()


def base_dir(recipe_path: Path) -> Path:
    """Where a recipe's relative input paths are taken from."""
    return asset() if is_bundled(recipe_path) else recipe_path.resolve().parent


def output_base(recipe_path: Path) -> Path:
    """Where a recipe's relative output folders are taken from (never inside the installed package)."""
    return Path.cwd() if is_bundled(recipe_path) else recipe_path.resolve().parent


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


def model_source(text: str, base: Path) -> tuple[str, Path | None]:
    """(what merge gets, the local folder or None for a Hub id). Hub ids are not contacted."""
    path = local_path(text, base)
    if path.exists() or not is_hub_id(text):
        return shown(path), path
    return text, None


def data_source(text: str, base: Path) -> tuple[str, Path | None]:
    from .data import _looks_like_path
    path = local_path(text, base)
    if path.exists() or _looks_like_path(text):
        return shown(path), path
    return text, None  # a datasets spec NAME[:CONFIG[:SPLIT]]


def path_option(kind: str, text: str, base: Path, out_base: Path | None = None) -> tuple[str, Path | None]:
    """(what the command gets, the local path to check or None)."""
    if kind == "data":
        return data_source(text, base)
    path = local_path(text, out_base or base if kind == "output" else base)
    return shown(path), path if kind == "input" else None


# --- the recipe -----------------------------------------------------------------------------------------

@dataclass
class Recipe:
    name: str
    path: Path
    base: Path  # relative input paths are taken from here
    fields: dict  # as written, with --set applied
    out_base: Path  # relative output folders are taken from here

    @property
    def out(self) -> Path:
        return local_path(self.fields.get("out") or f"runs/recipes/{self.name}", self.out_base)

    def block(self, step: str) -> dict | None:
        return self.fields.get(step) if step != "merge" else (self.fields.get("merge") or {})


def load_recipe(source: str | Path, overrides: list[str] = (), *, check_paths: bool = True) -> Recipe:
    """Read and check a recipe; every problem found is reported in one UserError."""
    path = find_recipe(source)
    fields = apply_overrides(read_yaml(path), list(overrides))
    recipe = Recipe(path.stem, path, base_dir(path), fields, output_base(path))
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
        shown_as, path = model_source(text, recipe.base)
        if path is not None and not path.is_dir():
            problems.append(f"`models[{i}]`: the local model folder {shown_as} does not exist {where}"
                            if not path.exists() else f"`models[{i}]`: {shown_as} is a file, not a model folder")
    checks = [("data", "data", recipe.fields.get("data"))]
    checks += [(f"{step}.{key}", kind, (recipe.block(step) or {}).get(key))
               for (step, key), kind in PATH_OPTIONS.items()]
    for label, kind, text in checks:
        if isinstance(text, str):
            shown_as, path = path_option(kind, text, recipe.base)
            if path is not None and not path.exists():
                problems.append(f"`{label}`: {shown_as} does not exist {where}")
    return problems


def option_argv(step: str, block: dict, base: Path, out_base: Path | None = None) -> list[str]:
    options = options_of(step)
    argv = []
    for key, value in block.items():
        if key in REQUIRED_IN_BLOCK.get(step, ()) or value is None:
            continue
        action, flag = options[key], options[key].option_strings[-1]
        if is_flag(action):
            argv += [flag] if bool(value) != bool(action.default) else []
            continue
        if (step, key) in PATH_OPTIONS:
            value = path_option(PATH_OPTIONS[step, key], value, base, out_base)[0]
        if isinstance(value, list) and action.nargs in ("+", "*"):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return argv


def commands(recipe: Recipe, force: bool = False) -> dict[str, list[str]]:
    """The argv of `hf-rebasin` for each step the recipe has: {"merge": [...], "eval": [...], "push": [...]}."""
    fields, out = recipe.fields, shown(recipe.out)
    merge = ["merge", *(model_source(m, recipe.base)[0] for m in fields["models"]),
             "--method", fields.get("method") or "wm"]
    if fields.get("data"):
        merge += ["--data", data_source(fields["data"], recipe.base)[0]]
    merge += option_argv("merge", recipe.block("merge"), recipe.base, recipe.out_base) + ["--out", out] + (["--force"] if force else [])
    steps = {"merge": merge}
    if recipe.block("eval") is not None:
        steps["eval"] = ["eval", out, *option_argv("eval", recipe.block("eval"), recipe.base, recipe.out_base)]
    if recipe.block("push") is not None:
        push = recipe.block("push")
        steps["push"] = ["push", out, push["repo_id"], *option_argv("push", push, recipe.base, recipe.out_base)]
    return steps


# --- running --------------------------------------------------------------------------------------

def shell(argv: list[str]) -> str:
    return "hf-rebasin " + shlex.join(argv)


def planned(recipe: Recipe, args) -> tuple[dict[str, list[str]], dict[str, str]]:
    """(steps to run, {skipped step: why})."""
    steps = commands(recipe, force=args.force)
    skipped = {step: f"the recipe has no `{step}` block" for step in STEPS if step not in steps}
    for step in STEPS:
        if getattr(args, f"skip_{step}") and step in steps:
            del steps[step]
            skipped[step] = f"--skip-{step}"
    return steps, skipped


def resume_command(args, *add: str) -> str:
    argv = [a for a in args.argv if a != "--force"]
    return shell(argv + [a for a in add if a not in argv])


def check_before_running(recipe: Recipe, steps: dict, args) -> None:
    out, barrier = recipe.out, recipe.out / "barrier.json"
    if args.skip_merge and not barrier.is_file():
        raise UserError(f"--skip-merge goes on with an earlier merge, but {shown(out)} holds none (no barrier.json); "
                        "run without --skip-merge")
    if "merge" in steps and out.exists() and not args.force:
        if barrier.is_file():
            raise UserError(f"{shown(out)} already holds a merge (barrier.json): pass --skip-merge to go on with "
                            "eval/push using it, or --force to merge again and replace it")
        raise UserError(f"{shown(out)} already exists and is not a merge output: choose another folder "
                        f"(--set out=...) or pass --force to replace it")
    if "push" in steps:
        from .hub import hub_token
        try:
            hub_token(None)
        except UserError as error:
            raise UserError(f"{error}; or pass --skip-push to leave the push out") from error


def run_step(number: int, total: int, step: str, argv: list[str]) -> int:
    from .cli import main
    print(f"== step {number}/{total}: {step}: {shell(argv)}", flush=True)
    try:
        return int(main(argv) or 0)
    except SystemExit as stop:  # argparse rejected an option value
        return stop.code if isinstance(stop.code, int) else 2
    except Exception:  # noqa: BLE001 - a step that crashed: say which one, and how to go on
        traceback.print_exc()
        return 2


def failure_message(step: str, argv: list[str], recipe: Recipe, args, steps: dict, code: int) -> str:
    what = "was interrupted" if code == 130 else "failed (see the error above)"
    if step == "merge":
        return (f"hf-rebasin run: step merge {what}; nothing was written to {shown(recipe.out)}. "
                f"Fix the problem and rerun: {resume_command(args)}")
    later = [s for s in STEPS[STEPS.index(step) + 1:] if s in steps]
    skip = ["--skip-merge"] + (["--skip-eval"] if step == "push" and "eval" in steps else [])
    tail = f", then {', '.join(later)}" if later else ""
    return (f"hf-rebasin run: step {step} {what}; the merge in {shown(recipe.out)} is kept. "
            f"Resume with: {resume_command(args, *skip)}  (runs {step}{tail}), "
            f"or run the step alone: {shell(argv)}")


def write_recipe_copy(recipe: Recipe, args) -> None:
    target = recipe.out / RECIPE_COPY
    partial = target.with_name(f".{RECIPE_COPY}.partial")
    header = f"# the recipe this folder was made with: {shell(args.argv)}\n# from {recipe.path}\n"
    partial.write_text(header + yaml.safe_dump(recipe.fields, sort_keys=False, allow_unicode=True))
    partial.replace(target)


def compare_with_paper(recipe: Recipe) -> None:
    paper = recipe.fields.get("paper") or {}
    published = paper.get("barrier") or {}
    barrier_file = recipe.out / "barrier.json"
    if not published or not barrier_file.is_file():
        return
    measured = json.loads(barrier_file.read_text())
    numbers = ", ".join(f"{method} {value:g}" for method, value in published.items())
    print(f"published barrier ({paper.get('source', 'paper')}): {numbers}; "
          f"this run ({measured['method']}): {measured['barrier']:.2f}")


def print_list() -> int:
    names = bundled()
    if not names:
        print(f"no bundled recipes in {RECIPES_DIR}")
        return 0
    width = max(map(len, names))
    print(f"bundled recipes ({shown(RECIPES_DIR)}/):")
    for name, path in names.items():
        try:
            fields = read_yaml(path)
            line = fields.get("description") or " × ".join(map(str, fields.get("models") or []))
        except UserError as error:
            line = f"(unreadable: {error})"
        print(f"  {name:<{width}}  {line}")
    print("run one with: hf-rebasin run NAME [--dry-run]")
    return 0


def run_command(args) -> int:
    if args.list:
        return print_list()
    if not args.recipe:
        raise UserError("name a recipe (a YAML file, or a bundled recipe such as pythia-70m), "
                        "or pass --list to see the bundled ones")
    if args.force and args.skip_merge:
        raise UserError("--force (merge again) and --skip-merge (keep the earlier merge) contradict each other")
    recipe = load_recipe(args.recipe, args.set or [])
    steps, skipped = planned(recipe, args)
    if args.dry_run:
        print(f"# recipe {shown(recipe.path)} (dry run: nothing is run or written)")
        for step in STEPS:
            print(shell(steps[step]) if step in steps else f"# {step}: skipped ({skipped[step]})")
        if "merge" in steps and recipe.out.exists() and not args.force:
            print(f"# note: {shown(recipe.out)} exists; the real run needs --force or --skip-merge")
        return 0
    check_before_running(recipe, steps, args)
    for number, (step, argv) in enumerate(steps.items(), start=1):
        code = run_step(number, len(steps), step, argv)
        if code:
            print(failure_message(step, argv, recipe, args, steps, code), file=sys.stderr)
            return 130 if code == 130 else 2
        if step == "merge":
            write_recipe_copy(recipe, args)
    compare_with_paper(recipe)
    print(f"hf-rebasin run {recipe.name}: done ({', '.join(steps) or 'nothing to run'}); output in {shown(recipe.out)}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run", help="run a YAML recipe: merge, then eval and push when the recipe has those blocks",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", metavar="RECIPE",
                        help="a recipe file, or the name of a bundled recipe (pythia-1b -> recipes/pythia-1b.yaml)")
    parser.add_argument("--list", action="store_true", help="list the bundled recipes and exit")
    parser.add_argument("--dry-run", action="store_true", help="check the recipe and print the commands; run nothing")
    parser.add_argument("--force", action="store_true", help="replace an existing output folder (merge again)")
    parser.add_argument("--skip-merge", action="store_true",
                        help="keep the merge already in the output folder; go on with eval/push")
    parser.add_argument("--skip-eval", action="store_true", help="leave out the eval step")
    parser.add_argument("--skip-push", action="store_true", help="leave out the push step")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a recipe field (dotted for blocks: merge.alpha=0.3, push.repo_id=me/x, "
                             "eval=null); VALUE is read as YAML; repeatable")
    parser.set_defaults(func=run_command)
