"""Input functions of examples of any length, for tests/test_sequences.py.

`numbered(split)`: example i is `(tokens, i)`, tokens `[i + 1] * length(i)` of shape (None,), so a batch
says which examples it holds and where each one's padding starts. `ragged_words(split)`: a `tf.RaggedTensor`
feature per example (words of characters, shape [None, None]) beside a label. `ragged_and_fixed` trains
the LSTM classifier below on examples `({'tokens': (None,), 'scale': (2,)}, label)`.
"""

from __future__ import annotations

import gin
import keras
import numpy as np
import tensorflow as tf

NUM_TRAIN, NUM_EVAL = 96, 20


def length(i: np.ndarray | int) -> np.ndarray | int:
    """Lengths 1 to 10, in no order."""
    return 1 + (np.asarray(i) * 7) % 10


def numbered_arrays(count: int) -> tuple[tf.RaggedTensor, np.ndarray]:
    ids = np.arange(count)
    tokens = tf.ragged.constant([[i + 1] * int(length(i)) for i in ids], dtype=tf.int32)
    return tokens, ids.astype(np.int64)


@gin.configurable
def numbered(split: str) -> tf.data.Dataset:
    tokens, ids = numbered_arrays(NUM_TRAIN if split == "train" else NUM_EVAL)
    return tf.data.Dataset.from_tensor_slices((tokens, ids))


@gin.configurable
def streamed_numbered(split: str) -> tf.data.Dataset:
    """`numbered` of unknown size (a filter that keeps all): the loop streams it."""
    return numbered(split).filter(lambda tokens, i: i >= 0)


@gin.configurable
def ragged_words(split: str) -> tf.data.Dataset:
    """`(words int32 ragged [None, None], label int32)`: example i has 1 + i % 3 words of 1 + (i + w) % 4 chars."""
    count = NUM_TRAIN if split == "train" else NUM_EVAL
    words = [[[w + 1] * (1 + (i + w) % 4) for w in range(1 + i % 3)] for i in range(count)]
    ragged = tf.ragged.constant(words, dtype=tf.int32, ragged_rank=2)
    return tf.data.Dataset.from_tensor_slices((ragged, np.arange(count, dtype=np.int32) % 2))


@gin.configurable
def sequence_classes(split: str) -> tf.data.Dataset:
    """`({'tokens': int32 (None,), 'scale': float32 (2,)}, label)`: the label is whether token 1 occurs."""
    count = 128 if split == "train" else 40
    rng = np.random.RandomState(0 if split == "train" else 1)
    tokens = [rng.randint(2, 20, size=rng.randint(3, 17)) for _ in range(count)]
    labels = rng.randint(0, 2, size=count)
    for t, label in zip(tokens, labels):
        if label:
            t[rng.randint(len(t))] = 1
    ragged = tf.ragged.constant(tokens, dtype=tf.int32)
    scale = np.ones([count, 2], np.float32)
    return tf.data.Dataset.from_tensor_slices(({"tokens": ragged, "scale": scale}, labels.astype(np.int32)))


@gin.configurable
def lstm_classifier(vocab_size: int = 20) -> keras.Model:
    """Embedding (0 masked) -> LSTM -> logits, of a dict of `tokens` (any length) and `scale`."""
    tokens = keras.Input(shape=(None,), dtype="int32", name="tokens")
    scale = keras.Input(shape=(2,), name="scale")
    embedded = keras.layers.Embedding(vocab_size, 8, mask_zero=True)(tokens)
    hidden = keras.layers.LSTM(8)(embedded)
    logits = keras.layers.Dense(2)(keras.layers.Concatenate()([hidden, scale]))
    return keras.Model({"tokens": tokens, "scale": scale}, logits)
