"""Progress lines for the long phases of an export, and the third-party log floods kept out of them.

An export of a real model runs phases of minutes to half an hour (GGUF conversion, the
quality record, the exactness probe). :class:`Progress` gives each one a line every few
seconds saying what is done and what is left, written to the export's ``log`` (plain
lines: the export's log is usually a file or a pipe, where a redrawn bar would be noise).
:func:`quiet_third_party_logs` lowers the INFO records of the ONNX libraries the export
calls (``onnx_ir``/``onnxscript`` passes of ``torch.onnx.export``, onnxruntime's
quantizer, which switches the root logger to INFO when imported) to WARNING for the
export's duration.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

__all__ = ["Progress", "format_seconds", "quiet_third_party_logs", "NOISY_LOGGERS"]

# Loggers that emit one INFO record per graph node or initializer during an export
# (counted on the default pair's int4 export: 219 "Replaced initializer", 138 quantizer,
# ~100 optimizer/rewriter records); their warnings and errors still show.
NOISY_LOGGERS = ("onnx_ir", "onnxscript", "onnxruntime.quantization", "gguf")  # gguf: the writer logs every scratch file (export.checkpoint_gguf)


def format_seconds(s: float) -> str:
    """``s`` seconds as a short duration: ``"42 s"``, ``"3 min"``, ``"1 h 05 min"``."""
    s = max(0.0, float(s))
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    h, m = divmod(int(round(s / 60)), 60)
    return f"{h} h {m:02d} min"


class Progress:
    """Throttled progress lines of one phase: ``"<what>: 12/40 rows, 3 min elapsed, ~7 min left"``.

    A line is written when :meth:`advance`/:meth:`update` is called at least ``every``
    seconds after the previous line (so a phase that ends within ``every`` seconds writes
    only the line of :meth:`done`), and by :meth:`done`. The time left is the elapsed time
    scaled by the items left over the items done (items are assumed to cost alike).

    Args:
        what: the phase, e.g. ``"quality record"`` (starts each line).
        total: items the phase has (None: unknown; lines then say only what is done).
        log: line sink (the export's ``log``), called with one string per line.
        unit: the items' name, plural (``"rows"``, ``"tensors"``).
        every: least seconds between two lines before the end (default 5).
        clock: seconds source (a monotonic clock; replaced in tests).

    Attributes:
        count: items done so far. lines: lines written so far.
    """

    def __init__(
        self, what: str, total: int | None, log: Callable[[str], None], unit: str = "items", every: float = 5.0, clock: Callable[[], float] = time.monotonic
    ):
        self.what, self.total, self.log, self.unit, self.every, self.clock = what, total, log, unit, float(every), clock
        self.count = 0
        self.lines = 0
        self._t0 = clock()
        self._last = self._t0
        self._said = -1  # the count the last line said
        self._finished = False

    def text(self, now: float | None = None) -> str:
        """The progress line for the current count (at time ``now``; None: the clock's now)."""
        elapsed = (self.clock() if now is None else now) - self._t0
        done = f"{self.count}/{self.total} {self.unit}" if self.total is not None else f"{self.count} {self.unit}"
        line = f"{self.what}: {done}, {format_seconds(elapsed)} elapsed"
        if self.total is not None and 0 < self.count < self.total:
            line += f", ~{format_seconds(elapsed * (self.total - self.count) / self.count)} left"
        return line

    def update(self, count: int) -> None:
        """Set the items done to ``count`` and write a line if ``every`` seconds passed since the last."""
        self.count = int(count)
        now = self.clock()
        if now - self._last >= self.every:
            self._emit(now)

    def advance(self, n: int = 1) -> None:
        """``n`` more items done (:meth:`update`)."""
        self.update(self.count + n)

    def __call__(self, count: int, total: int | None = None) -> None:
        """A progress callback: ``count`` items done (of ``total``, when given it replaces the total)."""
        if total is not None:
            self.total = int(total)
        self.update(count)

    def done(self) -> None:
        """Write the final line (once, and not when the last line already said this count)."""
        if not self._finished:
            self._finished = True
            if self.lines == 0 or self._said != self.count:
                self._emit(self.clock())

    def _emit(self, now: float) -> None:
        self._last, self._said = now, self.count
        self.lines += 1
        self.log(self.text(now))


@contextlib.contextmanager
def quiet_third_party_logs(names: tuple[str, ...] = NOISY_LOGGERS, level: int = logging.WARNING) -> Iterator[None]:
    """Within the block, the loggers ``names`` (and their children) pass only records of
    ``level`` and above; their levels are restored afterwards.

    Set at those loggers, not the root: other INFO records (the user's own logging) are
    untouched, and warnings of the silenced libraries still show. transformers' "Loading
    weights" bars (a redrawn bar, garbled in a log file; each load takes seconds) are off
    in the block too, where transformers is installed.
    """
    loggers = [logging.getLogger(n) for n in names]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        # the logger's own level, not its effective one: onnxruntime's quantizer lowers the root
        # logger to INFO when it is imported, which may happen inside the block
        if lg.level < level:
            lg.setLevel(level)
    try:
        from transformers.utils import logging as tf_logging
    except ImportError:
        tf_logging = None
    bars = tf_logging is not None and tf_logging.is_progress_bar_enabled()
    if bars:
        tf_logging.disable_progress_bar()
    try:
        yield
    finally:
        for lg, lv in zip(loggers, saved):
            lg.setLevel(lv)
        if bars:
            tf_logging.enable_progress_bar()
