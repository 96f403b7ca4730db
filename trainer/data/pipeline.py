"""Datasets and their distribution.

Sources yield unbatched `(image float32, label int32)` examples; the pipeline
functions turn them into batches that follow the strategy's input contract
(DESIGN.md, rules 4 and 5): global batches for `experimental_distribute_dataset`,
per-replica batches sharded by `input_pipeline_id` for
`distribute_datasets_from_function`, and a deterministic order, so that a
resumed run skips to exactly the batches it would have seen.

TFRecord format (written by `trainer.write_tfrecords`): one `tf.train.Example`
per record, `image` a float list of the flattened float32 image in row-major
order (its length must equal the product of `input_shape`), `label` an int64.
"""

import dataclasses
import gzip
import os
from functools import cached_property
from typing import Protocol, Sequence

import numpy as np
import tensorflow as tf

from trainer.errors import UserError

SPLITS = ("train", "eval")
SHARD_POLICIES = {name: getattr(tf.data.experimental.AutoShardPolicy, name) for name in ("AUTO", "FILE", "DATA", "OFF")}
MAX_SHUFFLE_BUFFER = 10_000
MAX_OPEN_FILES = 64
Shard = tuple[int, int]  # (number of shards, this shard's index)


class DataSource(Protocol):
    """What the pipelines need from a dataset."""

    input_shape: tuple[int, ...]
    num_classes: int

    def examples(self, split: str, shard: Shard | None = None) -> tf.data.Dataset:
        """Unbatched `(image, label)`; `shard` keeps one part, by file where possible."""

    def num_examples(self, split: str) -> int: ...

    def num_files(self, split: str) -> int: ...

    def validate(self) -> None:
        """Raises UserError early (before anything is written) if the data is unusable."""


