"""A step that never applies its gradients trains nothing, yet its loss, eval and checkpoints look like a
run. So over the first loop call of every run, this compares a checksum of every trainable variable before
and after: none changed is one warning line naming the step (the weights' bits are summed as integers,
so an update too small to move a float sum still shows)."""

from __future__ import annotations

import tensorflow as tf

from trainer.distribution import modes
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.task.contract import function_name
from trainer.task.structure import flat


class UpdateCheck(Extension):
    """Warns, once, when no trainable variable changed over the run's first loop call."""

    name = "update_check"
    supports = modes.ALL

    def __init__(self) -> None:
        self._before: list[int] | None = None

    def begin(self, context: Context) -> None:
        self._before = _checksums(context)

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if self._before is None:
            return
        before, self._before = self._before, None
        trained = step - context.start_step
        # Gradient accumulation applies every grad_accum_steps: a shorter first call legitimately changes nothing.
        if trained < context.settings.grad_accum_steps or _checksums(context) != before:
            return
        if context.runtime.is_chief:
            name = function_name(context.task.step_fn)
            context.print(
                f"warning: no trainable variable changed over steps {context.start_step}-{step}: the step "
                f"(train.step_fn = @{name}) applies no update; call optimizer.apply_gradients(zip(gradients, "
                "variables)) in it"
            )


def _checksums(context: Context) -> list[int]:
    variables = [v for model in flat(context.task.models) for v in model.trainable_variables]
    return [int(_bits_sum(tf.convert_to_tensor(v)).numpy()) for v in variables]


def _bits_sum(value: tf.Tensor) -> tf.Tensor:
    """The sum of `value`'s elements' bit patterns, as integers (a change of any element changes it)."""
    if value.dtype.is_floating:
        integer = {2: tf.int16, 4: tf.int32, 8: tf.int64}[value.dtype.size]
        value = tf.bitcast(value, integer)
    return tf.reduce_sum(tf.cast(value, tf.int64))
