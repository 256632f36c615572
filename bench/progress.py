"""Where a benchmark is and how long it has left: a live bar on a terminal (rich), plain lines otherwise."""

from __future__ import annotations

import sys
import time
from types import TracebackType


class Progress:
    """``with Progress(total_steps, seconds_per_step) as p: ... p.step("scenario x, policy y, round 1")``.

    On a terminal (stderr is a TTY) a rich progress bar shows the step's label and the estimated
    time left; otherwise each step is one line on stderr (``[3/12] label  ~40 s left``), so logs and
    CI output stay readable. ``seconds_per_step`` is the planned time of one step (s), corrected by
    the measured pace once steps have finished.
    """

    def __init__(self, total_steps: int, seconds_per_step: float, title: str = "bench") -> None:
        self.total = max(1, total_steps)
        self.planned = seconds_per_step
        self.title = title
        self.done = 0
        self._started = time.monotonic()
        self._bar = None
        self._task = None

    def __enter__(self) -> Progress:
        if sys.stderr.isatty():
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                            TimeRemainingColumn(), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.title, total=self.total)
        return self

    def left_s(self) -> float:
        """Estimated seconds left (the measured pace once a step finished, else the plan)."""
        pace = (time.monotonic() - self._started) / self.done if self.done else self.planned
        return pace * (self.total - self.done)

    def step(self, label: str) -> None:
        """A step starts: show ``label`` (what runs now) and the time left."""
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=f"{self.title}: {label}")
        else:
            print(f"[{self.done + 1}/{self.total}] {self.title}: {label}  ~{self.left_s():.0f} s left",
                  file=sys.stderr, flush=True)
        self.done += 1

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            self._bar.stop()
