"""`train.max_time_secs`: a wall-clock budget for one run of the process, for a cluster that kills
jobs at a time limit. After the loop call in which the budget ran out the run ends as any run
ends (the final eval, a checkpoint of that step), with one line, and exits 0; the same command
continues from that checkpoint, with a fresh budget: the budget is not kept in the checkpoint.

The clock starts when `train` does (building, restoring and tracing count; the imports before it
do not). Each worker of multi_worker_mirrored reads its own clock: one all-reduce per loop call
(`AnyWorker`) stops them all as soon as any one's budget is spent, at the same step; under
parameter_server the coordinator decides alone.
"""

from __future__ import annotations

import time
from typing import Callable

from trainer.extensions.context import Context
from trainer.extensions.monitoring import AnyWorker
from trainer.extensions.protocol import Extension
from trainer.validation import check_number


class TimeBudget(Extension):
    """Stops every worker after the loop call that spent `max_time_secs`."""

    name = "time_budget"
    setting = "train.max_time_secs"
    after = ("checkpoint",)  # its line names the checkpoint the end of the run saves

    def __init__(self, max_time_secs: float):
        self.max_time_secs = max_time_secs
        self._started = time.monotonic()
        self._spent: float | None = None  # the seconds spent when the stop was agreed
        self._agreed: Callable[[bool], bool] = bool

    @classmethod
    def of(cls, max_time_secs: float | None) -> "TimeBudget | None":
        """The extension for `train.max_time_secs`, checked (None: no budget)."""
        check_number("train.max_time_secs", max_time_secs, optional=True)
        return None if max_time_secs is None else cls(max_time_secs)

    def begin(self, context: Context) -> None:
        if context.runtime.spans_processes:
            self._agreed = AnyWorker(context.runtime.strategy)

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        spent = time.monotonic() - self._started
        if self._agreed(spent >= self.max_time_secs) and step < context.settings.total_steps:
            self._spent = spent
            context.request_stop()

    def end(self, context: Context, step: int) -> None:
        if self._spent is not None and context.runtime.is_chief:
            context.print(
                f"time budget: {self._spent:.0f} s spent of train.max_time_secs {self.max_time_secs:g} at step "
                f"{step}; saved ckpt-{step}; rerun the same command to continue (with a fresh budget)"
            )
