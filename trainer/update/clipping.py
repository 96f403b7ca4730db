"""`train.clip_global_norm`: clipping by the norm of the gradient the update actually applies.

Keras 3's `clipnorm`, `global_clipnorm` and `clipvalue` clip inside `apply_gradients` before its
cross-replica sum, so on N replicas they clip N partial gradients (docs/design.md, rule 11); there they are
refused (`check_keras_clipping`). Here the sum comes first, in replica context (`all_reduce(SUM)`), then
`tf.clip_by_global_norm`, then the optimizer applies without summing again. In Keras 3.15 (TF backend) every
cross-replica gradient sum goes through `TFOptimizer._all_reduce_sum_gradients`, skipped only in
cross-replica context, where the update cannot run (`merge_call` on None: measured under Mirrored and
CentralStorage). So `take_over_gradient_sum` replaces it (`internals.skip_keras_gradient_sum`) with the identity; the user's
step never gets the real optimizer under this option, and an optimizer without that method is refused.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from trainer import internals
from trainer.errors import UserError
from trainer.task.structure import flat

KERAS_CLIPPING = ("clipnorm", "global_clipnorm", "clipvalue")


def _inner(optimizer):
    """The optimizer a LossScaleOptimizer wraps (it carries the clipping settings), else itself."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def check_keras_clipping(optimizers: Any, num_replicas: int, clip_global_norm: float | None) -> None:
    """Refuses Keras' own clipping where it clips per replica, or on top of `train.clip_global_norm`."""
    for optimizer in flat(optimizers):
        for name in KERAS_CLIPPING:
            value = getattr(_inner(optimizer), name, None)
            if not value:
                continue
            if clip_global_norm is not None:
                raise UserError(
                    f"the optimizer has Keras' {name}={value} and train.clip_global_norm = "
                    f"{clip_global_norm} is set too: clip once; remove {name} from train.optimizer_fn"
                )
            if num_replicas > 1:
                raise UserError(
                    f"the optimizer has Keras' {name}={value}, which clips each replica's gradients before the "
                    f"cross-replica sum, so on {num_replicas} replicas it clips something else than the update's "
                    f"gradient (docs/design.md, rule 11); remove it from train.optimizer_fn and set "
                    f"train.clip_global_norm = {value} (the global norm after the sum)"
                )


def take_over_gradient_sum(optimizers: Any) -> None:
    """Makes each optimizer apply the gradients (`sum_and_clip` summed) without summing them across replicas."""
    for optimizer in flat(optimizers):
        inner = _inner(optimizer)
        if inner is not optimizer:
            raise UserError(
                "train.clip_global_norm does not work with mixed_float16 loss scaling (the gradients are "
                "scaled when clipped); use mixed_precision 'mixed_bfloat16' or no mixed precision"
            )
        if not internals.skip_keras_gradient_sum(optimizer):
            raise UserError(
                f"train.clip_global_norm needs Keras 3 optimizers (TensorFlow backend), got "
                f"{type(optimizer).__name__}, whose cross-replica gradient sum the loop cannot take over"
            )


def sum_and_clip(gradients: Sequence[tf.Tensor | None], clip_norm: float) -> tuple[list, tf.Tensor]:
    """The gradients summed over all replicas and clipped to global norm `clip_norm` (None kept), and the norm
    before clipping (the same on every replica)."""
    present = [g for g in gradients if g is not None]
    summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, present)
    clipped, norm = tf.clip_by_global_norm(summed, clip_norm)
    values = iter(clipped)
    return [None if g is None else next(values) for g in gradients], norm
