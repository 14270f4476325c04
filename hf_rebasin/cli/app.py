"""How the ``hf-rebasin`` command runs, whatever its sub-commands: one-line argparse errors, exit codes (a
UserError is one line on stderr and exit code 2, Ctrl-C is exit code 130, SIGTERM 143 and SIGHUP 129: see
hf_rebasin/signals.py), warnings as one line.  The sub-commands are passed in (`registers`), so that the recipe
runner (recipe_command.py) can run its steps with the same machinery without importing the package that lists it."""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import time
import warnings

from ..architectures import registered_architectures
from ..errors import RebasinWarning, UserError
from ..signals import STOP_SIGNALS, exit_code, handle, interruption, say, signal_of
from ..version import __version__

DESCRIPTION = ("Merge independently trained transformers by aligning their symmetries: permutations of heads and "
               "FFN units, a rotation of the residual stream, invertible maps inside each head. The merged model is "
               "written as a checkpoint of its own class. Supported classes: "
               f"{', '.join(registered_architectures())}.")
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown choice, a value of the wrong type, a missing argument) are one line
    and exit code 2, like every other bad input, instead of the whole usage block; sub-parsers inherit it."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser(registers) -> argparse.ArgumentParser:
    """The parser of the sub-commands: `registers()` returns their register functions (each adds one to
    argparse's sub-parsers); it is called here, inside main's Ctrl-C handling, because they import torch."""
    parser = Parser(prog="hf-rebasin", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"hf-rebasin {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in registers():
        register(subparsers)
    return parser


def parse(registers, argv: list[str]) -> argparse.Namespace:
    """The arguments; one that no command knows is refused by the sub-command it was given to."""
    parser = build_parser(registers)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        prog = f"{parser.prog} {args.command}"
        parser.exit(EXIT_BAD_INPUT, f"{prog}: error: unrecognized arguments: {' '.join(unknown)} (see {prog} "
                                    "--help)\n")
    return args


def _show_warning(message, category, filename, lineno, file=None, line=None):
    if issubclass(category, RebasinWarning):
        print(f"hf-rebasin: warning: {message}", file=sys.stderr)
    else:
        _default_show_warning(message, category, filename, lineno, file, line)


_default_show_warning = warnings.showwarning


class _CtrlC:
    """SIGINT in the hf-rebasin process (and SIGTERM, SIGHUP: the same, raised as signals.Stopped):
    KeyboardInterrupt, as with Python's own handler, but remembered, because a library may turn it into another
    exception (a tensor conversion reports a ValueError): that is still a Ctrl-C, not a crash.

    Python runs a signal handler wherever the main thread is, and that may be inside a finalizer (a `__del__`
    that the garbage collector calls, a weakref callback: regex's `Group.__del__` during the imports of
    transformers, for one), where an exception is not raised but reported as "Exception ignored in ..." and
    dropped: the Ctrl-C was lost and the merge ran to its end.  `unraisable` catches that report and sends the
    SIGINT again a moment later, when the finalizer has returned, so that it is raised in the code that runs
    next (and sent again should that be another finalizer).

    Nor is an import ever cut short: a C extension's initialization may call Python code where an exception
    cannot pass (torch's `_c10d_init` during `import torch.distributed`: C++ `terminate`, SIGABRT, a core dump
    and exit code -6 instead of 130).  A SIGINT that arrives inside an import the command started is sent again
    until that import has returned, and raised in the code that imported; the first time, a line says so at once
    (importing torch and transformers takes seconds)."""
    pressed, signum, acknowledged = False, signal.SIGINT, False

    @classmethod
    def handler(cls, signum, frame):
        cls.pressed, cls.signum = True, signum
        if _inside(frame, cls.unraisable.__func__.__code__):  # raised here, it would be dropped as well
            cls.resend()
            return
        if _inside(frame, _IMPORTING, below=main.__code__):  # an import the command started, not one running main
            if not cls.acknowledged:
                cls.acknowledged = True
                what = "interrupted" if signum == signal.SIGINT else f"{signal.Signals(signum).name} received"
                say(f"hf-rebasin: {what}; stopping as soon as the import in progress has finished")
            cls.resend(delay_s=0.02)
            return
        raise interruption(signum)

    @classmethod
    def unraisable(cls, report) -> None:
        if issubclass(report.exc_type, KeyboardInterrupt) and cls.pressed:
            cls.resend()
            return
        _default_unraisable(report)

    @classmethod
    def resend(cls, delay_s: float = 0.005) -> None:
        main_thread, signum = threading.main_thread().ident, cls.signum

        def send():
            time.sleep(delay_s)
            signal.pthread_kill(main_thread, signum)
        threading.Thread(target=send, daemon=True).start()

    @classmethod
    def install(cls) -> None:
        cls.pressed, cls.signum, cls.acknowledged = False, signal.SIGINT, False
        handle(cls.handler)
        sys.unraisablehook = cls.unraisable


_IMPORTING = importlib._bootstrap._find_and_load.__code__  # the frame of every `import` that is running


def _inside(frame, code, below=None) -> bool:
    """Whether `code` runs in frame's stack (given `below`, the code of an outer frame: only above that frame)."""
    while frame is not None and frame.f_code is not below:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


_default_unraisable = sys.unraisablehook


def _interrupted(whole_process: bool, what: str, signum: int) -> int:
    """The one line of a command stopped by `signum` (SIGINT: "interrupted", else "interrupted by SIGTERM"...) and
    its exit code, 128 + signum."""
    if whole_process:  # the command only exits now: a second Ctrl-C (often pressed at once) has nothing left to
        for stop in STOP_SIGNALS:  # stop, and would only print a traceback from the shutdown
            if signal.getsignal(stop) == _CtrlC.handler:
                signal.signal(stop, signal.SIG_IGN)
    how = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
    print(f"{what}: interrupted{how}; nothing was left half-written", file=sys.stderr)
    return exit_code(signum)


def _work_done(whole_process: bool) -> None:
    """The command has returned: a SIGTERM or SIGHUP from now on ends the process as by default (there is nothing
    left to clean up), rather than raising in Python's shutdown."""
    if whole_process:
        for stop in STOP_SIGNALS:
            if stop != signal.SIGINT and signal.getsignal(stop) == _CtrlC.handler:
                signal.signal(stop, signal.SIG_DFL)


def main(registers, argv: list[str] | None = None) -> int:
    """Parse argv (default: the process's arguments) with the sub-commands of `registers` (see build_parser) and
    run the command; its exit code."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    whole_process = argv is None and threading.current_thread() is threading.main_thread()  # the hf-rebasin command
    if whole_process:  # not when main() is called inside a program: its SIGINT handling stays its own
        _CtrlC.install()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(registers, argv)
    except KeyboardInterrupt as stop:
        return _interrupted(whole_process, "hf-rebasin", signal_of(stop))
    except Exception:
        if not _CtrlC.pressed:
            raise
        return _interrupted(whole_process, "hf-rebasin", _CtrlC.signum)
    except SystemExit:  # --help, --version, a refused argument
        _work_done(whole_process)
        raise
    args.argv = argv
    warnings.showwarning = _show_warning
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe (`| head`) shows here, inside the handler below, not at exit
        return code
    except UserError as error:
        print(f"hf-rebasin {args.command}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as stop:
        return _interrupted(whole_process, f"hf-rebasin {args.command}", signal_of(stop))
    except BrokenPipeError:  # `hf-rebasin inspect ... | head`: the reader has gone, which is no error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception:
        if not _CtrlC.pressed:
            raise
        return _interrupted(whole_process, f"hf-rebasin {args.command}", _CtrlC.signum)
    finally:
        warnings.showwarning = _default_show_warning
        _work_done(whole_process)
