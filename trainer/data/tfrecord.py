"""The user's own data in sharded TFRecord files: the built-in format (written by `trainer.write_tfrecords`:
`image` a float list of the flattened image (product of `input_shape` long), `label` an int64), or any
other schema, through `features` (name -> `Feature`) or `parse_fn(serialized_record) -> example`.

Train files that total at most `max_memory_bytes` are read once into memory as their serialized records
(`arrays`), in the order they stream: the loop then gathers each global batch's records by index in the one
global order (trainer/data/order.py) and parses them per batch (`decode_batch`), so a restart goes on at
exactly the next example on any worker count, as for arrays; larger ones stream."""

import dataclasses
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import Any

import numpy as np
import tensorflow as tf

from trainer.data.inputs import MAX_IN_MEMORY_BYTES, SPLITS, Shard, shard_of
from trainer.data.pipeline import parallel_calls
from trainer.errors import UserError
from trainer.validation import check_int

MAX_OPEN_FILES = 64
# Records parsed per `tf.io.parse_example` call where the schema allows (see TFRecordFiles.examples).
PARSE_BATCH = 256
BATCH_PARSED_KINDS = ("float", "int64", "bytes")  # the rest decode or pad each record on its own
FEATURE_KINDS = ("float", "int64", "bytes", "png", "jpeg", "int64_sequence")


