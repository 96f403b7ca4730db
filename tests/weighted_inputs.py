"""An input function of weighted examples `(x, y, sample_weight)`, for tests/test_parity.py and
tests/test_weighted_examples.py: the embedded digits, each example weighing 3 if its label is
divisible by 3, else 0.25 (weights that do not average 1, so a step that ignores them, or divides
by their sum, trains something else)."""

import gin
import tensorflow as tf

from trainer import data


@gin.configurable
def weighted_digits(split):
    return data.Digits()(split).map(lambda x, y: (x, y, tf.where(y % 3 == 0, 3.0, 0.25)))
