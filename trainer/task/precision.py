"""Mixed precision as one gin option: `train.mixed_precision = 'mixed_bfloat16' | 'mixed_float16'`.

The Keras dtype policy is global and read by each layer when it is created, so it is set before the model
is built and put back when the run returns (`keeps_global_policy`). `mixed_float16` needs loss scaling
(float16 gradients underflow): the optimizer is wrapped in a `keras.optimizers.LossScaleOptimizer`, whose
`apply_gradients` divides the gradients of `optimizer.scale_loss(loss)` by the scale, skips non-finite steps
and adapts the scale. Every Keras 3 optimizer has `scale_loss`, so a step written this way runs in every
precision:

    with tf.GradientTape() as tape:
        logits = tf.cast(model(x, training=True), tf.float32)  # float16/bfloat16 under mixed precision
        loss = ...                                   # this replica's share, as always
        scaled = optimizer.scale_loss(loss)          # loss * scale under mixed_float16, else loss
    grads = tape.gradient(scaled, variables)
    optimizer.apply_gradients(zip(grads, variables))  # unscales, skips non-finite steps
    return {"loss": loss, ...}                       # the unscaled loss

A step that skips `scale_loss` would silently apply gradients 32768 times too small (measured: SGD stayed
at chance), so `ScaleCheckedLossScaleOptimizer` refuses an update whose thread never called `scale_loss`:
the loops trace the step before step 1, so such a step stops there with one error line.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref

import keras

from trainer.errors import UserError

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


def check(name: str | None) -> str:
    name = name or "float32"
    if name not in POLICIES:
        raise UserError(
            f"unknown train.mixed_precision {name!r}: use one of {', '.join(repr(p) for p in POLICIES)} (or None)"
        )
    return name


def set_global_policy(name: str | None) -> str:
    name = check(name)
    keras.mixed_precision.set_global_policy(name)
    return name


def keeps_global_policy(fn):
    """Decorator: whatever `fn` sets, the global dtype policy is as before when it returns."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        previous = keras.mixed_precision.global_policy()
        try:
            return fn(*args, **kwargs)
        finally:
            keras.mixed_precision.set_global_policy(previous)

    wrapper.__signature__ = inspect.signature(fn)  # gin reads the parameters with getfullargspec
    return wrapper


UNSCALED_MESSAGE = (
    "train.mixed_precision = 'mixed_float16': the step applies gradients of a loss it never passed through "
    "optimizer.scale_loss, so the loss-scale optimizer divides them by its scale (32768 at first): SGD trains "
    "nothing, and small float16 gradients underflow to zero; take the gradients of the scaled loss: "
    "scaled = optimizer.scale_loss(loss) inside the tape, grads = tape.gradient(scaled, variables), "
    "optimizer.apply_gradients(zip(grads, variables)), and return the unscaled loss (scale_loss is the loss "
    "itself in float32 and mixed_bfloat16)"
)

_scaled_by_thread = threading.local()  # the optimizers whose scale_loss this thread called


def _scaled_here() -> weakref.WeakSet:
    if not hasattr(_scaled_by_thread, "optimizers"):
        _scaled_by_thread.optimizers = weakref.WeakSet()
    return _scaled_by_thread.optimizers


@functools.cache
def scale_checked_class() -> type:
    """ScaleCheckedLossScaleOptimizer, defined at first use: under tf_keras (the parity tool's fit) there is
    no `keras.optimizers.LossScaleOptimizer` to derive from."""

    @keras.saving.register_keras_serializable(package="trainer")
    class ScaleCheckedLossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
        """Keras' dynamic LossScaleOptimizer refusing an update in a thread (each replica runs in its own) that
        never called its `scale_loss`; once it has, any number of updates (several variable groups)."""

        def scale_loss(self, loss):
            _scaled_here().add(self)
            return super().scale_loss(loss)

        def apply(self, grads, trainable_variables=None):
            if self not in _scaled_here():
                raise UserError(UNSCALED_MESSAGE)
            return super().apply(grads, trainable_variables)

    return ScaleCheckedLossScaleOptimizer


def wrap_optimizer(optimizer, name: str | None):
    """`optimizer` in a dynamic ScaleCheckedLossScaleOptimizer under mixed_float16 (unless it is a
    LossScaleOptimizer already)."""
    if check(name) == "mixed_float16" and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return scale_checked_class()(optimizer)
    return optimizer
