"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, its train step ported as written.

The tutorial creates the model, the optimizer and `train_accuracy` under `strategy.scope()`, computes the
loss with `tf.nn.compute_average_loss` (and `scale_regularization_loss` for `model.losses`), updates
`train_accuracy` in the step, prints `train_accuracy.result()` and resets it each epoch. Here the model
function creates the metric with the model (it runs under the scope), the step is the tutorial's line for
line with the model and optimizer as arguments, and the loop reads and resets the metric
(`train.train_metrics_reset`, trainer/extensions/train_metrics.py): `train_accuracy` in metrics.jsonl, on
TensorBoard and on the console is the metric's `result()`, the one-device value on any number of replicas.
"""

from __future__ import annotations

import gin
import keras
import tensorflow as tf

# The tutorial's loss object: per-example losses, averaged over the global batch by compute_average_loss.
loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def compute_loss(labels, predictions, model_losses):
    per_example_loss = loss_object(labels, predictions)
    loss = tf.nn.compute_average_loss(per_example_loss)
    if model_losses:
        loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
    return loss


@gin.configurable
def create_model(input_shape, num_classes, l2: float = 1e-5):
    """The tutorial's CNN, and its `train_accuracy` metric held by the model."""
    regularizer = keras.regularizers.L2(l2)
    model = keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=regularizer),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu", kernel_regularizer=regularizer),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu", kernel_regularizer=regularizer),
            keras.layers.Dense(num_classes, kernel_regularizer=regularizer),
        ]
    )
    model.train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    return model


@gin.configurable
def train_step(model, optimizer, inputs, global_batch_size):
    """The tutorial's `train_step(inputs)`; it returns its loss as a dict."""
    images, labels = inputs

    with tf.GradientTape() as tape:
        predictions = model(images, training=True)
        loss = compute_loss(labels, predictions, model.losses)

    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    model.train_accuracy.update_state(labels, predictions)
    return {"loss": loss}
