"""A custom step that never scales its loss: under mixed_float16 it would train nothing (its gradients,
divided by the loss scale, vanish), so the run refuses it before step 1 (trainer/task/precision.py).

Gin: `import tests.precision_steps`, then `train.step_fn = @unscaled_step`.
"""

from __future__ import annotations

import gin
import tensorflow as tf


@gin.configurable
def unscaled_step(model, optimizer, batch, global_batch_size):
    images, labels = batch
    with tf.GradientTape() as tape:
        logits = tf.cast(model(images, training=True), tf.float32)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(labels, tf.int32), logits=logits)
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return {"loss": loss}
