"""A train and an eval step that branch and loop on tensors in Python, as AutoGraph allows in any
tf.function: the loops trace without AutoGraph and must still convert the user's own code.

Each counts the batch's labels >= 5 twice, with a Python loop and `if` on tensors and with one
vectorised op, and returns both counts, so the test can check the loop ran on real values."""

import gin
import tensorflow as tf

from trainer.task import steps


def count_high(labels: tf.Tensor) -> tf.Tensor:
    """Labels >= 5, counted one by one: a `for` over a tensor range and an `if` on a tensor."""
    count = tf.constant(0.0)
    for i in tf.range(tf.shape(labels)[0]):
        if labels[i] >= 5:
            count += 1.0
    return count


@gin.configurable
def branching_step(model, optimizer, batch, global_batch_size):
    images, labels = batch[0], tf.cast(batch[1], tf.int32)
    with tf.GradientTape() as tape:
        logits = tf.cast(model(images, training=True), tf.float32)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    vectorised = tf.reduce_sum(tf.cast(labels >= 5, tf.float32))
    return {
        "loss": loss,
        "high": count_high(labels) / global_batch_size,
        "high_vectorised": vectorised / global_batch_size,
    }


@gin.configurable
def branching_eval_step(model, batch):
    images, labels, weights = batch
    labels = tf.cast(labels, tf.int32)
    outputs = steps.classification_eval_step(model, batch)
    high, i = tf.constant(0.0), tf.constant(0)
    while i < tf.shape(labels)[0]:  # a `while` on a tensor
        if weights[i] > 0 and labels[i] >= 5:
            high += 1.0
        i += 1
    return dict(outputs) | {"high": high, "high_vectorised": tf.reduce_sum(tf.cast(labels >= 5, tf.float32) * weights)}
