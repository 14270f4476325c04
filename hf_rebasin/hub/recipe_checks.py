"""The recipe format: its fields, the blocks that hold each step's options, and the checks of what a recipe
sets (keys and YAML types first, then the ranges and checks of the typed options, in recipe terms); reading
recipes, their paths and their commands are recipes.py."""
from __future__ import annotations

import difflib
import re

from ..errors import OptionError
from ..option_fields import option_table, range_problems
from ..options import EvalOptions, MergeOptions, PushOptions, TokenizeOptions, device_problems

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
    from ..match import METHODS
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
    from ..sources.token_files import TOKEN_FILE_SUFFIX  # numpy and torch: not for --help
    block, problems = fields["tokenize"], []
    if isinstance(block.get("out"), str) and not block["out"].endswith(TOKEN_FILE_SUFFIX):
        problems.append(f"`tokenize.out` must name a {TOKEN_FILE_SUFFIX} file (a token file), got {block['out']!r}")
    if isinstance(fields.get("merge"), dict) and fields["merge"].get("train_data") is not None:
        problems.append("`merge.train_data` and the `tokenize` block both name the training data: drop one "
                        "(with a `tokenize` block the merge trains on tokenize.out)")
    return problems


def check_fields(fields: dict) -> list[str]:
    from ..match import METHODS
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
