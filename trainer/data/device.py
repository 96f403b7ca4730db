"""The train split held on every replica's device and gathered by index inside the compiled loop: for data
with random access that fits `train.device_data_max_bytes` per device, under the synchronous strategies.

The tf.data path hands each step a batch through TensorFlow's distributed iterator, which costs about as
much per step as a small model's step (measured on 2 cores: 0.7-0.8 ms), and copies every batch from host
to device. Here each replica holds the split once, in the dtype the input function gives, as a
non-trainable variable of the strategy (on its device: host memory on a CPU, the GPU's memory on a GPU);
each step computes global batch i's example indices from the one global order (trainer/data/order.py) and
each replica gathers its own slice of them from its own copy, so a step reads no iterator and copies
nothing from the host. The batches are those of the tf.data path (`pipeline.train_dataset`): the same
examples in the same order, the same batches skipped after a roll-back, the same augmentation (drawn per
example from its position, `order.augment_batch`); the run's place in the data is still the global step.

Under parameter servers the closures gather by index from each worker's copy (trainer/data/indexed.py);
data that streams, decodes serialized records, or is over the budget takes the tf.data path. `choose` says
in one line which path a run takes and why.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from trainer.data import order, sequences
from trainer.data.inputs import Input
from trainer.data.pipeline import _raw_batch_index as raw_batch_index
from trainer.data.pipeline import held_train, on_accelerator
from trainer.distribution import modes

SUPPORT = modes.SYNCHRONOUS  # where the split can be held per replica; elsewhere the tf.data path
DEFAULT_MAX_BYTES = 1024**3  # per device: the split's bytes above which it streams through tf.data


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which path a run's train data takes, and the line that says so at the start."""

    held: bool
    line: str


def split_bytes(arrays: Any) -> int:
    return sum(int(np.asarray(a).nbytes) for a in tf.nest.flatten(arrays))


def choose(
    strategy_name: str, inp: Input, *, max_bytes: int, shard_policy: str = "AUTO", data_service: Any = None
) -> tuple[Choice, Any]:
    """The path for this run's train data and, where held on the devices, the split's arrays."""
    tf_data = "train data: through the tf.data pipeline"
    if data_service is not None:
        return Choice(False, f"{tf_data} (read from the tf.data service)"), None
    held = held_train(inp, shard_policy)
    if held is None:
        return Choice(False, f"{tf_data} (a stream: no random access, or too big to hold in memory)"), None
    if strategy_name not in SUPPORT:
        return Choice(
            False,
            "train data: each parameter-server closure gathers its global batches by index from its worker's "
            "copy of the split (a per-worker dataset; device variables hold it under the synchronous strategies only)",
        ), None
    if sequences.is_variable(inp.element_spec):
        return Choice(False, f"{tf_data} (examples of varying length, each batch padded to its longest)"), None
    if inp.decode_batch is not None:
        return Choice(False, f"{tf_data} (serialized records, decoded a batch at a time on the host)"), None
    arrays, size = held[0], split_bytes(held[0])
    if size > max_bytes:
        return Choice(
            False,
            f"{tf_data} (the split's {size / 2**20:.1f} MiB are over train.device_data_max_bytes "
            f"{max_bytes / 2**20:.1f} MiB per device; raise it where the devices have room)",
        ), None
    return Choice(
        True,
        f"train data: held on each replica's device ({size / 2**20:.1f} MiB each), each batch gathered by index "
        "inside the compiled loop (train.device_data_max_bytes = 0: through tf.data instead)",
    ), arrays


