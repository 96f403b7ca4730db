"""`train.nonfinite`: what to do when a step's outputs, its gradients or the weights stop being
finite: stop, or roll back and skip the batch (the numerics: trainer/safety/nonfinite.py).

Checked: the step's outputs (the loop's running sums), every update's gradients (a stand-in
optimizer makes the step's float outputs NaN where one was not finite), and the weights wherever
something is saved or evaluated. 'rollback' restores the newest checkpoint and trains on without
the offending batch, at most `max_rollbacks` times; the skipped batches are checkpointed
(`dropped_batches`), so a resumed run skips them too and stays identical to one that never stopped.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import RunFailure, UserError
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.loops.build import distributed_train_data
from trainer.safety.nonfinite import (
    CAPACITY,
    all_finite,
    batch_index,
    checking_gradients,
    dropped_batches_variable,
    first_bad_step,
    read_dropped,
)
from trainer.task.structure import flat
from trainer.validation import check_choice, check_int

MODES = ("stop", "rollback")


class NonFiniteHandling(Extension):
    """Checks every loop call's outputs; stops, or rolls back past the offending batch."""

    name = "nonfinite"

    def __init__(self, mode: str = "stop", max_rollbacks: int = 3):
        check_choice("train.nonfinite", mode, MODES)
        check_int("train.max_rollbacks", max_rollbacks, minimum=0, maximum=CAPACITY)
        self.mode, self.max_rollbacks = mode, max_rollbacks
        self.setting = f"train.nonfinite = {mode!r}"
        self.supports = modes.ALL if mode == "stop" else modes.SYNCHRONOUS
        self.unsupported_reason = "asynchronous updates cannot be rolled back to one step"
        self.unsupported_fix = "use 'stop'"
        self._bad_steps: list[int] = []
        self.dropped: list[int] = []
        self._fresh = True

    def attach(self, context: Context) -> None:
        inp = context.task.input
        if self.mode == "rollback" and not inp.deterministic:
            raise UserError(
                f"train.nonfinite = 'rollback' needs a deterministic input function, and {inp!r} declares "
                "deterministic = False (a roll-back must find the offending batch again); use 'stop'"
            )
        with context.scope():
            self._variable = dropped_batches_variable()
        context.add_checkpoint_item("dropped_batches", self._variable)
        context.wrap_step(checking_gradients)
        weights = [v for m in flat(context.task.models) for v in getattr(m, "trainable_variables", ())]
        self._weights = weights
        self._weights_finite = tf.function(lambda: all_finite(weights), autograph=False)
        settings = context.settings
        self._check_every = sorted({settings.checkpoint_every_steps, settings.eval_every_steps})

    def restored(self, context: Context, path: str | None) -> None:
        self._fresh = path is None
        self.dropped = read_dropped(self._variable)
        context.skip_batches(self.dropped)

    def begin(self, context: Context) -> None:
        if self.mode == "rollback" and self._fresh:
            context.saver.save(context.start_step)  # something to roll back to before the first periodic checkpoint

    def rollback_to(self, context: Context, step: int, num_steps: int, metrics: Mapping[str, float]) -> int | None:
        bad_step = first_bad_step(context.loop, metrics, step)
        if bad_step is not None:
            return self._recover(context, bad_step, metrics)
        end = step + num_steps
        if end >= context.settings.total_steps or any(end % every == 0 for every in self._check_every):
            self._check_weights(context, step, end)
        return None

    def _check_weights(self, context: Context, step: int, end: int) -> None:
        """Stops a run whose weights went non-finite with finite outputs and gradients (before they are saved)."""
        if not self._weights or bool(self._weights_finite()):
            return
        name = next(
            (getattr(v, "path", v.name) for v in self._weights if not np.all(np.isfinite(v.numpy()))), "a weight"
        )
        latest = context.saver.latest()
        where = f"the last good checkpoint is {latest}" if latest else "there is no checkpoint yet"
        raise RunFailure(
            f"the weights are non-finite ({name}) after steps {step + 1}-{end}, whose outputs and "
            f"gradients were finite; stopped before saving them; {where}"
        )

    def _recover(self, context: Context, bad_step: int, metrics: Mapping[str, float]) -> int:
        """Rolls back past `bad_step` and returns the step training continues from."""
        self._bad_steps.append(bad_step)
        shown = ", ".join(f"{k} {v:g}" for k, v in metrics.items() if not math.isfinite(v)) or "non-finite output"
        latest = context.saver.latest()
        where = f"the last good checkpoint is {latest}" if latest else "there is no checkpoint yet"
        if self.mode == "stop":
            raise RunFailure(f"step {bad_step} gave a non-finite output or gradient ({shown}); stopped; {where}")
        if len(self._bad_steps) > self.max_rollbacks:
            steps = ", ".join(map(str, self._bad_steps))
            raise RunFailure(
                f"outputs were non-finite {len(self._bad_steps)} times (steps {steps}), more than "
                f"train.max_rollbacks {self.max_rollbacks}; stopped; {where}"
            )
        bad_batch = batch_index(bad_step, self.dropped)
        path = context.saver.restore_latest(context.print)
        if path is None:
            raise RunFailure(
                f"step {bad_step} gave a non-finite output or gradient ({shown}) and there is no "
                "checkpoint to roll back to"
            )
        self.dropped = sorted(set(self.dropped) | set(read_dropped(self._variable)) | {bad_batch})
        if len(self.dropped) > CAPACITY:
            raise RunFailure(f"more than {CAPACITY} batches skipped; stopped; {where}")
        self._variable.assign(self.dropped + [-1] * (CAPACITY - len(self.dropped)))
        restored_step = int(context.task.global_step.numpy())
        context.loop.set_dataset(
            distributed_train_data(
                context.runtime.strategy,
                context.task.input,
                context.settings,
                skip_steps=restored_step,
                drop_batches=self.dropped,
            )
        )
        context.print(
            f"step {bad_step} gave a non-finite output or gradient ({shown}); rolled back to {path} (step "
            f"{restored_step}) and skipping batch {bad_batch} "
            f"({len(self._bad_steps)}/{self.max_rollbacks} roll-backs)"
        )
        return restored_step
