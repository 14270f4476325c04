"""The ``hf-rebasin`` command line.  Each sub-command lives in the module that owns the idea and
registers itself through a ``register(subparsers)`` function listed in COMMAND_MODULES."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# modules that define register(subparsers); each sub-parser sets func=callable(args) -> int exit code
COMMAND_MODULES = ("hf_rebasin.inspect_cmd", "hf_rebasin.merge", "hf_rebasin.hub", "hf_rebasin.evals",
                   "hf_rebasin.recipes")

EXIT_BAD_INPUT = 2


class UserError(Exception):
    """A problem with what the user asked for; printed without a traceback, exit code 2."""


def user_errors() -> tuple[type[BaseException], ...]:
    from .adapters import UnsupportedModelError
    from .data import DataError
    from .models import IncompatibleModelsError, ModelLoadError
    return (UserError, UnsupportedModelError, ModelLoadError, IncompatibleModelsError, DataError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-rebasin", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return int(args.func(args) or 0)
    except user_errors() as error:
        print(f"hf-rebasin {args.command}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"hf-rebasin {args.command}: interrupted; nothing was left half-written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
