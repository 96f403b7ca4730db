"""Checkpoints: one every N steps and at the end, which every worker takes part in. The registry
orders it after every extension with state, so the checkpoint of step S holds what they decided
at S and a run resumed from it decides as one that never stopped.
"""

from __future__ import annotations

from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension


class PeriodicCheckpoints(Extension):
    """Saves every `every_steps` steps and at the end; every worker takes part (trainer/files/checkpoints.py)."""

    name = "checkpoint"

    def __init__(self, every_steps: int):
        self.every_steps = every_steps

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if self.at_boundary(step) and step < context.settings.total_steps:
            context.saver.save(step)

    def end(self, context: Context, step: int) -> None:
        if context.saver.last_saved_step != step:
            context.saver.save(step)
        context.saver.wait()  # an asynchronous write is complete before the export and the run's last line
