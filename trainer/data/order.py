"""The one global order of the train examples: position p of the endless stream is example
`example_indices(p)`, a pure function of (seed, epoch, p) where epoch = p // num_examples.

Every epoch is a permutation of `range(num_examples)` (`RandomIndexShuffle`, computed per position, so no
epoch is ever materialized); global batch i is positions `[i * B, (i + 1) * B)`, whatever the worker or
replica count; a run's place in the data is one number, the positions consumed (trainer/extensions/
data_position.py). An input function's `augment(example, seed)` draws from stateless ops seeded by the
position (`example_seeds`). The synchronous pipelines and the parameter-server closures read the order and
the seeds from here, so they cannot disagree.
"""

from __future__ import annotations

from typing import Any, Callable

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


def example_seeds(positions: tf.Tensor, seed: int | tf.Tensor) -> tf.Tensor:
    """A stateless random seed ([..., 2] int64) for the example at each position: (seed, position), and a
    position names one (epoch, example), so an augmentation drawn from it is the same in every run that
    trains on that example in that epoch, resumed or not, on any worker count."""
    positions = tf.convert_to_tensor(positions, tf.int64)
    return tf.stack([tf.fill(tf.shape(positions), tf.cast(seed, tf.int64)), positions], axis=-1)


def augment_batch(batch: Any, augment: Callable[[Any, tf.Tensor], Any], positions: tf.Tensor, seed: int) -> Any:
    """`augment(example, seed)` of each example of `batch` at `positions`, seeded by `example_seeds`."""
    seeds = example_seeds(positions, seed)
    return tf.vectorized_map(lambda args: augment(args[0], args[1]), (batch, seeds))
