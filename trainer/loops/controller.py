"""The controller: the outer loop of every mode, compiled calls with extensions between them.

The synchronous and asynchronous loops implement `TrainLoopLike` (trainer/loops/build.py picks
one). Each call ends on the nearest boundary of an extension; after it, any extension may throw
its results away (`rollback_to`), else every `after_loop` runs, in the registry's order.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import tensorflow as tf

from trainer.errors import peer_failure
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.extensions.worker_watch import ABSENT_PEERS

PEER_ERRORS = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
    tf.errors.InternalError,
)


class TrainLoopLike(Protocol):
    """What the controller needs of a train loop."""

    def run(self, num_steps: int) -> dict[str, float]:
        """Trains `num_steps` steps; returns each step output's mean over them."""

    def trace(self, step_name: str) -> tuple[str, ...]:
        """Traces the step on the real batch spec; returns the names of its outputs."""

    @property
    def trace_count(self) -> int:
        """How often the step was traced (1 when nothing retraces)."""

    last_nonfinite_offset: int | None
    """After `run`: the 0-based index in that call of its first step with a non-finite output,
    where the loop locates it (None: every output finite, or not located)."""

    def set_dataset(self, dataset) -> None:
        """Continues from new train data (after a roll-back), without retracing."""


class EvaluatorLike(Protocol):
    def evaluate(self) -> dict[str, float]:
        """One pass over an eval split: per-example means, metric results and `num_examples`."""

    def trace(self) -> tuple[str, ...]:
        """Traces the eval pass on the real batch spec; returns the names of its results."""


def drive(context: Context, extensions: Sequence[Extension], steps_per_loop: int) -> int:
    """Runs the loop to `total_steps` (or an extension's stop); returns the step it ended at. However
    it ends, the pending checkpoint write is finished, the metrics log closed and every `close` called."""
    try:
        return _drive(context, extensions, steps_per_loop)
    finally:
        try:
            if context.saver is not None:
                context.saver.wait()
        finally:
            context.metrics_log.close()
            for extension in extensions:
                extension.close(context)


def _drive(context: Context, extensions: Sequence[Extension], steps_per_loop: int) -> int:
    total_steps, saver, metrics_log = context.settings.total_steps, context.saver, context.metrics_log
    metrics_log.resumed(context.start_step)  # what an earlier run logged past start_step is trained again
    context.clock.start_time = time.monotonic()
    for extension in extensions:
        extension.begin(context)
    step = context.start_step
    while step < total_steps and not context.stop_requested:  # an extension may end the run early (every worker)
        boundaries = [b for e in extensions if (b := e.steps_to_boundary(step)) is not None]
        num_steps = min([steps_per_loop, total_steps - step, *boundaries])
        started = time.monotonic()
        try:
            metrics = context.loop.run(num_steps)
        except PEER_ERRORS as e:
            lost, latest = "a peer task may have died or timed out", saver.latest() if saver else None
            if (absent := context.values.get(ABSENT_PEERS)) is not None:  # trainer/extensions/worker_watch.py
                lost += absent(step)
            raise peer_failure(e, f"in steps {step + 1}-{step + num_steps}", lost, latest) from e
        context.clock.train_seconds += time.monotonic() - started
        back = next(
            (s for e in extensions if (s := e.rollback_to(context, step, num_steps, metrics)) is not None), None
        )
        if back is not None:
            step = back
            metrics_log.resumed(step)  # what was logged past the checkpoint rolled back to is trained again
            for extension in extensions:
                extension.rewind(context, step)
            continue
        step += num_steps
        for extension in extensions:
            extension.after_loop(context, step, metrics)
    for extension in extensions:
        extension.end(context, step)
    return step
