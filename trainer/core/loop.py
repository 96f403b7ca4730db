"""The compiled parts of the synchronous loop: several train steps per call, and a full eval pass.

Each call runs `num_steps` steps on device in a `tf.range` loop (a tensor, so a new count
never retraces), calls the step in replica context with `strategy.run` and reduces its
outputs with SUM in cross-replica context (DESIGN.md rule 3). Hooks run between calls.
"""
from __future__ import annotations

from typing import Callable, Mapping

import tensorflow as tf

from trainer.core import xla

StepFn = Callable[..., Mapping[str, tf.Tensor]]
SUM = tf.distribute.ReduceOp.SUM


def _reduce(strategy: tf.distribute.Strategy, outputs) -> dict[str, tf.Tensor]:
    return {k: tf.cast(strategy.reduce(SUM, v, axis=None), tf.float32) for k, v in outputs.items()}


def _all_finite(outputs: dict[str, tf.Tensor]) -> tf.Tensor:
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in outputs.values()])


def _add(a: dict[str, tf.Tensor], b: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    return {k: a[k] + b[k] for k in a}


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
    ):
        self._strategy = strategy
        self._global_step = global_step
        self._iterator = iter(dataset)

        # XLA (if asked) on the replica function only: iterator ops and the reduce stay outside (rule 9).
        replica_step = xla.replica_step(strategy, step_fn, model, optimizer, global_batch_size,
                                        jit_compile=jit_compile)

        def one_step(iterator):
            return _reduce(strategy, strategy.run(replica_step, args=(next(iterator),)))

        def train_steps(iterator, num_steps):
            # The first step is peeled so the loop variables take the step's own output keys.
            totals = one_step(iterator)
            first_nonfinite = tf.where(_all_finite(totals), -1, 0)
            for i in tf.range(1, num_steps):
                outputs = one_step(iterator)
                first_nonfinite = tf.where((first_nonfinite < 0) & ~_all_finite(outputs), i, first_nonfinite)
                totals = _add(totals, outputs)
            global_step.assign_add(tf.cast(num_steps, global_step.dtype))
            means = {k: v / tf.cast(num_steps, tf.float32) for k, v in totals.items()}
            return means, first_nonfinite

        self._train_steps = tf.function(train_steps)
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

    def set_dataset(self, dataset) -> None:
        """Continues from a new distributed dataset (after a roll-back); no retracing."""
        self._iterator = iter(dataset)

    @property
    def trace_count(self) -> int:
        """How often the step function was traced (1 after the first call, if nothing retraces)."""
        return self._train_steps.experimental_get_tracing_count()


class Evaluator:
    """One pass over the eval set, every example once; returns each output's per-example mean."""

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model,
        eval_step_fn: StepFn,
        dataset,
        num_batches: int,
    ):
        self._dataset = dataset
        self._num_batches = num_batches

        def one_batch(iterator):
            return _reduce(strategy, strategy.run(lambda b: eval_step_fn(model, b), args=(next(iterator),)))

        def eval_batches(iterator, num_batches):
            totals = one_batch(iterator)
            for _ in tf.range(num_batches - 1):
                totals = _add(totals, one_batch(iterator))
            return totals

        self._eval_batches = tf.function(eval_batches)

    def evaluate(self) -> dict[str, float]:
        totals = self._eval_batches(iter(self._dataset), tf.constant(self._num_batches, tf.int32))
        totals = {k: float(v) for k, v in totals.items()}
        count = totals.pop("num_examples")
        return {k: v / count for k, v in totals.items()} | {"num_examples": count}
