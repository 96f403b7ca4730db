"""Schedules and Adam under asynchronous updates: an optimizer step counter that loses no steps.

Keras 3 counts optimizer steps in `optimizer.iterations` with `self._iterations.assign_add(1)`,
and a Keras variable's `assign_add` is `self.assign(self + value)`: a read, then a write. Under
ParameterServerStrategy several workers run that concurrently against the same variable on a
ps task, so two workers that read 41 both write 42 and one step is lost (241-246 of 300 steps
counted with 2 workers). Everything that reads `iterations` then lags the global step: the
learning-rate schedule (`_get_current_learning_rate` calls the schedule on `_iterations`),
warm-up, and Adam's bias correction (`iterations + 1`).

`count_steps_atomically` gives the optimizer's counter an `assign_add` that is one
`AssignAddVariableOp` on the underlying TensorFlow variable, which the ps applies under the
variable's lock, so every step is counted exactly once. A step still reads the counter as it
was when it started (with N workers it may be up to N - 1 behind what it will be when it
applies), which is the staleness every asynchronous update has; it no longer accumulates.
At start the counter is set to the global step, so a checkpoint written with a lagging
counter is corrected on resume. Only the parameter_server loop calls this: every other
strategy keeps Keras' own counter, bit-identical to Keras `fit`.

A closure the coordinator re-runs after a worker failure applies (and counts) its steps
again, as it applies their updates again: the counter then counts updates, not global steps.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from trainer import internals
from trainer.task.structure import flat


@functools.cache
def _atomic_class(keras_variable_class: type) -> type:
    """`keras_variable_class` whose `assign_add`/`assign_sub` are one op on its TensorFlow variable."""

    class AtomicCounter(keras_variable_class):
        counts_atomically = True

        def assign_add(self, value):
            return self._value.assign_add(tf.cast(value, self._value.dtype))

        def assign_sub(self, value):
            return self._value.assign_sub(tf.cast(value, self._value.dtype))

    AtomicCounter.__name__ = AtomicCounter.__qualname__ = f"Atomic{keras_variable_class.__name__}"
    return AtomicCounter


def count_steps_atomically(optimizers, global_step: tf.Variable) -> None:
    """Makes each optimizer's step counter lose no concurrent increments, starting at `global_step`.

    The counter keeps its identity (checkpoints, the optimizer's variable list): only the class
    of the Keras variable is narrowed to one whose increments are atomic.
    """
    for optimizer in flat(optimizers):
        counter = internals.keras_step_counter(optimizer)
        if counter is None:  # not a Keras 3 optimizer: nothing of Keras' to fix
            continue
        if not getattr(counter, "counts_atomically", False):
            counter.__class__ = _atomic_class(type(counter))
        counter.assign(tf.cast(global_step.read_value(), counter.dtype))
