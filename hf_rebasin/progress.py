"""Progress bars: tqdm's when stderr is a terminal; otherwise (a log file, a pipe, CI, nohup, slurm) plain lines,
never tqdm's carriage-return frames: one every HF_REBASIN_PROGRESS_EVERY seconds while a stage runs (default 30;
0: none) with its count, rate and time left ("dual matching: 1200/20000 steps (6%), 3.1 steps/s, 1h41m left
(loss=2.3461)"), and one when it ends ("weight matching: converged after 4 rounds (at most 10) in 1.6 s").

    from .progress import tqdm   # the call signature of tqdm's, for what hf-rebasin uses of it
"""
from __future__ import annotations

import os
import sys
import time

EVERY_VARIABLE = "HF_REBASIN_PROGRESS_EVERY"
DEFAULT_EVERY_S = 30.0


def every_s() -> float:
    """Seconds between the lines of a running stage off a terminal (HF_REBASIN_PROGRESS_EVERY; 0: only the last);
    a value that is not a number of seconds >= 0 is the default."""
    try:
        value = float(os.environ.get(EVERY_VARIABLE, DEFAULT_EVERY_S))
    except ValueError:
        return DEFAULT_EVERY_S
    return value if value >= 0 and value == value else DEFAULT_EVERY_S


def duration(seconds: float) -> str:
    """3 s, 4m05s, 1h41m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def conclude(bar, summary: str) -> None:
    """Close a stage with its own account of how it ended ("converged after 4 rounds (at most 10)") in place of
    its count; a tqdm bar on a terminal just closes."""
    if isinstance(bar, StageLine):
        bar.summary = summary
    bar.close()


def tqdm(iterable=None, *, desc: str | None = None, total: float | None = None, disable: bool = False,
         **kwargs):
    if sys.stderr.isatty() or disable:
        from tqdm.auto import tqdm as bar
        return bar(iterable, desc=desc, total=total, disable=disable, **kwargs)
    return StageLine(iterable, desc=desc, total=total, unit=kwargs.get("unit", "it"), initial=kwargs.get("initial", 0))


class StageLine:
    """What hf-rebasin uses of a tqdm bar (iterate, update, set_postfix, close, with), written as lines on stderr:
    one every `every_s()` seconds while the stage runs, one when it ends (closed, or its iterable exhausted)."""

    def __init__(self, iterable=None, *, desc: str | None = None, total: float | None = None, unit: str = "it",
                 initial: int = 0):
        self.iterable, self.desc, self.unit, self.n, self.initial = iterable, desc or "done", unit, initial, initial
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.postfix, self.start, self.closed, self.summary = "", time.perf_counter(), False, None
        self.every, self.shown = every_s(), self.start

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def update(self, n: float = 1) -> None:
        self.n += n
        running = not self.closed and (not self.total or self.n < self.total)
        if self.every > 0 and running and time.perf_counter() - self.shown >= self.every:
            self.show_running()

    def show_running(self) -> None:
        """The line of a stage under way: count (share of the total), rate, time left, postfix."""
        now = time.perf_counter()
        self.shown = now
        unit = "" if self.unit == "it" else f" {self.unit}s"
        count = f"{self.n:g}/{self.total:g}{unit} ({100 * self.n / self.total:.0f}%)" if self.total else \
            f"{self.n:g}{unit}"
        rate = (self.n - self.initial) / max(now - self.start, 1e-9)
        parts = [count, f"{rate:.3g} {self.unit}s/s" if self.unit != "it" else f"{rate:.3g}/s"]
        if self.total and rate > 0:
            parts.append(f"{duration((self.total - self.n) / rate)} left")
        extra = f" ({self.postfix})" if self.postfix else ""
        print(f"{self.desc}: {', '.join(parts)}{extra}", file=sys.stderr, flush=True)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        values = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or self.desc

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        unit = "" if self.unit == "it" else f" {self.unit}s"
        count = self.summary or (f"{self.n:g}/{self.total:g}{unit}" if self.total else f"{self.n:g}{unit}")
        extra = f" ({self.postfix})" if self.postfix else ""
        print(f"{self.desc}: {count} in {time.perf_counter() - self.start:.1f} s{extra}", file=sys.stderr,
              flush=True)

    def __enter__(self) -> StageLine:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
