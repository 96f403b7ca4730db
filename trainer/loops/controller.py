"""The controller: the outer loop of every mode, compiled calls with hooks between them.

The synchronous loop (`sync.TrainLoop`: strategy.run/reduce inside tf.function) and the
asynchronous one (`ps.PSTrainLoop`: closures scheduled on a ClusterCoordinator) implement the
same `TrainLoopLike` protocol, and their evaluators `EvaluatorLike`; trainer/loops/build.py
chooses between them. `drive` runs either: each call ends on the nearest hook boundary; after
it, any hook may throw the call's results away (`rollback_to`: the non-finite guard), else
every hook's `after_loop` runs, in the registry's order.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import tensorflow as tf

from trainer.errors import peer_failure
from trainer.hooks.base import Hook, Run

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
        """Traces the step on the real batch spec (a broken user function is one UserError line);
        returns the names of the step's outputs."""

    @property
    def trace_count(self) -> int:
        """How often the step was traced (1 when nothing retraces)."""


class EvaluatorLike(Protocol):
    def evaluate(self) -> dict[str, float]:
        """One pass over an eval split: per-example means, metric results and `num_examples`."""

    def trace(self) -> tuple[str, ...]:
        """Traces the eval pass on the real batch spec, checks what the eval step returns and
        returns the names of its results."""


def drive(loop: TrainLoopLike, run: Run, hooks: Sequence[Hook], steps_per_loop: int) -> int:
    """The outer loop: compiled calls that end on the nearest hook boundary, hooks in between.

    Returns the step the run ended at (before `total_steps` if a hook asked to stop). Whatever
    happens, the pending checkpoint write is finished (or its failure said in one line), the
    metrics log closed and every hook's `close` called: a run that stops (a non-finite loss,
    preemption, Ctrl-C, a lost peer) keeps its event records too.
    """
    try:
        return _drive(loop, run, hooks, steps_per_loop)
    finally:
        try:
            if run.saver is not None:
                run.saver.wait()
        finally:
            run.metrics_log.close()
            for hook in hooks:
                hook.close(run)


def _drive(loop: TrainLoopLike, run: Run, hooks: Sequence[Hook], steps_per_loop: int) -> int:
    run.metrics_log.resumed(run.start_step)  # what an earlier run logged past start_step is trained again
    for hook in hooks:
        hook.begin(run)
    step = run.start_step
    while step < run.total_steps and not run.stop_requested:  # a hook may end the run early (every worker alike)
        boundaries = [b for h in hooks if (b := h.steps_to_boundary(step)) is not None]
        num_steps = min([steps_per_loop, run.total_steps - step, *boundaries])
        started = time.monotonic()
        try:
            metrics = loop.run(num_steps)
        except PEER_ERRORS as e:
            lost, latest = "a peer task may have died or timed out", run.saver.latest() if run.saver else None
            raise peer_failure(e, f"in steps {step + 1}-{step + num_steps}", lost, latest) from e
        run.clock.train_seconds += time.monotonic() - started
        back = next((s for h in hooks if (s := h.rollback_to(run, step, num_steps, metrics)) is not None), None)
        if back is not None:
            step = back
            run.metrics_log.resumed(step)  # what was logged past the checkpoint rolled back to is trained again
            for hook in hooks:
                hook.rewind(run, step)
            continue
        step += num_steps
        for hook in hooks:
            hook.after_loop(run, step, metrics)
    for hook in hooks:
        hook.end(run, step)
    return step
