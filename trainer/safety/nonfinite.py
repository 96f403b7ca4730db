"""`train.nonfinite`: what to do when a step's outputs stop being finite: stop, or roll back and skip the batch.

'stop' ends the run naming the first non-finite step and the last good checkpoint.
'rollback' restores the newest checkpoint and trains on without the offending batch, at most
`max_rollbacks` times. The skipped batches are kept in the checkpoint (`dropped_batches`), so
a resumed run skips them too and stays identical to one that never stopped.

An extension like any other: it adds `dropped_batches` to the checkpoint, provides the batches
to skip to the loop ('skipped_batches'), and throws a call's results away (`rollback_to`)
before any other hook sees them.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import tensorflow as tf

from trainer import data
from trainer.distribution import modes
from trainer.errors import RunFailure, UserError
from trainer.extensions.protocol import Extension, Setup
from trainer.hooks.base import Run
from trainer.validation import check_choice, check_int

MODES = ("stop", "rollback")
CAPACITY = 64  # most batches a run can skip; fixed so checkpoints keep one shape
SKIPPED = "skipped_batches"


def dropped_batches_variable() -> tf.Variable:
    """Create under strategy.scope() and put in the checkpoint."""
    return tf.Variable(
        tf.fill([CAPACITY], tf.constant(-1, tf.int64)), trainable=False, name="dropped_batches",
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def read_dropped(variable: tf.Variable) -> list[int]:
    return sorted(int(i) for i in variable.numpy() if i >= 0)


def batch_index(step: int, dropped: list[int]) -> int:
    """Index in the unskipped batch stream of the batch that global step `step` (1-based) used."""
    index = step - 1
    for d in sorted(dropped):
        if d <= index:
            index += 1
    return index


def first_bad_step(loop: Any, metrics: Mapping[str, float], step: int) -> int | None:
    """The 1-based global step of the first non-finite output of the call that started at `step`."""
    offset = getattr(loop, "last_nonfinite_offset", None)
    if offset is not None:
        return step + offset + 1
    return None if all(math.isfinite(v) for v in metrics.values()) else step + 1


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

    def attach(self, setup: Setup) -> None:
        inp = setup.task.input
        if self.mode == "rollback" and not inp.deterministic:
            raise UserError(f"train.nonfinite = 'rollback' needs a deterministic input function, and {inp!r} declares "
                            "deterministic = False (a roll-back must find the offending batch again); use 'stop'")
        with setup.scope():
            self._variable = dropped_batches_variable()
        setup.add_checkpoint_item("dropped_batches", self._variable)
        self._setup = setup

    def restored(self, setup: Setup, path: str | None) -> None:
        self._fresh = path is None
        self.dropped = read_dropped(self._variable)
        setup.provide(SKIPPED, tuple(self.dropped))

    def begin(self, run: Run) -> None:
        if self.mode == "rollback" and self._fresh:
            run.saver.save(run.start_step)  # something to roll back to before the first periodic checkpoint

    def rollback_to(self, run: Run, step: int, num_steps: int, metrics: Mapping[str, float]) -> int | None:
        bad_step = first_bad_step(run.loop, metrics, step)
        return None if bad_step is None else self._recover(run, bad_step, metrics)

    def _recover(self, run: Run, bad_step: int, metrics: Mapping[str, float]) -> int:
        """Rolls back past `bad_step` and returns the step training continues from."""
        self._bad_steps.append(bad_step)
        shown = ", ".join(f"{k} {v:g}" for k, v in metrics.items() if not math.isfinite(v)) or "non-finite output"
        latest = run.saver.latest()
        where = f"the last good checkpoint is {latest}" if latest else "there is no checkpoint yet"
        if self.mode == "stop":
            raise RunFailure(f"step {bad_step} gave a non-finite output ({shown}); stopped; {where}")
        if len(self._bad_steps) > self.max_rollbacks:
            steps = ", ".join(map(str, self._bad_steps))
            raise RunFailure(
                f"outputs were non-finite {len(self._bad_steps)} times (steps {steps}), more than "
                f"train.max_rollbacks {self.max_rollbacks}; stopped; {where}"
            )
        bad_batch = batch_index(bad_step, self.dropped)
        path = run.saver.restore_latest(run.print_fn)
        if path is None:
            raise RunFailure(f"step {bad_step} gave a non-finite output ({shown}) and there is no checkpoint to roll back to")
        self.dropped = sorted(set(self.dropped) | set(read_dropped(self._variable)) | {bad_batch})
        if len(self.dropped) > CAPACITY:
            raise RunFailure(f"more than {CAPACITY} batches skipped; stopped; {where}")
        self._variable.assign(self.dropped + [-1] * (CAPACITY - len(self.dropped)))
        restored_step = int(self._setup.task.global_step.numpy())
        settings, runtime = self._setup.settings, self._setup.runtime
        run.loop.set_dataset(data.distribute_train(
            runtime.strategy, self._setup.task.input, settings.global_batch_size, settings.seed,
            method=settings.distribute_method, shard_policy=settings.shard_policy, skip_steps=restored_step,
            drop_batches=self.dropped))
        run.print_fn(
            f"step {bad_step} gave a non-finite output ({shown}); rolled back to {path} (step "
            f"{restored_step}) and skipping batch {bad_batch} "
            f"({len(self._bad_steps)}/{self.max_rollbacks} roll-backs)"
        )
        return restored_step
