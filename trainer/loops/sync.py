"""The synchronous train loop: several train steps per compiled call.

Each call runs `num_steps` steps on device in a graph while loop (the count a tensor, so a new
count never retraces), calls the step in replica context with `strategy.run`, sums its outputs
on each replica and reduces those sums with SUM in cross-replica context once per call
(`ReplicaTotals`). Hooks run between calls.
"""
from __future__ import annotations

from typing import Callable, Mapping

import tensorflow as tf

from trainer.loops.totals import ReplicaTotals
from trainer.safety import tracing
from trainer.update import xla

StepFn = Callable[..., Mapping[str, tf.Tensor]]


class TrainLoop:
    """Runs `num_steps` training steps per call and returns the mean of each step output."""

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model,
        optimizer,
        step_fn: StepFn,
        global_batch_size: int,
        dataset,
        global_step: tf.Variable,
        *,
        jit_compile: bool = False,
        after_update: Callable[[], None] | None = None,
    ):
        self._strategy = strategy
        self._global_step = global_step
        self._iterator = iter(dataset)

        # XLA (if asked) on the replica function only: iterator ops and the reduce stay outside (rule 9).
        replica_step = xla.replica_step(strategy, step_fn, model, optimizer, global_batch_size,
                                        jit_compile=jit_compile)

        totals = self._totals = ReplicaTotals(strategy, replica_step, "train.step_fn")

        def train_steps(iterator, num_steps):
            state = totals.accumulate(num_steps, lambda: next(iterator), after_step=after_update)
            means = {k: v / tf.cast(num_steps, tf.float32) for k, v in totals.sums(state).items()}
            with tf.control_dependencies(list(means.values())):  # a call that failed counts no steps
                global_step.assign_add(tf.cast(num_steps, global_step.dtype))
            return means, totals.first_nonfinite(state, num_steps)

        # Plain TF ops throughout: no AutoGraph (see trainer/task/user_code.py; the step is converted).
        self._train_steps = tf.function(train_steps, autograph=False)
        self.last_nonfinite_offset: int | None = None

    def run(self, num_steps: int) -> dict[str, float]:
        """Trains `num_steps` steps; returns each output's mean over them as Python floats.

        Afterwards `last_nonfinite_offset` is the 0-based index within this call of the
        first step with a non-finite output (None if every step was finite).
        """
        means, first_nonfinite = self._train_steps(self._iterator, tf.constant(num_steps, tf.int32))
        offset = int(first_nonfinite)
        self.last_nonfinite_offset = offset if offset >= 0 else None
        return {k: float(v) for k, v in means.items()}

    def trace(self, step_name: str) -> tuple[str, ...]:
        """Traces the compiled loop on the real batch spec now (the trace the first call reuses), so
        that a step or model that cannot take the batch is one UserError line before anything is
        written; returns the names of the step's outputs."""
        tracing.traced("train.step_fn", step_name, lambda: self._train_steps.get_concrete_function(
            self._iterator, tf.TensorSpec([], tf.int32)))
        return tuple(self._totals.names)

    def set_dataset(self, dataset) -> None:
        """Continues from a new distributed dataset (after a roll-back); no retracing."""
        self._iterator = iter(dataset)

    @property
    def trace_count(self) -> int:
        """How often the step function was traced (1 after the first call, if nothing retraces)."""
        return self._train_steps.experimental_get_tracing_count()
