"""The researcher's extension point: train and eval step functions, run in replica context.

Contract (docs/design.md): `step_fn(model, optimizer, batch, global_batch_size) -> {name: scalar}`,
each value this replica's share of a global-batch mean, so SUM across replicas is the global
value. Losses are per example, averaged with the *global* batch size; regularisation losses
are divided by the replica count. Gradients are taken of `scale_loss(optimizer, loss)`, which
is the loss itself unless mixed_float16 loss scaling is on (see trainer/precision.py).
Eval steps return per-replica SUMS over the batch plus `num_examples`; the loop sums over
replicas and batches and divides by `num_examples`.
"""
from __future__ import annotations

from typing import Mapping

import keras
import tensorflow as tf


@tf.autograph.experimental.do_not_convert  # plain TF ops (trainer/task/user_code.py)
def call_model(model, inputs: tf.Tensor, *, training: bool) -> tf.Tensor:
    """Calls a Keras model with `training`, a plain `tf.Module` without it."""
    if isinstance(model, keras.Layer):
        return model(inputs, training=training)
    return model(inputs)


@tf.autograph.experimental.do_not_convert
def regularization_loss(model) -> tf.Tensor:
    """This replica's share of the model's regularisation losses (sum over replicas = total)."""
    losses = list(getattr(model, "losses", []))
    if not losses:
        return tf.constant(0.0)
    return tf.nn.scale_regularization_loss(tf.add_n([tf.cast(l, tf.float32) for l in losses]))


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


@tf.autograph.experimental.do_not_convert
def classification_step(model, optimizer, batch, global_batch_size: int) -> Mapping[str, tf.Tensor]:
    """One SGD step of softmax cross-entropy on integer labels; returns loss and accuracy."""
    images, labels = batch[0], batch[1]
    labels = tf.cast(labels, tf.int32)
    with tf.GradientTape() as tape:
        logits = tf.cast(call_model(model, images, training=True), tf.float32)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss += regularization_loss(model)
        scaled = scale_loss(optimizer, loss)
    variables = model.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
    return {"loss": loss, "accuracy": tf.reduce_sum(correct) / global_batch_size}


@tf.autograph.experimental.do_not_convert
def classification_eval_step(model, batch) -> Mapping[str, tf.Tensor]:
    """Sums of loss and correct predictions over the (weighted) examples of this replica's batch.

    `batch` is (images, labels, weights); padding examples have weight 0 and count nowhere.
    """
    images, labels, weights = batch
    labels = tf.cast(labels, tf.int32)
    logits = tf.cast(call_model(model, images, training=False), tf.float32)
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
    return {
        "loss": tf.reduce_sum(per_example * weights),
        "accuracy": tf.reduce_sum(correct * weights),
        "num_examples": tf.reduce_sum(weights),
    }
