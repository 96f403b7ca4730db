"""What to do when a step's outputs stop being finite: stop, or roll back and skip the batch.

'stop' ends the run naming the first non-finite step and the last good checkpoint.
'rollback' restores the newest checkpoint and trains on without the offending batch, at most
`max_rollbacks` times. The skipped batches are kept in the checkpoint (`dropped_batches`), so
a resumed run skips them too and stays identical to one that never stopped.
"""
from __future__ import annotations

import math
from typing import Callable

import tensorflow as tf

from trainer.files.checkpoints import CheckpointSaver
from trainer.errors import RunFailure, UserError

MODES = ("stop", "rollback")
CAPACITY = 64  # most batches a run can skip; fixed so checkpoints keep one shape


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


def check_options(mode: str, max_rollbacks: int) -> None:
    if mode not in MODES:
        raise UserError(f"unknown train.nonfinite {mode!r}; use one of: {', '.join(MODES)}")
    if not 0 <= max_rollbacks <= CAPACITY:
        raise UserError(f"train.max_rollbacks must be in 0..{CAPACITY}, got {max_rollbacks}")


class NonFiniteGuard:
    """Checks each loop call; returns the step to go on from, or raises RunFailure."""

    def __init__(
        self,
        mode: str,
        max_rollbacks: int,
        saver: CheckpointSaver,
        global_step: tf.Variable,
        dropped: tf.Variable,
        rebuild_data: Callable[[int, list[int]], None],
        print_fn: Callable[[str], None] = print,
    ):
        check_options(mode, max_rollbacks)
        self._mode, self._max_rollbacks = mode, max_rollbacks
        self._saver, self._global_step, self._dropped = saver, global_step, dropped
        self._rebuild_data = rebuild_data
        self._print_fn = print_fn
        self._bad_steps: list[int] = []
        self.dropped = read_dropped(dropped)

    def first_bad_step(self, loop, metrics: dict[str, float], step: int) -> int | None:
        """The 1-based global step of the first non-finite output of the call that ended at `step`."""
        offset = getattr(loop, "last_nonfinite_offset", None)
        if offset is not None:
            return step + offset + 1
        return None if all(math.isfinite(v) for v in metrics.values()) else step + 1

    def recover(self, bad_step: int, metrics: dict[str, float]) -> int:
        """Rolls back past `bad_step` and returns the step training continues from."""
        self._bad_steps.append(bad_step)
        shown = ", ".join(f"{k} {v:g}" for k, v in metrics.items() if not math.isfinite(v)) or "non-finite output"
        latest = self._saver.latest()
        where = f"the last good checkpoint is {latest}" if latest else "there is no checkpoint yet"
        if self._mode == "stop":
            raise RunFailure(f"step {bad_step} gave a non-finite output ({shown}); stopped; {where}")
        if len(self._bad_steps) > self._max_rollbacks:
            steps = ", ".join(map(str, self._bad_steps))
            raise RunFailure(
                f"outputs were non-finite {len(self._bad_steps)} times (steps {steps}), more than "
                f"train.max_rollbacks {self._max_rollbacks}; stopped; {where}"
            )
        bad_batch = batch_index(bad_step, self.dropped)
        path = self._saver.restore_latest(self._print_fn)
        if path is None:
            raise RunFailure(f"step {bad_step} gave a non-finite output ({shown}) and there is no checkpoint to roll back to")
        self.dropped = sorted(set(self.dropped) | set(read_dropped(self._dropped)) | {bad_batch})
        if len(self.dropped) > CAPACITY:
            raise RunFailure(f"more than {CAPACITY} batches skipped; stopped; {where}")
        self._dropped.assign(self.dropped + [-1] * (CAPACITY - len(self.dropped)))
        restored_step = int(self._global_step.numpy())
        self._rebuild_data(restored_step, self.dropped)
        self._print_fn(
            f"step {bad_step} gave a non-finite output ({shown}); rolled back to {path} (step "
            f"{restored_step}) and skipping batch {bad_batch} "
            f"({len(self._bad_steps)}/{self._max_rollbacks} roll-backs)"
        )
        return restored_step
