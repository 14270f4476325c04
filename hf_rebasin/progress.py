"""Progress bars: tqdm's when stderr is a terminal; otherwise (a log file, a pipe, CI) one line per stage when it
ends ("weight matching: 40/40 in 1.6 s (distance=0.3195)"), never tqdm's carriage-return frames.

    from .progress import tqdm   # the call signature of tqdm's, for what hf-rebasin uses of it
"""
from __future__ import annotations

import sys
import time


def tqdm(iterable=None, *, desc: str | None = None, total: float | None = None, disable: bool = False,
         **kwargs):
    if sys.stderr.isatty() or disable:
        from tqdm.auto import tqdm as bar
        return bar(iterable, desc=desc, total=total, disable=disable, **kwargs)
    return StageLine(iterable, desc=desc, total=total, unit=kwargs.get("unit", "it"), initial=kwargs.get("initial", 0))


class StageLine:
    """What hf-rebasin uses of a tqdm bar (iterate, update, set_postfix, close, with), written as one line on
    stderr when the stage ends (closed, or its iterable exhausted)."""

    def __init__(self, iterable=None, *, desc: str | None = None, total: float | None = None, unit: str = "it",
                 initial: int = 0):
        self.iterable, self.desc, self.unit, self.n = iterable, desc or "done", unit, initial
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.postfix, self.start, self.closed = "", time.perf_counter(), False

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.n += 1
        self.close()

    def __len__(self) -> int:
        return int(self.total or 0)

    def update(self, n: float = 1) -> None:
        self.n += n

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
        count = f"{self.n:g}/{self.total:g}" if self.total else f"{self.n:g}"
        extra = f" ({self.postfix})" if self.postfix else ""
        unit = "" if self.unit == "it" else f" {self.unit}s"
        print(f"{self.desc}: {count}{unit} in {time.perf_counter() - self.start:.1f} s{extra}", file=sys.stderr,
              flush=True)

    def __enter__(self) -> StageLine:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
