"""Step functions with the classic loss-scaling mistakes, for the guard and parity tests.

A gin config reaches them with `import tests.guard_steps` and `train.step_fn = @name`.
Each is `classification_step` with one thing changed.
"""

from __future__ import annotations

import gin
import keras
import tensorflow as tf

from trainer.task.steps import call_model, regularization_loss


def _train(model, optimizer, images, labels, loss_fn, *, gradient_scale: float = 1.0):
    with tf.GradientTape() as tape:
        logits = tf.cast(call_model(model, images, training=True), tf.float32)
        loss = loss_fn(logits)
    variables = model.trainable_variables
    gradients = [g * gradient_scale for g in tape.gradient(loss, variables)]
    optimizer.apply_gradients(zip(gradients, variables))
    return loss


def _batch(batch):
    return batch[0], tf.cast(batch[1], tf.int32)


@gin.configurable
def per_replica_mean_step(model, optimizer, batch, global_batch_size):
    """Mistake: the mean over this replica's examples (N times the global-batch share)."""
    images, labels = _batch(batch)

    def loss_fn(logits):
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        return tf.reduce_mean(per_example) + regularization_loss(model)

    return {"loss": _train(model, optimizer, images, labels, loss_fn)}


@gin.configurable
def keras_loss_scaled_by_hand_step(model, optimizer, batch, global_batch_size):
    """Mistake: a default-reduction Keras 3 loss (already / N under a strategy) scaled to the global batch."""
    images, labels = _batch(batch)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_fn(logits):
        share = tf.cast(tf.shape(labels)[0], tf.float32) / global_batch_size
        return loss_object(labels, logits) * share + regularization_loss(model)

    return {"loss": _train(model, optimizer, images, labels, loss_fn)}


@gin.configurable
def unscaled_regularization_step(model, optimizer, batch, global_batch_size):
    """Mistake: model.losses added on every replica without scale_regularization_loss."""
    images, labels = _batch(batch)

    def loss_fn(logits):
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        return loss + tf.add_n(model.losses)

    return {"loss": _train(model, optimizer, images, labels, loss_fn)}


@gin.configurable
def double_learning_rate_step(model, optimizer, batch, global_batch_size):
    """Correctly scaled, but every update is twice as large: what the guard cannot see and parity can."""
    images, labels = _batch(batch)

    def loss_fn(logits):
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        return tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size) + regularization_loss(model)

    return {"loss": _train(model, optimizer, images, labels, loss_fn, gradient_scale=2.0)}


@gin.configurable
def contrastive_mean_step(model, optimizer, batch, global_batch_size):
    """experiments/contrastive's step (negatives gathered across replicas) with its loss a per-replica
    mean: it depends on other replicas' examples and is mis-scaled as well."""
    from experiments.contrastive.contrastive import supervised_contrastive

    images, labels = _batch(batch)
    context = tf.distribute.get_replica_context()
    with tf.GradientTape() as tape:
        z = tf.math.l2_normalize(call_model(model, images, training=True), axis=-1)
        z_all, labels_all = context.all_gather(z, axis=0), context.all_gather(labels, axis=0)
        offset = tf.cast(context.replica_id_in_sync_group, tf.int32) * tf.shape(z)[0]
        loss = tf.reduce_mean(supervised_contrastive(z, labels, z_all, labels_all, offset, 0.1))
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return {"loss": loss}


@gin.configurable
def step_without_update(model, optimizer, batch, global_batch_size):
    """Computes the loss and its gradients, and never applies them."""
    with tf.GradientTape() as tape:
        logits = model(batch[0], training=True)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(batch[1], tf.int32), logits=logits)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
    tape.gradient(loss, model.trainable_variables)
    return {"loss": loss}
