"""The checkpoint hook: a checkpoint every N steps and at the end, which every worker takes part in.

It runs after every extension that keeps state of its own (the registry orders it so), so the
checkpoint of step S holds what those extensions decided at step S: a run resumed from it
decides exactly as one that never stopped.
"""

from __future__ import annotations

from trainer.hooks.base import Hook, Run
from trainer.validation import check_int


class CheckpointHook(Hook):
    """Saves every `every_steps` steps and at the end; every worker takes part (trainer/files/checkpoints.py)."""

    name = "checkpoint"

    def __init__(self, every_steps: int):
        check_int("checkpoint_hook.every_steps", every_steps)
        self.every_steps = every_steps

    def after_loop(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        if self.at_boundary(step) and step < run.total_steps:
            run.saver.save(step)

    def end(self, run: Run, step: int) -> None:
        if run.saver.last_saved_step != step:
            run.saver.save(step)
        run.saver.wait()  # an asynchronous write is complete before the export and the run's last line
