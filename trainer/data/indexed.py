"""Global batches by index, gathered from a train split held in memory: what a parameter-server closure
trains on. The closure is given the indices of its global batches (so the coordinator knows which batches
each closure trains on, and a closure run again runs on the same ones); its worker holds the split (a
per-worker dataset of one element, the whole split) and gathers each batch from it in the one global order
(trainer/data/order.py), so no batch depends on which worker runs it or how many there are."""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from trainer.data import order, sequences
from trainer.data.inputs import Input
from trainer.data.pipeline import held_train


class IndexedBatches:
    """Global batch i of `arrays` (equally long arrays of any structure) for batch size and seed; `decode`
    turns gathered encoded examples (serialized records) into examples."""

    def __init__(
        self,
        arrays: Any,
        global_batch_size: int,
        seed: int,
        augment: Callable | None = None,
        decode: Callable | None = None,
        bucketing: sequences.Bucketing | None = None,
    ):
        self.arrays, self.augment, self.decode, self.bucketing = arrays, augment, decode, bucketing
        self.num_examples = len(tf.nest.flatten(arrays)[0])
        self.global_batch_size = global_batch_size
        self.seed = seed

    def source(self) -> tf.data.Dataset:
        """The whole split as the one element of an endless dataset: each worker's copy, read once per closure
        (a tensor handed out again is not copied)."""
        tensors = tf.nest.map_structure(tf.constant, self.arrays)
        return tf.data.Dataset.from_tensors(tensors).repeat()

    def batch(self, examples: Any, batch_index: tf.Tensor) -> Any:
        """Global batch `batch_index` from `examples` (one element of `source`), in order."""
        if self.bucketing is not None:
            positions = self.bucketing.batch_positions(batch_index)
        else:
            positions = order.batch_positions(batch_index, self.global_batch_size)
        indices = order.example_indices(positions, self.num_examples, self.seed)
        batch = tf.nest.map_structure(lambda t: tf.gather(t, indices), examples)
        batch = batch if self.decode is None else self.decode(batch)
        return batch if self.augment is None else order.augment_batch(batch, self.augment, positions, self.seed)


def indexed_batches(inp: Input, global_batch_size: int, seed: int, shard_policy: str = "AUTO") -> IndexedBatches | None:
    """The input's train split as indexed batches, None where it streams (`pipeline.held_train`)."""
    held = held_train(inp, shard_policy)
    if held is None:
        return None
    bucketing = sequences.bucketing_of(inp.bucket_keys, global_batch_size, seed, inp.sequences)
    return IndexedBatches(held[0], global_batch_size, seed, inp.augment, inp.decode_batch, bucketing)


def replica_slice(batch: Any) -> Any:
    """This replica's slice of a global batch, in replica context: replica r trains on slice r, as with
    `experimental_distribute_dataset`."""
    context = tf.distribute.get_replica_context()
    replicas, replica = context.num_replicas_in_sync, context.replica_id_in_sync_group
    return tf.nest.map_structure(lambda t: tf.reshape(t, sequences.per_replica_shape(t, replicas))[replica], batch)
