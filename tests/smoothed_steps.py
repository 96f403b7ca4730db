"""A gin-configurable step with a parameter of its own, for tests/test_gin_functions.py."""

import gin
import tensorflow as tf

from trainer.task.steps import call_model


@gin.configurable
def smoothed_step(model, optimizer, batch, global_batch_size, smoothing=0.0):
    """Cross-entropy with label smoothing (`smoothing` is what gin binds)."""
    images, labels = batch[0], tf.cast(batch[1], tf.int32)
    with tf.GradientTape() as tape:
        logits = call_model(model, images, training=True)
        targets = tf.one_hot(labels, 10) * (1 - smoothing) + smoothing / 10
        per_example = tf.nn.softmax_cross_entropy_with_logits(targets, logits)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
    optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return {"loss": loss}
