"""Worked example: a classifier of variable-length token sequences.

A deterministic synthetic corpus stands in for text: each sequence holds 4 to `max_length`
token ids drawn from a vocabulary of filler words, and its class (0-3) says which of two
keywords it contains (neither, the first, the second, both). With `padded` (text.gin) the
input function pads each with 0 to `max_length` itself; without (sequences.gin) it returns
each sequence at its own length, shape (None,), and the loop pads each batch to its longest
(and buckets by length, `train.sequences`). The model embeds with `mask_zero=True`, so padding
is left out of the average it pools either way.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

import gin
import keras
import numpy as np
import tensorflow as tf

PAD = 0
KEYWORDS = (1, 2)  # token ids whose presence decides the class; filler ids start after them
NUM_CLASSES = 2 ** len(KEYWORDS)
VOCAB_SIZE = 64


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TokenSequences:
    """`num_train` + `num_eval` sequences, drawn from `seed`; int32 tokens, padded to `max_length` (`padded`),
    or each of its own length."""

    num_train: int = 2000
    num_eval: int = 500
    max_length: int = 24
    vocab_size: int = VOCAB_SIZE
    seed: int = 0
    padded: bool = True
    splits = ("train", "eval")
    num_classes = NUM_CLASSES

    @cached_property
    def _corpus(self) -> dict[str, tuple[list[np.ndarray], np.ndarray]]:
        rng = np.random.RandomState(self.seed)
        corpus = {}
        for split, count in (("train", self.num_train), ("eval", self.num_eval)):
            labels = rng.randint(0, NUM_CLASSES, size=count)
            sequences = []
            for label in labels:
                tokens = rng.randint(len(KEYWORDS) + 1, self.vocab_size, size=rng.randint(4, self.max_length + 1))
                present = [k for bit, k in enumerate(KEYWORDS) if label >> bit & 1]
                places = rng.choice(len(tokens), size=len(present), replace=False)
                tokens[places] = present
                sequences.append(tokens.astype(np.int32))
            corpus[split] = sequences, labels.astype(np.int32)
        return corpus

    def _pad(self, tokens: tf.Tensor, label: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        padded = tf.pad(tokens, [[0, self.max_length - tf.shape(tokens)[0]]], constant_values=PAD)
        return tf.ensure_shape(padded, [self.max_length]), label

    def __call__(self, split: str) -> tf.data.Dataset:
        """Unbatched `(tokens int32 [max_length], label int32 [])`, 0 after the sequence's end; not `padded`,
        `(tokens int32 [None], label)`."""
        sequences, labels = self._corpus[split]
        ragged = tf.ragged.constant(sequences, dtype=tf.int32)
        examples = tf.data.Dataset.from_tensor_slices((ragged, labels))
        return examples.map(self._pad) if self.padded else examples


@gin.configurable
def text_classifier(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    vocab_size: int = VOCAB_SIZE,
    embedding_dim: int = 16,
    units: int = 32,
) -> keras.Model:
    """Embedding (0 masked), masked average pooling, a hidden layer; returns logits.

    `input_shape` is `(max_length,)`, or `(None,)` for sequences of any length: the model is built here, under the strategy's scope, not on its
    first call inside the step.
    """
    return keras.Sequential(
        [
            keras.Input(shape=tuple(input_shape), dtype="int32"),
            keras.layers.Embedding(vocab_size, embedding_dim, mask_zero=True),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(units, activation="relu"),
            keras.layers.Dense(num_classes),
        ],
        name="text_classifier",
    )
