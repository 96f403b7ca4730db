"""Schedules and Adam under asynchronous updates: an optimizer step counter that loses no steps.

Keras 3's `optimizer.iterations.assign_add(1)` is a read, then a write. Under ParameterServerStrategy
workers run it concurrently against one variable on a ps, so two that read 41 both write 42 (measured:
241-246 of 300 steps counted with 2 workers), and the learning-rate schedule, warm-up and Adam's bias
correction lag the global step. `count_steps_atomically` makes it one `AssignAddVariableOp`, applied under
the variable's lock, and sets the counter to the global step at start (correcting a lagging checkpoint).
A step still reads the counter as it was when it started (the staleness of any asynchronous update); a
closure re-run after a worker failure counts again. Only the parameter_server loop calls this: other
strategies keep Keras' own counter, bit-identical to `fit`.
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
            backing = internals.keras_variable_backing(self)
            return backing.assign_add(tf.cast(value, backing.dtype))

        def assign_sub(self, value):
            backing = internals.keras_variable_backing(self)
            return backing.assign_sub(tf.cast(value, backing.dtype))

    AtomicCounter.__name__ = AtomicCounter.__qualname__ = f"Atomic{keras_variable_class.__name__}"
    return AtomicCounter


def count_steps_atomically(optimizers, global_step: tf.Variable) -> None:
    """Makes each optimizer's step counter atomic, from `global_step`; the counter keeps its identity (only its
    class is narrowed), so checkpoints and the optimizer's variable list are unchanged."""
    for optimizer in flat(optimizers):
        counter = internals.keras_step_counter(optimizer)
        if counter is None:  # not a Keras 3 optimizer: nothing of Keras' to fix
            continue
        if not getattr(counter, "counts_atomically", False):
            counter.__class__ = _atomic_class(type(counter))
        counter.assign(tf.cast(global_step.read_value(), counter.dtype))