class DeviceSplit:
    """The split as one non-trainable strategy variable per array (a copy per replica, never checkpointed:
    it is the input's), and where the loop stands in the order: `cursor`, the next global batch's number in
    the unskipped stream, and `dropped`, the numbers never to train on (a roll-back's skipped batches).
    Under central storage the copy is the strategy's one, on its variable device. The variables are made
    at the first step (`build`): a loop built only beside the evaluators (`--mode=evaluate`) copies nothing."""

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        arrays: Any,
        global_batch_size: int,
        seed: int,
        augment: Callable[[Any, tf.Tensor], Any] | None = None,
    ):
        self.strategy, self.arrays = strategy, tf.nest.map_structure(np.asarray, arrays)
        self.num_examples = len(tf.nest.flatten(arrays)[0])
        self.global_batch_size, self.seed, self.augment = global_batch_size, seed, augment
        self.replicas = strategy.num_replicas_in_sync
        if global_batch_size % self.replicas:
            raise ValueError(f"global batch {global_batch_size} does not split into {self.replicas} replicas")
        self.split: Any = None
        self.cursor: tf.Variable | None = None
        self.dropped: tf.Variable | None = None

    def build(self) -> None:
        """The variables, once: the split on every replica's device, the cursor and the dropped batches."""
        if self.split is not None:
            return
        widen = on_accelerator()  # a GPU has no gather of int32 variables: int64 there, cast back per batch
        with tf.init_scope(), self.strategy.scope():
            self.split = tf.nest.map_structure(
                lambda a: tf.Variable(
                    a.astype(np.int64) if widen and a.dtype == np.int32 else a,
                    trainable=False,
                    aggregation=tf.VariableAggregation.NONE,
                    name="train_split",
                ),
                self.arrays,
            )
        with tf.init_scope():
            self.cursor = tf.Variable(0, dtype=tf.int64, trainable=False, name="train_cursor")
            self.dropped = tf.Variable(
                tf.zeros([0], tf.int64), shape=tf.TensorShape([None]), trainable=False, name="dropped_batches"
            )

    def start_at(self, skip_steps: int, drop_batches: Sequence[int]) -> None:
        """The next step trains on the batch after `skip_steps` kept ones, as `pipeline.train_dataset`."""
        self.build()
        dropped = sorted(set(drop_batches))
        self.cursor.assign(raw_batch_index(skip_steps, dropped))
        self.dropped.assign(tf.constant(dropped, tf.int64, shape=[len(dropped)]))

    def next_batch_number(self) -> tf.Tensor:
        """The next kept global batch's number (cross-replica context), the cursor moved past it."""
        dropped = self.dropped.read_value()
        number = tf.while_loop(
            lambda i: tf.reduce_any(tf.equal(i, dropped)), lambda i: (i + 1,), (self.cursor.read_value(),)
        )[0]
        with tf.control_dependencies([self.cursor.assign(number + 1)]):
            return tf.identity(number)

    def replica_batch(self, number: tf.Tensor) -> Any:
        """This replica's slice of global batch `number` (replica context), gathered from its own copy:
        replica r trains on slice r, as with `experimental_distribute_dataset`."""
        context = tf.distribute.get_replica_context()
        per_replica = self.global_batch_size // self.replicas
        first = tf.cast(context.replica_id_in_sync_group, tf.int64) * per_replica
        positions = tf.cast(number, tf.int64) * self.global_batch_size + first + tf.range(per_replica, dtype=tf.int64)
        indices = order.example_indices(positions, self.num_examples, self.seed)
        batch = tf.nest.map_structure(lambda v, a: tf.cast(tf.gather(v, indices), a.dtype), self.split, self.arrays)
        return batch if self.augment is None else order.augment_batch(batch, self.augment, positions, self.seed)


@dataclasses.dataclass(frozen=True)
class DeviceBatches:
    """What the compiled loop reads its batches from on this path (trainer/loops/sync.py): the split, to
    start at a step (kept batches) with some batches never trained on."""

    split: DeviceSplit
    skip_steps: int = 0
    drop_batches: tuple[int, ...] = ()


# One split per input and strategy: a roll-back asks for the train data again and must not copy it again.
_SPLITS: "weakref.WeakKeyDictionary[Input, DeviceSplit]" = weakref.WeakKeyDictionary()


def device_batches(
    strategy: tf.distribute.Strategy,
    inp: Input,
    arrays: Any,
    global_batch_size: int,
    seed: int,
    *,
    skip_steps: int = 0,
    drop_batches: Sequence[int] = (),
) -> DeviceBatches:
    """The split of `inp` on `strategy`'s devices (made once), from `skip_steps` on without `drop_batches`."""
    split = _SPLITS.get(inp)
    if split is None or (split.strategy, split.global_batch_size, split.seed) != (strategy, global_batch_size, seed):
        split = _SPLITS[inp] = DeviceSplit(strategy, arrays, global_batch_size, seed, inp.augment)
    return DeviceBatches(split, skip_steps, tuple(drop_batches))


class IteratorFeed:
    """The tf.data path as the compiled loop reads it: its argument is the distributed iterator, a step's
    batch is `next(iterator)`, already each replica's."""

    def __init__(self, dataset: Any):
        self.source = iter(dataset)

    def restart(self, dataset: Any) -> None:
        self.source = iter(dataset)

    def next_item(self, source: Any) -> Any:
        return next(source)

    def replica_batch(self, item: Any) -> Any:
        return item


class SplitFeed:
    """The split on the devices as the compiled loop reads it: its argument is the cursor, a step's item is
    the global batch's number (cross-replica), which each replica turns into its slice (`replica_batch`)."""

    def __init__(self, batches: DeviceBatches):
        self.split = batches.split
        self._start: DeviceBatches | None = None
        self.restart(batches)

    @property
    def source(self) -> tf.Variable:
        """The cursor, at the start asked for last (the split made on the devices at the first call)."""
        if self._start is not None:
            self.split.start_at(self._start.skip_steps, self._start.drop_batches)
            self._start = None
        return self.split.cursor

    def restart(self, batches: DeviceBatches) -> None:
        if not isinstance(batches, DeviceBatches) or batches.split is not self.split:
            raise ValueError("a loop reading the split on its devices restarts on that same split")
        self._start = batches

    def next_item(self, source: Any) -> tf.Tensor:
        return self.split.next_batch_number()

    def replica_batch(self, number: tf.Tensor) -> Any:
        return self.split.replica_batch(number)


def feed_of(train_data: Any) -> IteratorFeed | SplitFeed:
    """How the compiled loop reads `train_data`: a distributed dataset, or the split on the devices."""
    return SplitFeed(train_data) if isinstance(train_data, DeviceBatches) else IteratorFeed(train_data)
