"""The embedded digits with a user's own augmentation (noise drawn from the example's stateless seed), for
tests/test_device_data.py. Gin: `import tests.noisy_digits`, `train.input_fn = @NoisyDigits()`."""

from __future__ import annotations

import dataclasses

import gin
import tensorflow as tf

from trainer import data


@gin.configurable
@dataclasses.dataclass(frozen=True)
class NoisyDigits(data.Digits):
    def augment(self, example, seed):
        image, label = example
        return image + 0.1 * tf.random.stateless_uniform(tf.shape(image), seed), label
