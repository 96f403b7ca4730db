"""A text classifier that is NaN on an all-zero sequence, as every `Embedding(mask_zero=True)` +
`GlobalAveragePooling1D` model is (the masked mean of no tokens is 0/0), and its data: token ids of fixed
length 8, zeros after each sequence's end, and `(x, y, sample_weight)` examples. Eval example 3 is all zeros,
weighing `zero_weight` (0: the eval loss is that of the other 9 examples; 1: it is NaN), so the select of the
built-in eval step is tested on a real example as well as on the loop's padding.

Gin: `import tests.masked_mean_text`, `train.input_fn = @token_ids`, `train.model_fn = @masked_mean_classifier`,
`train.optimizer_fn = @frozen` (learning rate 0: every run evaluates its initial weights).
"""

from __future__ import annotations

import gin
import keras
import numpy as np
import tensorflow as tf

LENGTH, VOCAB, NUM_TRAIN, NUM_EVAL = 8, 20, 32, 10
ALL_ZERO = 3  # the eval example that is all padding


@gin.configurable
def token_ids(split: str, zero_weight: float = 0.0) -> tf.data.Dataset:
    rng = np.random.default_rng(0 if split == "train" else 1)
    count = NUM_TRAIN if split == "train" else NUM_EVAL
    lengths = rng.integers(1, LENGTH + 1, count)
    tokens = rng.integers(1, VOCAB, (count, LENGTH)) * (np.arange(LENGTH) < lengths[:, None])
    weights = np.ones(count, np.float32)
    if split != "train":
        tokens[ALL_ZERO], weights[ALL_ZERO] = 0, zero_weight
    labels = tokens[:, 0] % 2
    return tf.data.Dataset.from_tensor_slices((tokens.astype(np.int32), labels.astype(np.int32), weights))


@gin.configurable
def masked_mean_classifier() -> keras.Model:
    tokens = keras.Input((LENGTH,), dtype="int32")
    embedded = keras.layers.Embedding(VOCAB, 4, mask_zero=True)(tokens)
    return keras.Model(tokens, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(embedded)))


@gin.configurable
def frozen() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(learning_rate=0.0)
