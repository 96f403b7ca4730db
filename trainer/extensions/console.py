"""Where a run's lines go: the console, and the one-line progress bar it keeps below them.

The bar only renders and redraws here; when to draw it is decided by `progress.ProgressLogger`.
"""

from __future__ import annotations

import os
import shutil
from typing import IO, Any, Callable, Mapping


def is_terminal(stream: IO[str]) -> bool:
    """True when `stream` is a terminal that can redraw a line (not a pipe, a file, or TERM=dumb)."""
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LiveBar:
    """`step 120/600 [=====>        ] 20%  loss 0.4213  31.2 steps/s  ETA 0:00:15`, drawn over the
    previous one (carriage return, padded, cut to the terminal width so it never wraps)."""

    def __init__(self, stream: IO[str], max_width: int = 30):
        self._stream = stream
        self._max_width = max_width
        self._shown = 0  # characters of the bar now on screen (0: none)
        self._last: str = ""

    def render(
        self,
        step: int,
        total: int,
        metrics: Mapping[str, float],
        steps_per_sec: float | None,
        eta: str | None,
        columns: int | None = None,
    ) -> str:
        """The bar's text, fitted to `columns` (default: the terminal's width) so it never wraps."""
        if columns is None:
            columns = shutil.get_terminal_size((80, 24)).columns
        fraction = min(max(step / total, 0.0), 1.0) if total else 1.0
        head = f"step {step}/{total}"
        tail = [f"{fraction * 100:3.0f}%"]
        tail += [f"{k} {v:.4g}" for k, v in metrics.items()]
        if steps_per_sec is not None:
            tail.append(f"{steps_per_sec:.1f} steps/s")
        if eta is not None:
            tail.append(f"ETA {eta}")
        text = "  ".join(tail)
        width = min(self._max_width, columns - 1 - len(head) - len(text) - 4)
        if width < 8:  # no room for a bar: the numbers matter more
            return f"{head}  {text}"[: max(columns - 1, 10)]
        filled = int(fraction * width)
        bar = ("=" * filled + (">" if filled < width else "")).ljust(width)
        return f"{head} [{bar}] {text}"

    def draw(self, line: str) -> None:
        self._stream.write("\r" + line.ljust(self._shown))
        self._stream.flush()
        self._shown, self._last = len(line), line

    def clear(self) -> None:
        """Blanks the bar (cursor at the line start), so a plain line can be printed there."""
        if self._shown:
            self._stream.write("\r" + " " * self._shown + "\r")
            self._stream.flush()
            self._shown = 0

    def redraw(self) -> None:
        """Draws the last line again (after `clear` and a printed line)."""
        if self._last:
            self.draw(self._last)

    def finish(self) -> None:
        """Ends the bar's line; the next output starts on a fresh line."""
        if self._shown:
            self._stream.write("\n")
            self._stream.flush()
            self._shown = 0
        self._last = ""


class Console:
    """Where the run's lines go. A live line (the bar) registered with `show_live` is cleared
    before each line and drawn again after it, so lines appear above it."""

    def __init__(self, print_fn: Callable[[str], None] = print):
        self._print_fn = print_fn
        self._live: Any = None  # has clear() and redraw()

    def print(self, line: str) -> None:
        if self._live is None:
            self._print_fn(line)
            return
        self._live.clear()
        self._print_fn(line)
        self._live.redraw()

    def show_live(self, live: Any) -> None:
        self._live = live

    def hide_live(self) -> None:
        self._live = None

    def close_live(self) -> None:
        """Blanks the live line for good: a run that ends early (Ctrl-C) ends on its last line."""
        if self._live is not None:
            self._live.clear()
            self._live = None
