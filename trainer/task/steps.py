"""The researcher's extension point: train and eval step functions, run in replica context.

Contract (docs/design.md): `step_fn(model, optimizer, batch, global_batch_size) -> {name: scalar}`,
each value this replica's share of a global-batch mean, so SUM across replicas is the global
value. Losses are per example, averaged with the *global* batch size; regularisation losses
are divided by the replica count. Gradients are taken of `scale_loss(optimizer, loss)`, which
is the loss itself unless mixed_float16 loss scaling is on (see trainer/precision.py).
Eval steps return per-replica SUMS over the batch plus `num_examples`; the loop sums over
replicas and batches and divides by `num_examples`, or an output `x` by `x/denominator` where the
step returns one (a weighted mean).
"""

from __future__ import annotations

from typing import Mapping

import keras
import tensorflow as tf

from trainer.task import contract


@tf.autograph.experimental.do_not_convert  # plain TF ops (trainer/task/user_code.py)
def call_model(model, inputs: tf.Tensor, *, training: bool) -> tf.Tensor:
    """Calls a Keras model with `training`, a plain `tf.Module` without it."""
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
    """The loss to take gradients of: `loss` times the optimizer's loss scale, if it has one.

    Under `mixed_float16` the optimizer is a `LossScaleOptimizer`, whose `apply_gradients`
    divides the gradients by the same scale (and skips steps with non-finite gradients);
    without loss scaling this returns `loss` unchanged. A custom step does the same:
    gradients of `scale_loss(optimizer, loss)`, the unscaled `loss` in its outputs.
    """
    scale = getattr(optimizer, "scale_loss", None)
    return scale(loss) if scale is not None else loss


def _sample_weight(batch, index: int) -> tf.Tensor | None:
    """The `(x, y, sample_weight)` example's weight at `index` of the batch, one per example (None
    for `(x, y)` examples)."""
    if len(batch) <= index:
        return None
    return tf.reshape(tf.cast(batch[index], tf.float32), [-1])


@tf.autograph.experimental.do_not_convert
def classification_step(model, optimizer, batch, global_batch_size: int) -> Mapping[str, tf.Tensor]:
    """One SGD step of softmax cross-entropy on integer labels; returns loss and accuracy.

    `batch` is `(x, y)` or, with weighted examples, `(x, y, sample_weight)`: the loss is then
    sum(loss_i * w_i) / global batch size, as Keras `fit` weights it (its `sum_over_batch_size`),
    and the accuracy sum(correct_i * w_i) / global batch size (the weighted accuracy when the
    weights average 1; the eval step reports the exact weighted accuracy).
    """
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
    if weights is not None:
        correct *= weights
    return {"loss": loss, "accuracy": tf.reduce_sum(correct) / global_batch_size}


@tf.autograph.experimental.do_not_convert
def classification_eval_step(model, batch) -> Mapping[str, tf.Tensor]:
    """Sums of loss and correct predictions over the (weighted) examples of this replica's batch.

    `batch` is the example with the loop's weight appended: (images, labels, weights), padding
    examples weighing 0 and counting nowhere; or, for `(x, y, sample_weight)` examples,
    (images, labels, sample_weight, weights). A weighted example counts as Keras' `evaluate`
    counts it: the loss is sum(loss_i * w_i) / number of examples, the accuracy the weighted
    accuracy sum(correct_i * w_i) / sum(w_i) (Keras' `weighted_metrics`), through the
    `accuracy/denominator` output the loop divides it by (trainer/loops/evaluator.py).
    """
    images, labels, weights = batch[0], batch[1], tf.cast(batch[-1], tf.float32)
    sample_weight = _sample_weight(batch, 2) if len(batch) > 3 else None
    weighted = weights if sample_weight is None else weights * sample_weight
    labels = tf.cast(labels, tf.int32)
    logits = tf.cast(call_model(model, images, training=False), tf.float32)
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
    sums = {
        "loss": tf.reduce_sum(per_example * weighted),
        "accuracy": tf.reduce_sum(correct * weighted),
        "num_examples": tf.reduce_sum(weights),
    }
    if sample_weight is not None:
        sums["accuracy" + contract.DENOMINATOR] = tf.reduce_sum(weighted)
    return sums
