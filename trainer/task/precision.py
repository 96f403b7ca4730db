"""Mixed precision as one gin option: `train.mixed_precision = 'mixed_bfloat16' | 'mixed_float16'`.

The Keras dtype policy is global and read by each layer when it is created, so it is set
before the model is built and put back when the run returns (`keeps_global_policy`).
Variables stay float32; layers compute in bfloat16 or float16; the default step casts
logits to float32 before the loss.

`mixed_float16` needs loss scaling (float16 gradients underflow): the optimizer is wrapped
in `keras.optimizers.LossScaleOptimizer`, and the step computes its gradients from
`optimizer.scale_loss(loss)`; `apply_gradients` divides them by the same scale, skips a
step whose gradients are not finite and adapts the scale (halved on overflow, doubled
after `dynamic_growth_steps` finite steps). `mixed_bfloat16` has float32's range and
needs no scaling. A custom step must do the same as `steps.classification_step`:

    with tf.GradientTape() as tape:
        loss = ...                                   # this replica's share, as always
        scaled = optimizer.scale_loss(loss)          # identity unless loss scaling is on
    grads = tape.gradient(scaled, variables)
    optimizer.apply_gradients(zip(grads, variables))  # unscales, skips non-finite steps
    return {"loss": loss, ...}                       # the unscaled loss
"""
from __future__ import annotations

import functools
import inspect

import keras

from trainer.errors import UserError

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


def check(name: str | None) -> str:
    """The policy name to use (None means float32); UserError for an unknown one."""
    name = name or "float32"
    if name not in POLICIES:
        raise UserError(f"unknown train.mixed_precision {name!r}: use one of {', '.join(repr(p) for p in POLICIES)} "
                        "(or None)")
    return name


def set_global_policy(name: str | None) -> str:
    """Sets the Keras global dtype policy that layers created from now on use."""
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


def wrap_optimizer(optimizer, name: str | None):
    """`optimizer` in a dynamic LossScaleOptimizer under mixed_float16 (unless it is one already)."""
    if check(name) == "mixed_float16" and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
