"""Models whose call makes losses (an activity regulariser, `add_loss`) next to BatchNormalization,
and a step that trains through `model.compute_loss`: what replica threads once mixed up
(trainer/task/layer_state.py, `separate_replica_losses`).

Gin: `import tests.replica_loss_models`, then `train.model_fn = @bn_activity_model` (with the built-in
`classification_step`) or `train.model_fn = @bn_dropout_add_loss_model` and
`train.step_fn = @compute_loss_step`.
"""

from __future__ import annotations

import gin
import keras
import tensorflow as tf

from trainer.task.steps import call_model


@gin.configurable
def bn_activity_model(input_shape, num_classes: int, synchronized: bool = False) -> keras.Model:
    """Conv -> BatchNorm -> ReLU -> Dense with an L2 activity penalty -> logits. `synchronized`: batch
    statistics over the global batch (an all-reduce inside the call), so 1 and 2 replicas compute alike."""
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Conv2D(8, 3),
            keras.layers.BatchNormalization(synchronized=synchronized),
            keras.layers.ReLU(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activity_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(num_classes),
        ]
    )


class BatchNormDropoutAddLoss(keras.Model):
    """A subclassed model: BatchNorm, Dropout, and a penalty on its hidden activations by `add_loss`."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(8, 3)
        self.norm = keras.layers.BatchNormalization()
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.dropout = keras.layers.Dropout(0.3)
        self.out = keras.layers.Dense(num_classes)

    def call(self, inputs, training=False):
        x = self.flatten(keras.activations.relu(self.norm(self.conv(inputs), training=training)))
        hidden = self.dropout(self.hidden(x), training=training)
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(hidden)))
        return self.out(hidden)


@gin.configurable
def bn_dropout_add_loss_model(input_shape, num_classes: int) -> keras.Model:
    model = BatchNormDropoutAddLoss(num_classes)
    model(keras.ops.zeros((1, *input_shape)))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@gin.configurable
def compute_loss_step(model, optimizer, batch, global_batch_size):
    """The loss as Keras computes it: the compiled loss (divided by the replica count under a strategy)
    plus `model.losses` (likewise), gradients through `optimizer.scale_loss`."""
    images, labels = batch[0], tf.cast(batch[1], tf.int32)
    with tf.GradientTape() as tape:
        logits = call_model(model, images, training=True)
        loss = model.compute_loss(x=images, y=labels, y_pred=logits)
        scaled = optimizer.scale_loss(loss)
    variables = model.trainable_variables
    optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
    return {"loss": loss}
