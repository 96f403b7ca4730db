"""The numerics of `train.nonfinite` (the extension: trainer/extensions/nonfinite.py).

The loss can stay finite while the gradient is not (NaN pixels vanish in a fused conv+ReLU, their
kernels' gradients are NaN), so the step's outputs turn NaN where an update had a non-finite gradient.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Callable, Mapping

import keras
import numpy as np
import tensorflow as tf

from trainer.task.structure import flat
from trainer.task.user_code import call_user

if TYPE_CHECKING:
    from trainer.loops.controller import TrainLoopLike

CAPACITY = 64  # most batches a run can skip; fixed so checkpoints keep one shape


def dropped_batches_variable() -> tf.Variable:
    """Create under strategy.scope() and put in the checkpoint."""
    return tf.Variable(
        tf.fill([CAPACITY], tf.constant(-1, tf.int64)),
        trainable=False,
        name="dropped_batches",
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


def first_bad_step(loop: "TrainLoopLike", metrics: Mapping[str, float], step: int) -> int | None:
    """The 1-based global step of the first non-finite output of the call that started at `step`."""
    if loop.last_nonfinite_offset is not None:
        return step + loop.last_nonfinite_offset + 1
    return None if all(math.isfinite(v) for v in metrics.values()) else step + 1


def all_finite(tensors: list) -> tf.Tensor:
    """Whether every element of `tensors` (None, IndexedSlices allowed) is finite: one sum per tensor."""
    values = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors if t is not None]
    if not values:
        return tf.constant(True)
    return tf.math.is_finite(tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in values]))


class FiniteGradients:
    """Stands in for `optimizer` in the step: notes whether each update's gradients are finite,
    then lets the real optimizer apply them. Everything else is the real optimizer's."""

    def __init__(self, optimizer: Any):
        self._optimizer = optimizer
        self.finite: list[tf.Tensor] = []

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        pairs = list(grads_and_vars)
        self.finite.append(all_finite([g for g, _ in pairs]))
        return self._optimizer.apply_gradients(pairs, *args, **kwargs)

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, *args, **kwargs):
        grads = list(grads)
        self.finite.append(all_finite(grads))
        return self._optimizer.apply(grads, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def _checked(optimizer: Any) -> Any:
    if isinstance(optimizer, getattr(keras.optimizers, "LossScaleOptimizer", ())):
        return optimizer  # it skips non-finite updates itself (its scale finds them by design)
    return FiniteGradients(optimizer)


def checking_gradients(step_fn: Callable) -> Callable:
    """`step_fn` whose float outputs are NaN where an update of its had a non-finite gradient."""

    @functools.wraps(step_fn)
    @tf.autograph.experimental.do_not_convert
    def step(model, optimizer, batch, global_batch_size):
        stand_ins = (
            {k: _checked(o) for k, o in optimizer.items()} if isinstance(optimizer, Mapping) else _checked(optimizer)
        )
        outputs = call_user(step_fn, model, stand_ins, batch, global_batch_size)
        graph = tf.compat.v1.get_default_graph()
        # A flag made inside the step's own control flow (an update under `if`) cannot leave it;
        # such updates are left to the weights check.
        flags = [
            f
            for o in flat(stand_ins)
            if isinstance(o, FiniteGradients)
            for f in o.finite
            if not tf.is_tensor(f) or getattr(f, "graph", graph) is graph
        ]
        if not flags or not isinstance(outputs, Mapping):
            return outputs
        finite = tf.reduce_all(tf.stack(flags))
        return {  # tf.as_dtype: a Keras 3 variable (an output such as `metric.count`) has a string dtype
            name: tf.where(finite, value, tf.constant(np.nan, tf.as_dtype(value.dtype)))
            if tf.is_tensor(value) and tf.as_dtype(value.dtype).is_floating
            else value
            for name, value in outputs.items()
        }

    return step
