"""A CNN with BatchNormalization on the 8x8 digits, trained by the default classification steps.

Those steps call the model with `training=True` (normalise by the batch's statistics, update
the moving mean and variance) and `training=False` in eval (normalise by the moving
statistics). The moving statistics are non-trainable model variables, created under the
scope with the model, so they are in every checkpoint and an evaluation restored from one
sees exactly what the run's own eval saw.

`momentum` is 0.9 here, not Keras' 0.99: the moving variance starts at 1 and after n steps
still holds 0.99**n of it (5% after 300 steps, several times the true variance of these
activations), so a short run evaluated at 0.99 normalises by stale statistics and predicts
one class (7.5% eval accuracy against 94% in training, measured); at 0.9 the start is
forgotten after a few dozen steps.

`synchronized` (on by default here) makes Keras compute the batch statistics over the GLOBAL
batch (an all-reduce across replicas). Without it each replica normalises by its own share
of the batch, and, the moving statistics being mirrored variables with aggregation NONE,
each replica also updates its own copy from its own share: the copies drift apart, the
checkpoint keeps replica 0's, and a 2-replica eval normalises half the examples with
replica 1's. With it every replica applies the same update and the copies stay equal.

Gin (experiments/batchnorm/batchnorm.gin): `import experiments.batchnorm.batchnorm`,
`train.model_fn = @batchnorm_cnn`.
"""

from __future__ import annotations

from typing import Sequence

import gin
import keras


@gin.configurable
def batchnorm_cnn(
    input_shape: Sequence[int],
    num_classes: int,
    filters: Sequence[int] = (16, 32),
    momentum: float = 0.9,
    synchronized: bool = True,
) -> keras.Model:
    """Conv -> BatchNorm -> ReLU blocks, global average pooling, a linear classifier (logits)."""
    layers = [keras.Input(tuple(input_shape))]
    for width in filters:
        layers += [
            keras.layers.Conv2D(width, 3, padding="same", use_bias=False),  # BatchNorm's beta is the bias
            keras.layers.BatchNormalization(momentum=momentum, synchronized=synchronized),
            keras.layers.ReLU(),
        ]
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(num_classes)]
    return keras.Sequential(layers, name="batchnorm_cnn")
