"""Eval: every eval split over all of its examples, every N steps and at the end. Extensions acting
on eval results run after it and read `context.evaluations.at(step)` (results only where an eval ran).
"""

from __future__ import annotations

from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension


class PeriodicEval(Extension):
    """Evaluates every eval split every `every_steps` steps and at the end of the run, unless that step
    was evaluated or no step was trained (a run started again after early stopping)."""

    name = "eval"

    def __init__(self, every_steps: int):
        self.every_steps = every_steps
        self._last_step: int | None = None

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if self.at_boundary(step):
            self._evaluate(context, step)

    def end(self, context: Context, step: int) -> None:
        if self._last_step != step and step != context.start_step:
            self._evaluate(context, step)

    def _evaluate(self, context: Context, step: int) -> None:
        context.evaluations.record(step, context.evaluate(step))
        self._last_step = step
