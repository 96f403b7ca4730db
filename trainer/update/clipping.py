"""`train.clip_global_norm`: clipping by the norm of the gradient the update actually applies.

Keras 3's `clipnorm`, `global_clipnorm` and `clipvalue` clip inside `apply_gradients` before
its cross-replica sum, so on N replicas they clip N partial gradients, not the update's
gradient (docs/design.md, rule 11: one SGD step on 1 and on 2 replicas differs by 4.9e-2). On more
than one replica they are refused (`check_keras_clipping`), pointing here.

Here the sum comes first, explicitly, in replica context
(`get_replica_context().all_reduce(SUM, grads)`: every replica then holds the whole update's
gradient), then `tf.clip_by_global_norm`, then the optimizer applies the clipped gradient
without summing it again. How that is done in Keras 3.15 (TensorFlow backend): every
cross-replica gradient sum goes through one method, `TFOptimizer._all_reduce_sum_gradients`,
called by `_backend_update_step` before the distributed update (`internals.skip_keras_gradient_sum`). Keras skips it only in
cross-replica context, and there its update cannot run (`maybe_merge_call` then calls
`get_replica_context().merge_call` on None: measured under MirroredStrategy and
CentralStorageStrategy on CPU). So `take_over_gradient_sum` replaces that method on the
run's optimizer instances with the identity: the loop owns the one sum. The user's step
never gets the real optimizer under this option (see trainer/update/accumulation.py), so no
other gradients reach it unsummed. An optimizer without that method (not a Keras 3 TF
optimizer) is refused rather than summed twice.
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
    """Makes each optimizer apply the gradients it is given without summing them across replicas.

    Only for gradients that `sum_and_clip` has already summed (see the module docstring).
    """
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
    """The gradients summed over all replicas and clipped to global norm `clip_norm`, in replica context.

    Returns the clipped gradients (None where a gradient is None) and the global norm before
    clipping (the same on every replica).
    """
    present = [g for g in gradients if g is not None]
    summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, present)
    clipped, norm = tf.clip_by_global_norm(summed, clip_norm)
    values = iter(clipped)
    return [None if g is None else next(values) for g in gradients], norm
