"""The built-in train and eval steps, run in replica context (the contract: docs/design.md).

A train step returns this replica's share of each global-batch mean (losses averaged with the *global*
batch size, regularisation divided by the replica count), so the SUM across replicas is the global value.
An eval step returns per-replica SUMS plus `num_examples` (or `x/denominator`), which the loop divides by.
"""

from __future__ import annotations

from typing import Mapping

import keras
import tensorflow as tf

from trainer.errors import UserError
from trainer.task import contract


@tf.autograph.experimental.do_not_convert  # plain TF ops (trainer/task/user_code.py)
def call_model(model, inputs: tf.Tensor, *, training: bool) -> tf.Tensor:
    if isinstance(model, keras.layers.Layer):
        return model(inputs, training=training)
    return model(inputs)


@tf.autograph.experimental.do_not_convert
def regularization_loss(model) -> tf.Tensor:
    """This replica's share of the model's regularisation losses (sum over replicas = total)."""
    losses = list(getattr(model, "losses", []))
    if not losses:
        return tf.constant(0.0)
    return tf.nn.scale_regularization_loss(tf.add_n([tf.cast(loss, tf.float32) for loss in losses]))


@tf.autograph.experimental.do_not_convert
def scale_loss(optimizer, loss: tf.Tensor) -> tf.Tensor:
    """The loss to take gradients of: times the optimizer's loss scale under mixed_float16 (trainer/task/precision.py)."""
    scale = getattr(optimizer, "scale_loss", None)
    return scale(loss) if scale is not None else loss


def check_examples(element_spec, *, input_named: str, step_fn, eval_step_fn) -> None:
    """Refuses examples the built-in steps would misread, in one line: one with no label (a dict alone) and a
    third element that is no sample weight (an example id would weigh its example: accuracies above 1)."""
    used = [
        f"train.{name} = @{fn.__name__}"
        for name, fn in (("step_fn", step_fn), ("eval_step_fn", eval_step_fn))
        if fn in (classification_step, classification_eval_step)
    ]
    if not used:
        return  # the user's own steps read their examples their own way
    steps = " and ".join(used)
    if not isinstance(element_spec, tuple) or len(element_spec) not in (2, 3):
        shape = type(element_spec).__name__ if not isinstance(element_spec, tuple) else f"{len(element_spec)}-tuple"
        keys = f" (keys {', '.join(map(str, element_spec))})" if isinstance(element_spec, dict) else ""
        raise UserError(
            f"{input_named} yields {shape} examples{keys}; the built-in steps ({steps}) take "
            "(features, label) or (features, label, sample_weight): yield the label apart, e.g. "
            "(features_dict, label), or bind a step of your own"
        )
    if len(element_spec) == 3:
        weight = element_spec[2]
        is_float = isinstance(weight, tf.TensorSpec) and weight.dtype.is_floating
        if not is_float or weight.shape.rank not in (0, None) and weight.shape.num_elements() != 1:
            what = f"{weight.dtype.name} {weight.shape}" if isinstance(weight, tf.TensorSpec) else type(weight).__name__
            raise UserError(
                f"{input_named} yields a third element of {what}, which the built-in steps "
                f"({steps}) take as the sample weight: one float per example; an example id or other data goes "
                "into the features, a dict as the first element ((dict(image=x, id=example_id), y)); cast a weight "
                "to float"
            )


def _sample_weight(batch, index: int) -> tf.Tensor | None:
    """The weight at `index` of `(x, y, sample_weight)` batches, one per example (None for `(x, y)`)."""
    if len(batch) <= index:
        return None
    return tf.reshape(tf.cast(batch[index], tf.float32), [-1])


@tf.autograph.experimental.do_not_convert
def classification_step(model, optimizer, batch, global_batch_size: int) -> Mapping[str, tf.Tensor]:
    """One step of softmax cross-entropy on integer labels. With `(x, y, sample_weight)` examples, the loss is
    sum(loss_i * w_i) / global batch size and the accuracy sum(correct_i * w_i) / sum(w_i) over the global batch,
    as Keras `fit` weights them (a weighted metric is normalised by the weights: no accuracy passes 1)."""
    images, labels = batch[0], batch[1]
    labels = tf.cast(labels, tf.int32)
    weights = _sample_weight(batch, 2)
    with tf.GradientTape() as tape:
        logits = tf.cast(call_model(model, images, training=True), tf.float32)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        loss = tf.nn.compute_average_loss(per_example, sample_weight=weights, global_batch_size=global_batch_size)
        loss += regularization_loss(model)
        scaled = scale_loss(optimizer, loss)
    variables = model.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
    if weights is None:
        return {"loss": loss, "accuracy": tf.reduce_sum(correct) / global_batch_size}
    # This replica's share of the global batch's weighted accuracy: its weighted sum over all replicas' weights.
    # One replica (one device, or a parameter-server worker, whose step no replica context spans) holds them all.
    all_weights = tf.reduce_sum(weights)
    context = tf.distribute.get_replica_context()
    if context.num_replicas_in_sync > 1:
        all_weights = context.all_reduce(tf.distribute.ReduceOp.SUM, all_weights)
    return {"loss": loss, "accuracy": tf.math.divide_no_nan(tf.reduce_sum(correct * weights), all_weights)}


@tf.autograph.experimental.do_not_convert
def classification_eval_step(model, batch) -> Mapping[str, tf.Tensor]:
    """Sums of loss and correct predictions over this replica's batch, the loop's weight last (padding weighs
    0 and is selected out: `weighted_sum`). With sample weights, as Keras' `evaluate`: loss sum(loss_i * w_i) / examples, accuracy
    sum(correct_i * w_i) / sum(w_i) through `accuracy/denominator`."""
    images, labels, weights = batch[0], batch[1], tf.cast(batch[-1], tf.float32)
    sample_weight = _sample_weight(batch, 2) if len(batch) > 3 else None
    weighted = weights if sample_weight is None else weights * sample_weight
    labels = tf.cast(labels, tf.int32)
    logits = tf.cast(call_model(model, images, training=False), tf.float32)
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
    sums = {
        "loss": weighted_sum(per_example, weighted),
        "accuracy": weighted_sum(correct, weighted),
        "num_examples": tf.reduce_sum(weights),
    }
    if sample_weight is not None:
        sums["accuracy" + contract.DENOMINATOR] = tf.reduce_sum(weighted)
    return sums


@tf.autograph.experimental.do_not_convert
def weighted_sum(values: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """sum(values_i * weights_i) over the rows of weight above 0, for an eval step's sums. A select, not a
    multiply: a padded row (weight 0) adds nothing even where the model is NaN or inf on it (0 * NaN is NaN)."""
    values = tf.cast(values, tf.float32)
    return tf.reduce_sum(tf.where(weights > 0, values * weights, tf.zeros_like(values)))
