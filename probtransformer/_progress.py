"""Progress of the long loops (SVI steps, ensemble members, MCMC transitions): a tqdm bar on a
terminal, and plain lines when stderr is a file or a pipe (``fit > log 2>&1``, a batch job),
where tqdm's bar would otherwise turn itself off and leave the log silent for the whole fit.

A plain line says what the bar says, one line at a time::

    SVI: 600/3000 steps (20%), 9.84 steps/s, elapsed 01:01, ETA 04:04, elbo=-1.08e+04

It is written at most every ``LINE_INTERVAL_S`` seconds, plus one at the start and one at the
end: a 2-minute fit logs about 6 lines, a 75-minute one about 150, so ``tail -f`` shows the loop
moving every half-minute without the log growing a line per step. (Every 10% would leave a slow
fit silent for 7 minutes at a time.)
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm

#: Seconds between two plain progress lines (tqdm's ``mininterval``).
LINE_INTERVAL_S = 30.0

_LINE_FORMAT = (
    "{desc}: {n_fmt}/{total_fmt}{unit} ({percentage:.0f}%), {rate_fmt}, elapsed {elapsed}, "
    "ETA {remaining}{postfix}"
)
_LINE_FORMAT_NO_TOTAL = "{desc}: {n_fmt}{unit}, {rate_fmt}, elapsed {elapsed}{postfix}"


class _LineProgress(tqdm):
    """tqdm writing one whole line per update (no carriage returns), at most every
    ``mininterval`` seconds, and a last line when it closes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._shown_n = -1
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm clearing its bar (leave=False): a log keeps its lines
            return False  # and so tqdm writes no carriage return after it
        self.fp.write((msg or self.__str__()) + "\n")
        self.fp.flush()
        self._shown_n = self.n
        return True

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs: Any) -> None:
        super().set_postfix(ordered_dict, refresh=False, **kwargs)  # shown with the next line

    def close(self) -> None:
        if not self.disable and self.n != self._shown_n:
            self.display()  # where the loop ended, stopped early or interrupted included
        self.leave = False  # the lines stay as they are: no last bar, no newline after it
        super().close()


def progress_bar(
    iterable: Iterable | None = None, *, progress: bool = True, unit: str = "steps", **kwargs: Any
) -> tqdm:
    """A tqdm progress bar over ``iterable`` (or updated by hand: ``total=``).

    Args:
        iterable: what the loop iterates over; None to call ``update`` by hand.
        progress: False: show nothing (the library's ``progress=False``).
        unit: what one iteration is, plural (``"steps"``, ``"transitions"``).
        **kwargs: tqdm's (``desc``, ``total``, ``initial``, ``leave``, ...).

    Returns:
        On a terminal (stderr a tty), tqdm's bar; otherwise a tqdm that writes plain lines to
        stderr, ``desc: n/total unit (p%), rate, elapsed, ETA, postfix``, every
        ``LINE_INTERVAL_S`` seconds and when it closes; with ``progress=False``, a disabled one.
    """
    if not progress:
        return tqdm(iterable, disable=True, **kwargs)
    if sys.stderr.isatty():
        return tqdm(iterable, unit=unit[:-1] if unit.endswith("s") else unit, **kwargs)
    total = kwargs.get("total", len(iterable) if hasattr(iterable, "__len__") else None)
    return _LineProgress(
        iterable,
        file=sys.stderr,
        unit=f" {unit}",  # "9.84 steps/s"
        mininterval=LINE_INTERVAL_S,
        miniters=1,  # check the clock every step: tqdm's own guess stretched 30 s to 45 s
        maxinterval=float("inf"),  # tqdm's monitor thread would lower miniters: lines per step
        bar_format=_LINE_FORMAT if total else _LINE_FORMAT_NO_TOTAL,
        dynamic_ncols=False,
        **kwargs,
    )


__all__ = ["LINE_INTERVAL_S", "progress_bar"]
