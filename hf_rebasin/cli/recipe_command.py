"""``hf-rebasin run RECIPE``: the command line of recipes (hf_rebasin/hub/recipes.py reads and checks them and builds
each step's command): --list, --dry-run, --set, --skip-*, --force, running the steps in turn through the
ordinary commands, the recipe's copy in the output folder, and on a failed step the command that resumes."""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import traceback

import yaml

from ..errors import UserError
from ..export.ownership import record_files
from ..hub import recipes
from ..hub.recipe_checks import STEPS
from ..hub.recipes import RECIPE_COPY, Recipe, shown
from ..signals import exit_code, is_interrupted, signal_of
from . import app, commands
from .app import EXIT_BAD_INPUT


def shell(argv: list[str], launcher: list[str] = ()) -> str:
    return shlex.join([*launcher, *argv]) if launcher else "hf-rebasin " + shlex.join(argv)


def print_list() -> int:
    names = recipes.bundled()
    if not names:
        print(f"no bundled recipes in {recipes.RECIPES_DIR}")
        return 0
    width = max(map(len, names))
    print(f"bundled recipes ({shown(recipes.RECIPES_DIR)}/):")
    for name, path in names.items():
        try:
            fields = recipes.read_yaml(path)
            line = fields.get("description") or " × ".join(map(str, fields.get("models") or []))
        except UserError as error:
            line = f"(unreadable: {error})"
        print(f"  {name:<{width}}  {line}")
    print("run one with: hf-rebasin run NAME [--dry-run]")
    return 0


def planned(recipe: Recipe, args) -> tuple[dict[str, list[str]], dict[str, str]]:
    """(steps to run, {skipped step: why})."""
    steps = recipes.commands(recipe, force=args.force)
    skipped = {step: f"the recipe has no `{step}` block" for step in STEPS if step not in steps and step != "tokenize"}
    if "tokenize" in recipe.fields and "tokenize" not in steps:
        skipped["tokenize"] = f"method {recipe.fields.get('method') or 'wm'} does not train"
    elif "tokenize" in steps and recipe.token_file.exists() and recipes.token_file_problem(recipe) is None:
        del steps["tokenize"]
        skipped["tokenize"] = f"{shown(recipe.token_file)} already holds this data, tokenised for {steps['merge'][1]}"
    for step in STEPS:
        if getattr(args, f"skip_{step}", False) and step in steps:
            del steps[step]
            skipped[step] = f"--skip-{step}"
    if "tokenize" in steps and "merge" not in steps:  # its file is the merge's training data, and nothing else's
        del steps["tokenize"]
        skipped["tokenize"] = "the merge is skipped"
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
    if "tokenize" in steps and recipes.token_file_problem(recipe):
        raise UserError(recipes.token_file_problem(recipe))
    if "push" in steps:
        from ..hub.push import hub_token
        try:
            hub_token(None)
        except UserError as error:
            raise UserError(f"{error}; or pass --skip-push to leave the push out") from error


def run_step(number: int, total: int, step: str, argv: list[str], launcher: list[str] = ()) -> int:
    """Run one step as the ordinary command, in this process (or under `accelerate launch`); its exit code."""
    print(f"== step {number}/{total}: {step}: {shell(argv, launcher)}", flush=True)
    if launcher:
        return run_launched(launcher, argv)
    try:
        return int(app.main(lambda: commands.REGISTER, argv) or 0)  # a step is never `run` itself
    except SystemExit as stop:  # argparse rejected an option value
        return stop.code if isinstance(stop.code, int) else EXIT_BAD_INPUT
    except Exception:  # noqa: BLE001 - a step that crashed: say which one, and how to go on
        traceback.print_exc()
        return EXIT_BAD_INPUT


def run_launched(launcher: list[str], argv: list[str]) -> int:
    """The merge under `accelerate launch` (its module, from this interpreter); Ctrl-C reaches the processes too
    (the terminal sends it to all of them), a SIGTERM or SIGHUP sent to this process alone is passed on."""
    assert launcher[:2] == ["accelerate", "launch"]
    process = subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", *launcher[2:], *argv])
    try:
        code = process.wait()
    except KeyboardInterrupt as stop:
        signum = signal_of(stop)
        if signum != signal.SIGINT:
            process.send_signal(signum)
        process.wait()
        return exit_code(signum)
    return abs(code) + 128 if code < 0 and is_interrupted(code) else code


def failure_message(step: str, argv: list[str], recipe: Recipe, args, steps: dict, code: int) -> str:
    what = "was interrupted" if is_interrupted(code) else "failed (see the error above)"
    if step == "tokenize":
        return (f"hf-rebasin run: step tokenize {what}; nothing was written to {shown(recipe.token_file)}. "
                f"Fix the problem and rerun: {resume_command(args)}")
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
    """The recipe (with --set applied) in its output folder as recipe.yaml, headed by the command that ran it."""
    target = recipe.out / RECIPE_COPY
    partial = target.with_name(f".{RECIPE_COPY}.partial")
    header = f"# the recipe this folder was made with: {shell(args.argv)}\n# from {recipe.path}\n"
    partial.write_text(header + yaml.safe_dump(recipe.fields, sort_keys=False, allow_unicode=True))
    partial.replace(target)
    record_files(recipe.out, [RECIPE_COPY])  # hf-rebasin's own: --force may replace it


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


def print_budget(recipe: Recipe) -> None:
    budget = recipes.budget(recipe)
    if budget is not None:
        print(f"# learned matching: {budget if isinstance(budget, str) else budget.summary()}", flush=True)


def run_command(args) -> int:
    if args.list:
        return print_list()
    if not args.recipe:
        raise UserError("name a recipe (a YAML file, or a bundled recipe such as pythia-70m), "
                        "or pass --list to see the bundled ones")
    if args.force and args.skip_merge:
        raise UserError("--force (merge again) and --skip-merge (keep the earlier merge) contradict each other")
    recipe = recipes.load_recipe(args.recipe, args.set or [])
    steps, skipped = planned(recipe, args)
    if args.dry_run:
        print(f"# recipe {shown(recipe.path)} (dry run: nothing is run or written)")
        for step in STEPS:
            if step in steps:
                print(shell(steps[step], recipes.launcher(recipe) if step == "merge" else ()))
            elif step in skipped:
                print(f"# {step}: skipped ({skipped[step]})")
        print_budget(recipe)
        if "merge" in steps and recipe.out.exists() and not args.force:
            print(f"# note: {shown(recipe.out)} exists; the real run needs --force or --skip-merge")
        return 0
    check_before_running(recipe, steps, args)
    if "merge" in steps:
        print_budget(recipe)
    for number, (step, argv) in enumerate(steps.items(), start=1):
        code = run_step(number, len(steps), step, argv, recipes.launcher(recipe) if step == "merge" else ())
        if code:
            print(failure_message(step, argv, recipe, args, steps, code), file=sys.stderr)
            return code if is_interrupted(code) else EXIT_BAD_INPUT
        if step == "merge":
            write_recipe_copy(recipe, args)
    compare_with_paper(recipe)
    print(f"hf-rebasin run {recipe.name}: done ({', '.join(steps) or 'nothing to run'}); output in {shown(recipe.out)}")
    return 0


def register(subparsers) -> None:
    from ..hub.recipes import __doc__ as about  # the recipe format (imported at each call: a broken module fails here)
    parser = subparsers.add_parser(
        "run", help="run a YAML recipe: merge, then eval and push when the recipe has those blocks",
        description=about.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
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