@dataclasses.dataclass(frozen=True)
class Feature:
    """How to parse one feature of a `tf.train.Example` to a fixed shape (see the `*_feature` functions)."""

    kind: str
    shape: tuple[int, ...] = ()
    length: int | None = None
    channels: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in FEATURE_KINDS:
            raise UserError(f"unknown feature kind {self.kind!r}: use one of {', '.join(FEATURE_KINDS)}")
        if self.kind in ("png", "jpeg") and len(self.shape) != 3:
            raise UserError(f"a {self.kind} feature needs shape=(height, width, channels), got {self.shape}")
        if self.kind == "int64_sequence" and not (self.length and self.length > 0):
            raise UserError(f"an int64_sequence feature needs a positive length to pad to, got {self.length}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    def parse_spec(self) -> tf.io.FixedLenFeature | tf.io.VarLenFeature:
        if self.kind == "int64_sequence":
            return tf.io.VarLenFeature(tf.int64)
        if self.kind in ("png", "jpeg"):
            return tf.io.FixedLenFeature([], tf.string)
        dtype = {"float": tf.float32, "int64": tf.int64, "bytes": tf.string}[self.kind]
        return tf.io.FixedLenFeature(self.shape, dtype)

    def decode(self, raw: tf.Tensor | tf.SparseTensor) -> tf.Tensor:
        if self.kind == "int64_sequence":
            values = tf.sparse.to_dense(raw)[: self.length]
            values = tf.pad(values, [[0, self.length - tf.shape(values)[0]]])
            return tf.ensure_shape(tf.cast(values, tf.int32), [self.length])
        if self.kind in ("png", "jpeg"):
            decode = tf.io.decode_png if self.kind == "png" else tf.io.decode_jpeg
            image = decode(raw, channels=self.channels or self.shape[-1])
            return tf.ensure_shape(tf.image.convert_image_dtype(image, tf.float32), self.shape)
        return tf.cast(raw, tf.int32) if self.kind == "int64" else raw


def float_feature(shape: tuple[int, ...] = ()) -> Feature:
    """A float list of `shape` (gin: `@float_feature()`), float32."""
    return Feature("float", shape)


def int64_feature(shape: tuple[int, ...] = ()) -> Feature:
    """An int64 list of `shape`, returned as int32 (a class label: the default shape ())."""
    return Feature("int64", shape)


def bytes_feature(shape: tuple[int, ...] = ()) -> Feature:
    """A bytes list of `shape`, returned as a string tensor."""
    return Feature("bytes", shape)


def png_feature(shape: tuple[int, ...], channels: int | None = None) -> Feature:
    """A PNG-encoded image decoded to float32 in [0, 1] of `shape` (height, width, channels)."""
    return Feature("png", shape, channels=channels)


def jpeg_feature(shape: tuple[int, ...], channels: int | None = None) -> Feature:
    """A JPEG-encoded image decoded to float32 in [0, 1] of `shape` (height, width, channels)."""
    return Feature("jpeg", shape, channels=channels)


def int64_sequence_feature(length: int) -> Feature:
    """A variable-length int64 list (e.g. token ids) padded with 0 or truncated to `length`, int32."""
    return Feature("int64_sequence", length=length)


def _single_or_dict(values: dict[str, tf.Tensor]) -> tf.Tensor | dict[str, tf.Tensor]:
    return next(iter(values.values())) if len(values) == 1 else values


@dataclasses.dataclass(frozen=True)
class TFRecordFiles:
    """Sharded TFRecord files by glob. With `features`, the example is `(features without the label, label)`
    (the features one tensor where only one remains, else a dict), or the features alone with `label_key`
    None; `parse_fn` replaces all of that. Without either, `input_shape` is needed."""

    train_pattern: str
    eval_pattern: str
    input_shape: tuple[int, ...] | None = None
    num_classes: int | None = None
    features: Mapping[str, Feature] | None = None
    parse_fn: Callable[[tf.Tensor], Any] | None = None
    label_key: str | None = "label"
    max_memory_bytes: int = MAX_IN_MEMORY_BYTES
    splits = SPLITS

    def __call__(self, split: str, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        return self.examples(split, shard_of(input_context))

    def files(self, split: str) -> list[str]:
        pattern = {"train": self.train_pattern, "eval": self.eval_pattern}[split]
        files = sorted(tf.io.gfile.glob(pattern))
        if not files:
            raise UserError(f"no TFRecord files match {split} pattern {pattern!r}: fix the glob or write files there")
        return files

    def validate(self) -> None:
        check_int("tfrecord_files.max_memory_bytes", self.max_memory_bytes, minimum=0)
        self._check_schema()
        for split in SPLITS:
            self.files(split)

    def _check_schema(self) -> None:
        if self.parse_fn is not None:
            return
        if self.features is None and self.input_shape is None:
            raise UserError(
                "tfrecord_files needs input_shape for the built-in record format, or features "
                "(or parse_fn) for another one"
            )
        if self.features is not None and self.label_key is not None and self.label_key not in self.features:
            raise UserError(
                f"tfrecord_files.label_key {self.label_key!r} is not among the features "
                f"({', '.join(self.features)}): add it or set label_key to None"
            )

    def examples(self, split: str, shard: Shard | None = None) -> tf.data.Dataset:
        """Unbatched examples in a fixed order (rule 5); `shard` keeps one part, by file where there are enough
        files, else by record. Records are parsed PARSE_BATCH at a time where the schema allows (10x the
        examples/s of one `parse_single_example` per record)."""
        self._check_schema()
        dataset, parallel = self._records(split, shard), parallel_calls()
        if self._parses_batches:
            return dataset.batch(PARSE_BATCH).map(self._parse, **parallel).unbatch()
        return dataset.map(self._parse, **parallel)

    def arrays(self, split: str) -> np.ndarray | None:
        """The train split's serialized records (one bytes array, in the order `examples` reads them) where its
        files total at most `max_memory_bytes`, read once and kept; None where they stream, and for the other
        splits (read once per eval)."""
        return self._train_records if split == "train" else None

    @cached_property
    def _train_records(self) -> np.ndarray | None:
        if sum(tf.io.gfile.stat(f).length for f in self.files("train")) > self.max_memory_bytes:
            return None
        with tf.init_scope():
            batches = list(self._records("train").batch(65536).as_numpy_iterator())
        return np.concatenate([np.empty(0, object), *batches])

    def decode_batch(self, records: tf.Tensor) -> Any:
        """A batch of examples from a vector of serialized records gathered from `arrays`: the same parsing as
        `examples`, a batch at a time where the schema allows, else record by record."""
        if self._parses_batches:
            return self._parse(records)
        return tf.map_fn(self._parse, records, fn_output_signature=self._example_spec)

    @cached_property
    def _example_spec(self) -> Any:
        with tf.init_scope():
            return self.examples("train").element_spec

    def _records(self, split: str, shard: Shard | None = None) -> tf.data.Dataset:
        """The serialized records of `split` (one `shard` of them), read round-robin from the sorted files."""
        files = self.files(split)
        by_file = shard is not None and len(files) >= shard[0]
        dataset = tf.data.Dataset.from_tensor_slices(files)
        if by_file:
            dataset = dataset.shard(*shard)
        # Round-robin over a fixed cycle: reads shards written round-robin back in order.
        parallel = parallel_calls()
        dataset = dataset.interleave(
            tf.data.TFRecordDataset, cycle_length=min(len(files), MAX_OPEN_FILES), block_length=1, **parallel
        )
        if shard is not None and not by_file:
            dataset = dataset.shard(*shard)
        return dataset

    @property
    def _parses_batches(self) -> bool:
        if self.parse_fn is not None:
            return False
        return self.features is None or all(f.kind in BATCH_PARSED_KINDS for f in self.features.values())

    def _parse(self, records: tf.Tensor) -> Any:
        """One record's example, or a batch of them (a vector of records, where `_parses_batches`)."""
        if self.parse_fn is not None:
            return self.parse_fn(records)
        if self.features is None:
            return self._parse_built_in(records)
        parse = tf.io.parse_example if records.shape.rank else tf.io.parse_single_example
        parsed = parse(records, {name: f.parse_spec() for name, f in self.features.items()})
        values = {name: feature.decode(parsed[name]) for name, feature in self.features.items()}
        if self.label_key is None:
            return _single_or_dict(values)
        label = values.pop(self.label_key)
        return _single_or_dict(values), label

    def _parse_built_in(self, records: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        size = int(np.prod(self.input_shape))
        spec = {"image": tf.io.FixedLenFeature([size], tf.float32), "label": tf.io.FixedLenFeature([], tf.int64)}
        features = tf.io.parse_example(records, spec)
        return tf.reshape(features["image"], [-1, *self.input_shape]), tf.cast(features["label"], tf.int32)

    def num_examples(self, split: str) -> int:
        return self._counts[split]

    @cached_property
    def _counts(self) -> dict[str, int]:
        count = lambda files: int(tf.data.TFRecordDataset(files).reduce(0, lambda n, _: n + 1))  # noqa: E731
        return {split: count(self.files(split)) for split in SPLITS}

    def num_files(self, split: str) -> int:
        return len(self.files(split))