class _InMemorySource:
    """Shared behaviour of sources held as numpy arrays in `_arrays[split]`."""

    _arrays: dict[str, tuple[np.ndarray, np.ndarray]]

    def examples(self, split: str, shard: Shard | None = None) -> tf.data.Dataset:
        images, labels = self.arrays(split)
        dataset = tf.data.Dataset.from_tensor_slices((images, labels))
        return dataset.shard(*shard) if shard else dataset

    def arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """All of `split` in memory: images float32, labels int32 (lets pipelines gather whole batches)."""
        images, labels = self._arrays[split]
        return images.astype(np.float32, copy=False), labels.astype(np.int32, copy=False)

    def num_examples(self, split: str) -> int:
        return len(self._arrays[split][1])

    def num_files(self, split: str) -> int:
        return 1

    def validate(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Digits(_InMemorySource):
    """scikit-learn's 1,797 8x8 digits: real data that needs no download."""

    eval_fraction: float = 0.2
    seed: int = 0
    input_shape = (8, 8, 1)
    num_classes = 10

    @cached_property
    def _arrays(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = (digits.images / 16.0).astype(np.float32)[..., None]
        order = np.random.RandomState(self.seed).permutation(len(images))
        num_eval = int(round(len(images) * self.eval_fraction))
        take = lambda idx: (images[idx], digits.target[idx])  # noqa: E731
        return {"train": take(order[num_eval:]), "eval": take(order[:num_eval])}


@dataclasses.dataclass(frozen=True)
class Synthetic(_InMemorySource):
    """Random images of any shape, deterministic by seed, for benchmarks."""

    input_shape: tuple[int, ...] = (8, 8, 1)
    num_classes: int = 10
    num_train: int = 1024
    num_eval: int = 256
    seed: int = 0

    @cached_property
    def _arrays(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        rng = np.random.RandomState(self.seed)
        arrays = {}
        for split, count in (("train", self.num_train), ("eval", self.num_eval)):
            images = rng.uniform(size=(count, *self.input_shape)).astype(np.float32)
            arrays[split] = (images, rng.randint(0, self.num_classes, size=count))
        return arrays


FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "eval": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def _read_idx(path: str, header_bytes: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8, offset=header_bytes)


@dataclasses.dataclass(frozen=True)
class FashionMnist(_InMemorySource):
    """The tutorial's Fashion-MNIST, read from local idx files; never downloaded."""

    data_dir: str | None = None
    input_shape = (28, 28, 1)
    num_classes = 10

    @property
    def directory(self) -> str:
        """`data_dir`, else where `keras.datasets.fashion_mnist.load_data` caches its files."""
        keras_home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
        return self.data_dir or os.path.join(keras_home, "datasets", "fashion-mnist")

    def validate(self) -> None:
        for name in sum(FASHION_MNIST_FILES.values(), ()):
            path = os.path.join(self.directory, name)
            if not os.path.exists(path):
                raise UserError(f"Fashion-MNIST file {path} is missing (searched {self.directory}): put the four "
                                "Fashion-MNIST .gz files there or set fashion_mnist.data_dir")

    @cached_property
    def _arrays(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        self.validate()
        arrays = {}
        for split, (image_file, label_file) in FASHION_MNIST_FILES.items():
            labels = _read_idx(os.path.join(self.directory, label_file), 8)
            images = _read_idx(os.path.join(self.directory, image_file), 16)
            images = images.reshape(len(labels), *self.input_shape).astype(np.float32) / 255.0
            arrays[split] = (images, labels)
        return arrays


@dataclasses.dataclass(frozen=True)
class TFRecordFiles:
    """The user's own data: sharded TFRecord files by glob (see the module docstring)."""

    train_pattern: str
    eval_pattern: str
    input_shape: tuple[int, ...]
    num_classes: int

    def files(self, split: str) -> list[str]:
        pattern = {"train": self.train_pattern, "eval": self.eval_pattern}[split]
        files = sorted(tf.io.gfile.glob(pattern))
        if not files:
            raise UserError(f"no TFRecord files match {split} pattern {pattern!r}: fix the glob or write files there")
        return files

    def validate(self) -> None:
        for split in SPLITS:
            self.files(split)

    def examples(self, split: str, shard: Shard | None = None) -> tf.data.Dataset:
        files = self.files(split)
        by_file = shard is not None and len(files) >= shard[0]
        dataset = tf.data.Dataset.from_tensor_slices(files)
        if by_file:
            dataset = dataset.shard(*shard)
        # Round-robin over a fixed cycle: reads shards written round-robin back in order.
        dataset = dataset.interleave(tf.data.TFRecordDataset, cycle_length=min(len(files), MAX_OPEN_FILES),
                                     block_length=1, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if shard is not None and not by_file:
            dataset = dataset.shard(*shard)
        return dataset.map(self._parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _parse(self, record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        size = int(np.prod(self.input_shape))
        spec = {"image": tf.io.FixedLenFeature([size], tf.float32), "label": tf.io.FixedLenFeature([], tf.int64)}
        features = tf.io.parse_single_example(record, spec)
        return tf.reshape(features["image"], self.input_shape), tf.cast(features["label"], tf.int32)

    def num_examples(self, split: str) -> int:
        return self._counts[split]

    @cached_property
    def _counts(self) -> dict[str, int]:
        count = lambda files: int(tf.data.TFRecordDataset(files).reduce(0, lambda n, _: n + 1))  # noqa: E731
        return {split: count(self.files(split)) for split in SPLITS}

    def num_files(self, split: str) -> int:
        return len(self.files(split))


def _options(shard_policy: str) -> tf.data.Options:
    policy = SHARD_POLICIES.get(shard_policy.upper())
    if policy is None:
        raise UserError(f"unknown shard_policy {shard_policy!r}: use one of {', '.join(SHARD_POLICIES)}")
    options = tf.data.Options()
    options.deterministic = True
    options.experimental_distribute.auto_shard_policy = policy
    return options


def _shard(context: tf.distribute.InputContext | None) -> Shard | None:
    if context is None or context.num_input_pipelines <= 1:
        return None
    return context.num_input_pipelines, context.input_pipeline_id


def train_dataset(source: DataSource, batch_size: int, seed: int, *, shard_policy: str = "AUTO",
                  skip_batches: int = 0, drop_batches: Sequence[int] = (),
                  input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
    """Endless shuffled batches, deterministic by seed, starting at batch `skip_batches`.

    `drop_batches` are indices (in the unskipped stream) of batches never to train on, such as
    one that made the loss non-finite; `skip_batches` counts the batches that remain.
    Sources held in memory are shuffled a whole epoch at a time (see `shuffled_index_batches`);
    streamed sources through a shuffle buffer of up to MAX_SHUFFLE_BUFFER examples.
    """
    options = _options(shard_policy)
    drop_batches = sorted(set(drop_batches))
    first = _raw_batch_index(skip_batches, drop_batches)
    in_memory = getattr(source, "arrays", None)
    if in_memory is not None:
        dataset = shuffled_index_batches(source.num_examples("train"), batch_size, seed, first_batch=first,
                                         shard=_shard(input_context))
    else:
        buffer = min(source.num_examples("train"), MAX_SHUFFLE_BUFFER)
        dataset = source.examples("train", _shard(input_context))
        dataset = dataset.shuffle(buffer, seed=seed, reshuffle_each_iteration=True).repeat()
        dataset = dataset.batch(batch_size, drop_remainder=True).skip(first)
    if dropped := [b for b in drop_batches if b >= first]:
        dropped = tf.constant(dropped, tf.int64)
        dataset = dataset.enumerate(start=first).filter(lambda i, _: tf.reduce_all(tf.not_equal(i, dropped)))
        dataset = dataset.map(lambda _, batch: batch)
    if in_memory is not None:
        images, labels = (tf.constant(a) for a in in_memory("train"))
        dataset = dataset.map(lambda index: (tf.gather(images, index), tf.gather(labels, index)))
    return prefetch_for_accelerators(dataset).with_options(options)


def prefetch_for_accelerators(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Prefetches where the steps run on an accelerator; on a CPU-only machine runs the pipeline inline.

    Prefetching overlaps host input with device compute. Where the CPU is the device, the
    step already keeps every core busy: a prefetch thread only takes cores from it and adds
    a hand-off per batch (measured with trainer.bench's CNN on 2 cores: 5% more steps/s
    without it; the MLP and MirroredStrategy, whose distributed iterator buffers per device
    anyway, no slower).
    """
    if any(tf.config.list_logical_devices(kind) for kind in ("GPU", "TPU")):
        return dataset.prefetch(tf.data.AUTOTUNE)
    return dataset


def _raw_batch_index(skip_batches: int, drop_batches: Sequence[int]) -> int:
    """The index in the unfiltered stream of the first batch after `skip_batches` kept ones."""
    raw = skip_batches
    for dropped in drop_batches:  # sorted: each dropped batch at or before the position pushes it on
        if dropped <= raw:
            raw += 1
    return raw


def shuffled_index_batches(num_examples: int, batch_size: int, seed: int, *, first_batch: int = 0,
                           shard: Shard | None = None) -> tf.data.Dataset:
    """Endless `[batch_size]` int64 batches of example indices, from batch `first_batch` on.

    Epoch e is a permutation of the examples seeded by (seed, e); epochs follow each other
    and batches run across their boundaries, as in `shuffle().repeat().batch()`. Whole
    epochs are shuffled at once, so each batch costs the pipeline one slice instead of
    `batch_size` trips through a shuffle buffer (on a CPU the pipeline's threads take cores
    from the step), and a resumed run starts at its batch without replaying those before it.
    `shard` keeps every n-th example (the examples of one input pipeline).
    """
    ids = tf.range(num_examples, dtype=tf.int64)
    if shard:
        ids = ids[shard[1]::shard[0]]
    count = int(ids.shape[0])
    if count == 0:
        raise UserError(f"input pipeline {shard} of {num_examples} training examples holds none: "
                        "use fewer workers or more data")
    first_epoch, offset = divmod(first_batch * batch_size, count)

    def permutation(epoch):
        order = tf.random.experimental.stateless_shuffle(
            tf.range(count, dtype=tf.int64), seed=tf.stack([tf.constant(seed, tf.int64), tf.cast(epoch, tf.int64)]))
        return tf.gather(ids, order)

    def cut(leftover, epoch):
        stream = tf.concat([leftover, permutation(epoch)], 0)
        whole = tf.size(stream, out_type=tf.int64) // batch_size * batch_size
        return stream[whole:], tf.reshape(stream[:whole], [-1, batch_size])

    initial = permutation(first_epoch)[offset:]
    return tf.data.Dataset.counter(first_epoch + 1).scan(initial, cut).unbatch()


def eval_dataset(source: DataSource, batch_size: int, *, pad_to_multiple_of: int | None = None,
                 shard_policy: str = "AUTO", input_context: tf.distribute.InputContext | None = None
                 ) -> tf.data.Dataset:
    """Every eval example once as `(image, label, weight)` batches, the last one partial.

    Padding (weight 0) to a multiple of `pad_to_multiple_of` gives every worker and
    replica the same number of batches, so collective ops cannot hang. With an input
    context the padded examples are sharded, never the files, to keep counts equal.
    """
    options = _options(shard_policy)
    dataset = source.examples("eval").map(lambda x, y: (x, y, tf.constant(1.0)), num_parallel_calls=tf.data.AUTOTUNE)
    padding = -source.num_examples("eval") % pad_to_multiple_of if pad_to_multiple_of else 0
    if padding:
        zero = (tf.zeros(source.input_shape, tf.float32), tf.constant(0, tf.int32), tf.constant(0.0))
        dataset = dataset.concatenate(tf.data.Dataset.from_tensors(zero).repeat(padding))
    if shard := _shard(input_context):
        dataset = dataset.shard(*shard)
    dataset = dataset.batch(batch_size, drop_remainder=False)
    return prefetch_for_accelerators(dataset).with_options(options)


def num_workers(strategy: tf.distribute.Strategy) -> int:
    """How many workers feed this strategy (1 for single-machine strategies)."""
    if count := getattr(strategy.extended, "_num_workers", None):
        return int(count)
    if resolver := getattr(strategy, "cluster_resolver", None):
        jobs = resolver.cluster_spec().as_dict()
        return max(1, len(jobs.get("worker", ())) + len(jobs.get("chief", ())))
    return 1


def _check(strategy: tf.distribute.Strategy, source: DataSource, split: str, method: str, shard_policy: str) -> None:
    """Catches, before any step, the input settings that fail or hang later."""
    if method not in ("dataset", "function"):
        raise UserError(f"unknown input method {method!r}: use 'dataset' or 'function'")
    workers, files, policy = num_workers(strategy), source.num_files(split), shard_policy.upper()
    if policy == "FILE" and files < workers:
        raise UserError(
            f"FILE sharding needs at least as many files ({files}) as workers ({workers}): write more shards "
            "with `python -m trainer.write_tfrecords --num_shards=...` or set shard_policy to DATA")
    # Eval files sharded across workers give them different batch counts; their collectives then hang.
    if split == "eval" and method == "dataset" and workers > 1 and (policy == "FILE" or policy == "AUTO" and files > 1):
        raise UserError(f"eval with shard_policy {shard_policy} may shard by file and hang {workers} workers: "
                        "set the eval shard_policy to DATA")


def _shards_by_file(source: DataSource, shard_policy: str, context: tf.distribute.InputContext) -> bool:
    if context.num_input_pipelines <= 1:
        return False
    policy = shard_policy.upper()
    return policy == "FILE" or policy == "AUTO" and source.num_files("train") >= context.num_input_pipelines


def replica_slices(dataset: tf.data.Dataset, context: tf.distribute.InputContext) -> tf.data.Dataset:
    """Per-replica batches cut from global batches: this pipeline's replicas, in order.

    Every pipeline reads the same global batches and keeps its own slices, so replica r
    trains on slice r of global batch s, exactly as with `experimental_distribute_dataset`
    and as one device would see it: results do not depend on how work is split.
    """
    replicas = context.num_replicas_in_sync
    per_pipeline = replicas // context.num_input_pipelines
    first = context.input_pipeline_id * per_pipeline

    def split(*batch):
        chunks = [tf.reshape(t, [replicas, -1, *t.shape[1:]])[first:first + per_pipeline] for t in batch]
        return tf.data.Dataset.from_tensor_slices(tuple(chunks))

    return prefetch_for_accelerators(dataset.flat_map(split))


def distribute_train(strategy: tf.distribute.Strategy, source: DataSource, global_batch_size: int, seed: int, *,
                     method: str = "dataset", shard_policy: str = "AUTO", skip_steps: int = 0,
                     drop_batches: Sequence[int] = ()
                     ) -> tf.distribute.DistributedDataset:
    """The training data for `strategy`, resumed after `skip_steps` global steps.

    `drop_batches` are global batch indices never trained on (see `train_dataset`).
    """
    _check(strategy, source, "train", method, shard_policy)
    if method == "dataset":
        dataset = train_dataset(source, global_batch_size, seed, shard_policy=shard_policy, skip_batches=skip_steps,
                                drop_batches=drop_batches)
        return strategy.experimental_distribute_dataset(dataset)

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        if _shards_by_file(source, shard_policy, context):
            batches_per_step = context.num_replicas_in_sync // context.num_input_pipelines
            return train_dataset(source, context.get_per_replica_batch_size(global_batch_size), seed,
                                 shard_policy=shard_policy, skip_batches=skip_steps * batches_per_step,
                                 drop_batches=[s * batches_per_step + k for s in drop_batches
                                               for k in range(batches_per_step)],
                                 input_context=context)
        dataset = train_dataset(source, global_batch_size, seed, shard_policy="OFF", skip_batches=skip_steps,
                                drop_batches=drop_batches)
        return replica_slices(dataset, context)

    return strategy.distribute_datasets_from_function(dataset_fn)


def distribute_eval(strategy: tf.distribute.Strategy, source: DataSource, global_batch_size: int, *,
                    method: str = "dataset", shard_policy: str = "AUTO") -> tf.distribute.DistributedDataset:
    """The eval data for `strategy`, padded so every replica sees the same number of batches."""
    _check(strategy, source, "eval", method, shard_policy)
    if method == "dataset":
        return strategy.experimental_distribute_dataset(eval_dataset(
            source, global_batch_size, pad_to_multiple_of=global_batch_size, shard_policy=shard_policy))

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        return eval_dataset(source, context.get_per_replica_batch_size(global_batch_size),
                            pad_to_multiple_of=global_batch_size, shard_policy=shard_policy, input_context=context)

    return strategy.distribute_datasets_from_function(dataset_fn)


def check_sizes(source: DataSource, global_batch_size: int) -> None:
    """Refuses data that cannot make one training batch or has nothing to evaluate."""
    num_train, num_eval = source.num_examples("train"), source.num_examples("eval")
    if num_train < global_batch_size:
        raise UserError(f"the train split has {num_train} examples, fewer than one global batch of "
                        f"{global_batch_size}: add data or lower train.global_batch_size")
    if num_eval == 0:
        raise UserError("the eval split has no examples: add eval data (e.g. the eval files of tfrecord_files)")
