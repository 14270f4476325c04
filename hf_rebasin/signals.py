"""The signals that stop hf-rebasin as Ctrl-C does: SIGINT (Ctrl-C), SIGTERM (`timeout`, `kill`, slurm, `docker
stop`, spot pre-emption) and SIGHUP (the terminal closed).  Each is raised as a KeyboardInterrupt -- SIGTERM and
SIGHUP as its subclass `Stopped`, which names the signal -- so that one path handles all three: every `finally`
and `except BaseException` that cleans up after a Ctrl-C (staging folders, partial files, a learned run's
checkpoint) runs for them too, and the command exits with 128 + the signal's number (130, 143, 129).

A signal the process was started with ignored (`nohup` ignores SIGHUP; a background job of a script, SIGINT) stays
ignored."""
from __future__ import annotations

import os
import signal
import sys

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Stopped(KeyboardInterrupt):
    """A SIGTERM or SIGHUP, raised where a Ctrl-C would be."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interruption(signum: int) -> KeyboardInterrupt:
    """What a stop signal raises: KeyboardInterrupt for SIGINT, as Python's own handler does; Stopped otherwise."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


def signal_of(error: BaseException | None) -> int:
    """The signal a KeyboardInterrupt stands for (SIGINT unless it is a Stopped)."""
    return getattr(error, "signum", signal.SIGINT)


def exit_code(signum: int) -> int:
    """The shell's exit status of a command stopped by `signum`: 128 + its number."""
    return 128 + int(signum)


def name(signum: int) -> str:
    return signal.Signals(signum).name


def is_interrupted(code: int) -> bool:
    """Whether an exit code is that of a command stopped by one of STOP_SIGNALS (128 + n, or -n: killed by it)."""
    return any(code in (exit_code(s), -int(s)) for s in STOP_SIGNALS)


def handle(handler) -> dict[int, object]:
    """Install `handler` for every stop signal that is not ignored; returns the handlers it replaced."""
    previous = {}
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, handler)
    return previous


def restore(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def say(text: str) -> None:
    """One line on stderr from a signal handler: written to the descriptor at once (the handler may run while
    the main thread is inside a write to sys.stderr, which a second write from the handler would not survive)."""
    try:
        os.write(sys.stderr.fileno(), (text + "\n").encode(errors="replace"))
    except (OSError, ValueError, AttributeError):
        pass
