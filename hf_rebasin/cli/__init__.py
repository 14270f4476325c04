"""The ``hf-rebasin`` command line: parse (the merge/barrier/eval/push flags are generated from the typed
options in options.py), call the Python API, print.  The only place with argparse, exit codes and
SystemExit: a UserError is one line on stderr and exit code 2, Ctrl-C is exit code 130."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from .. import __version__
from ..errors import RebasinWarning, UserError

DESCRIPTION = ("Merge independently trained transformers (GPT-NeoX/Pythia, LLaMA, OLMo-1, GPT-2, timm ViT) by "
               "aligning their symmetries: permutations of heads and FFN units, a rotation of the residual stream, "
               "invertible maps inside each head. The merged model is written as a checkpoint of its own class.")
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown choice, a value of the wrong type, a missing argument) are one line
    and exit code 2, like every other bad input, instead of the whole usage block; sub-parsers inherit it."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import commands
    parser = Parser(prog="hf-rebasin", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"hf-rebasin {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in commands.REGISTER:
        register(subparsers)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None):
    if issubclass(category, RebasinWarning):
        print(f"hf-rebasin: warning: {message}", file=sys.stderr)
    else:
        _default_show_warning(message, category, filename, lineno, file, line)


_default_show_warning = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)  # imports torch: Ctrl-C often lands here
    except KeyboardInterrupt:
        print("hf-rebasin: interrupted; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED
    args.argv = argv
    warnings.showwarning = _show_warning
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe (`| head`) shows here, inside the handler below, not at exit
        return code
    except UserError as error:
        print(f"hf-rebasin {args.command}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"hf-rebasin {args.command}: interrupted; nothing was left half-written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `hf-rebasin inspect ... | head`: the reader has gone, which is no error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        warnings.showwarning = _default_show_warning


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
