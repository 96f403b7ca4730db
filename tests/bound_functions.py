"""Gin-configurable functions whose bound parameters sit where a positional call would fill them,
for tests/test_gin_functions.py."""

import gin
import tensorflow as tf

from trainer.task.steps import call_model


@gin.configurable
def split_of(source, split):
    """An input function whose first parameter gin binds (`split_of.source = @digits()`)."""
    return source(split)


@gin.configurable
def weighted_loss_step(model, optimizer, loss_weight, batch, global_batch_size):
    """Cross-entropy times `loss_weight`, a bound parameter between the optimizer and the batch."""
    images, labels = batch[0], tf.cast(batch[1], tf.int32)
    with tf.GradientTape() as tape:
        logits = call_model(model, images, training=True)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits) * loss_weight
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    replicas = tf.distribute.get_replica_context().num_replicas_in_sync
    return {"loss": loss, "loss_weight": tf.constant(loss_weight, tf.float32) / replicas}


@gin.configurable
def mode_eval_step(model, batch, training=False):
    """The eval step evaluated in the mode gin binds; its third parameter is where `metrics` would go."""
    images, labels, weights = batch
    logits = call_model(model, images, training=training)
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(labels, tf.int32), logits)
    return {
        "loss": tf.reduce_sum(per_example * weights),
        "training": tf.reduce_sum(weights) * float(training),
        "num_examples": tf.reduce_sum(weights),
    }
