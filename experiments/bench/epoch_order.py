"""The order of in-memory train data before the indexed one (trainer/data/order.py), for the bench's
`ours_epoch_order` variant: each epoch a permutation materialized whole (`stateless_shuffle` keyed by
(seed, epoch)) and cut into batches across epoch boundaries. It has no position to compute per example,
so it is the baseline for what reading by index costs; `use_epoch_order` puts it in the pipeline."""

from __future__ import annotations

import tensorflow as tf

from trainer.data import pipeline


def epoch_permutation_batches(
    num_examples: int, batch_size: int, seed: int, *, first_batch: int = 0, shard=None, bucketing=None
) -> tf.data.Dataset:
    """`pipeline.shuffled_index_batches`' contract (`shard` and `bucketing` aside), from whole-epoch
    permutations."""
    if shard or bucketing:
        raise ValueError("the epoch-order baseline takes no shard and no bucketing")
    first_epoch, offset = divmod(first_batch * batch_size, num_examples)

    def permutation(epoch):
        seed_pair = tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64)])
        return tf.random.experimental.stateless_shuffle(tf.range(num_examples, dtype=tf.int64), seed=seed_pair)

    @pipeline.graph_code
    def cut(leftover, epoch):
        stream = tf.concat([leftover, permutation(epoch)], 0)
        whole_batches = tf.size(stream, out_type=tf.int64) // batch_size * batch_size
        return stream[whole_batches:], tf.reshape(stream[:whole_batches], [-1, batch_size])

    initial = permutation(first_epoch)[offset:]
    return tf.data.Dataset.counter(first_epoch + 1).scan(initial, cut).unbatch()


def use_epoch_order() -> None:
    """Makes this process's train pipelines read in-memory data in the epoch-permutation order."""
    pipeline.shuffled_index_batches = epoch_permutation_batches
