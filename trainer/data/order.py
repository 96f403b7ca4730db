"""The one global order of the train examples: position p of the endless stream is example
`example_indices(p)`, a pure function of (seed, epoch, p) where epoch = p // num_examples.

Every epoch is a permutation of `range(num_examples)` (`RandomIndexShuffle`, computed per position, so no
epoch is ever materialized); global batch i is positions `[i * B, (i + 1) * B)`, whatever the worker or
replica count; a run's place in the data is one number, the positions consumed (trainer/extensions/
data_position.py). The synchronous pipelines, the parameter-server closures and the built-in augmentations
all read the order from here, so they cannot disagree.
"""

from __future__ import annotations

import tensorflow as tf

ROUNDS = 4  # the cipher rounds of TensorFlow's own `index_shuffle`


def example_indices(positions: tf.Tensor, num_examples: int | tf.Tensor, seed: int | tf.Tensor) -> tf.Tensor:
    """The example index (int64) at each position (any shape) of the order of `num_examples` examples."""
    positions = tf.convert_to_tensor(positions, tf.int64)
    count = tf.cast(num_examples, tf.int64)
    flat = tf.reshape(positions, [-1])
    keys = tf.stack([tf.fill(tf.shape(flat), tf.cast(seed, tf.int64)), flat // count, tf.zeros_like(flat)], axis=1)
    # The raw op: the public wrapper pads a batch of seeds along the wrong axis (TF 2.21).
    shuffled = tf.raw_ops.RandomIndexShuffle(
        index=flat % count, seed=keys, max_index=tf.fill(tf.shape(flat), count - 1), rounds=ROUNDS
    )
    return tf.reshape(shuffled, tf.shape(positions))


def batch_positions(batch: tf.Tensor, batch_size: int) -> tf.Tensor:
    """The positions `[batch * batch_size, (batch + 1) * batch_size)` of global batch `batch` (a scalar)."""
    batch_size = tf.constant(batch_size, tf.int64)
    return tf.cast(batch, tf.int64) * batch_size + tf.range(batch_size, dtype=tf.int64)


def batch_indices(batch: tf.Tensor, batch_size: int, num_examples: int, seed: int) -> tf.Tensor:
    """The example indices of global batch `batch`, in order: the order's one entry point for a batch."""
    return example_indices(batch_positions(batch, batch_size), num_examples, seed)


def epoch_and_offset(position: int, num_examples: int) -> tuple[int, int]:
    """Which epoch a position is in, and how far into it (for the lines a run prints)."""
    return divmod(position, num_examples)
