"""A plain tf.Module model for the tests (variable sharding works only for tf.Module models).

Gin: `import tests.module_model` then `train.model_fn = @module_mlp`.
"""

from __future__ import annotations

import math

import gin
import tensorflow as tf


class ModuleMLP(tf.Module):
    """Flatten -> Dense relu -> Dense logits, with its own variables (no Keras layers)."""

    def __init__(self, input_size: int, hidden: int, num_classes: int, seed: int = 0):
        super().__init__(name="module_mlp")
        init = lambda shape, s: tf.random.stateless_uniform(  # noqa: E731  (Glorot uniform)
            shape, seed=[seed, s], minval=-math.sqrt(6 / sum(shape)), maxval=math.sqrt(6 / sum(shape))
        )
        self.w1 = tf.Variable(init([input_size, hidden], 1), name="w1")
        self.b1 = tf.Variable(tf.zeros([hidden]), name="b1")
        self.w2 = tf.Variable(init([hidden, num_classes], 2), name="w2")
        self.b2 = tf.Variable(tf.zeros([num_classes]), name="b2")

    def __call__(self, images: tf.Tensor) -> tf.Tensor:
        x = tf.reshape(images, [tf.shape(images)[0], -1])
        x = tf.nn.relu(tf.matmul(x, self.w1) + self.b1)
        return tf.matmul(x, self.w2) + self.b2


@gin.configurable
def module_mlp(input_shape, num_classes, hidden: int = 64, seed: int = 0) -> ModuleMLP:
    return ModuleMLP(math.prod(input_shape), hidden, num_classes, seed)
