"""The ``hf-rebasin`` command line: parse (the merge/barrier/eval/push flags are generated from the typed
options in options.py), call the Python API, print.  The only place with argparse, exit codes and
SystemExit: a UserError is one line on stderr and exit code 2, Ctrl-C is exit code 130 (SIGTERM 143, SIGHUP
129)."""
from __future__ import annotations

import argparse
import sys

from ..errors import UserError
from . import app
from .app import DESCRIPTION, EXIT_BAD_INPUT, EXIT_INTERRUPTED


def registers() -> tuple:
    """Every sub-command's register function (imported only when a parser is built: they import torch, which
    the Ctrl-C handling of main must already cover)."""
    from . import commands, recipe_command
    return (*commands.REGISTER, recipe_command.register)


def build_parser() -> argparse.ArgumentParser:
    return app.build_parser(registers)


def main(argv: list[str] | None = None) -> int:
    """The ``hf-rebasin`` command (argv: its arguments, default the process's); returns the exit code."""
    return app.main(registers, argv)


def entry_point() -> None:
    sys.exit(main())


__all__ = ["DESCRIPTION", "EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "UserError", "build_parser", "entry_point", "main"]

if __name__ == "__main__":
    entry_point()
