"""A step with a data-dependent loss term, as reconstruction losses have: a NaN input makes
the loss NaN (the CNN alone may not show it: oneDNN's fused conv+relu kernels turn NaN into 0)."""

import gin
import tensorflow as tf

from trainer.task import steps


@gin.configurable
def input_energy_step(model, optimizer, batch, global_batch_size, weight=1e-3):
    images, labels = batch
    labels = tf.cast(labels, tf.int32)
    with tf.GradientTape() as tape:
        logits = tf.cast(model(images, training=True), tf.float32)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        per_example += weight * tf.reduce_mean(tf.square(images), axis=[1, 2, 3])
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        loss += steps.regularization_loss(model)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return {"loss": loss}


@gin.configurable
def weight_poisoning_step(model, optimizer, batch, global_batch_size, at_step=10):
    """The classification step, which then sets the first kernel to NaN after update `at_step`:
    weights that go non-finite by another way than the gradient. Made the last step of a loop call,
    no forward pass uses the NaN kernel before the call's end, so every output and gradient of the
    call is finite on any CPU (a NaN kernel used in a later step may or may not reach the loss,
    depending on how a CPU's fused conv+ReLU treats NaN)."""
    outputs = steps.classification_step(model, optimizer, batch, global_batch_size)
    kernel = model.trainable_variables[0]
    kernel.assign(tf.where(optimizer.iterations == at_step, tf.fill(tf.shape(kernel), float("nan")), kernel))
    return outputs
