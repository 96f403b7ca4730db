"""The optimizer as a step sees it where the update runs after the step (XLA under a multi-device strategy,
accumulation, clipping) and in the loss-scaling guard's probe: `apply_gradients` and `apply` only record."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

ONCE_MESSAGE = (
    "the optimizer update runs after the step here (train.jit_compile under a multi-device strategy, "
    "train.grad_accum_steps, train.clip_global_norm), so the step may call apply_gradients only "
    "once per optimizer; unset those options for this step"
)


class GradientRecorder:
    """Stands in for `optimizer`, recording each update call's gradients and variables (`once`: a second call
    is an error; otherwise all are kept, in order)."""

    def __init__(self, optimizer: Any, *, once: bool = True):
        self._optimizer = optimizer
        self._once = once
        self.gradients: list = []
        self.variables: list = []
        self.calls = 0

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        return self._record([g for g, _ in grads_and_vars], [v for _, v in grads_and_vars])

    def apply(self, grads, trainable_variables=None, *args, **kwargs):
        # Keras' `apply` without variables means those the optimizer was built with (no public name).
        variables = trainable_variables if trainable_variables is not None else self._optimizer._trainable_variables
        return self._record(list(grads), list(variables))

    def _record(self, gradients: list, variables: list):
        self.calls += 1
        if self._once and self.calls > 1:
            raise ValueError(ONCE_MESSAGE)
        self.gradients += [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in gradients]
        self.variables += variables
        return self._optimizer.iterations

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)
