"""Models that have no variables until their first call, as most research code writes them."""

from __future__ import annotations

import gin
import keras


class ResidualMLP(keras.Model):
    """Sublayers made in __init__, used in call: `build(shape)` would create none of their variables."""

    def __init__(self, num_classes: int, width: int = 32, **kwargs):
        super().__init__(name="residual_mlp", **kwargs)
        self.flatten = keras.layers.Flatten()
        self.dense = keras.layers.Dense(width, activation="relu")
        self.hidden = keras.layers.Dense(width, activation="relu")
        self.dropout = keras.layers.Dropout(0.2)
        self.out = keras.layers.Dense(num_classes)

    def call(self, inputs, training=False):
        x = self.dense(self.flatten(inputs))
        x = x + self.hidden(x)
        return self.out(self.dropout(x, training=training))


@gin.configurable
def residual_mlp(num_classes: int) -> keras.Model:
    return ResidualMLP(num_classes)


@gin.configurable
def sequential_without_input(num_classes: int) -> keras.Model:
    return keras.Sequential(
        [keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(num_classes)]
    )


@gin.configurable
def weightless(num_classes: int) -> keras.Model:
    return keras.Sequential([keras.layers.Flatten()])


@gin.configurable
def noise_generator(num_classes: int) -> keras.Model:
    """Takes a (batch, 3) noise vector, not the digits: a call on the train features cannot build it."""
    return keras.Sequential([keras.layers.Reshape((3,)), keras.layers.Dense(num_classes)])
