"""The loop's view of an input function: what it yields, how many, and whether it is usable.

An input function is `input_fn(split)` or `input_fn(split, input_context)` returning an UNBATCHED
`tf.data.Dataset` of examples of any structure, of fixed shape or of any length (features of unknown
dimensions or ragged: batched padded, trainer/data/sequences.py); one that declares `input_context` returns
only that pipeline's shard when `input_context.num_input_pipelines > 1`. Optional attributes, used where
present: `num_classes`, `splits`, `num_examples(split)` (saves counting), `num_files(split)` (enables the
FILE-sharding checks), `validate()` (raises UserError early), `arrays(split)` (the split in memory, or
None where it streams), `decode_batch(batch)` (where `arrays` holds encoded examples, such as serialized
records: a batch of them, gathered by index, to a batch of examples),
`augment(example, seed)` (a random augmentation of one train example from stateless ops seeded by `seed`,
shape [2], which the loop derives from the example's place in the order: trainer/data/order.py).
The built-in sources (trainer.data.sources, trainer.data.tfrecord) are such functions.
"""

import inspect
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import tensorflow as tf

from trainer.data import sequences
from trainer.errors import UserError
from trainer.task.user_code import user_function

SPLITS = ("train", "eval")
SEQUENCES = sequences.SequenceBatching()  # per-batch padding with 0, no bucketing
# Train data of at most this many bytes is held in memory and gathered in whole batches (pipeline.gathered).
MAX_IN_MEMORY_BYTES = 2 * 1024**3
# A split of unknown cardinality is counted by iterating it, for at most this long: an endless one would
# otherwise hang the start.
COUNT_SECONDS = 20.0
COUNT_PROGRESS_SECONDS = 5.0  # a progress line this often while counting, or checking many splits
Shard = tuple[int, int]  # (number of shards, this shard's index)
InputFunction = Callable[..., tf.data.Dataset]


class DataSource(Protocol):
    """A built-in source: an input function with the optional attributes filled in."""

    num_classes: int | None
    splits: tuple[str, ...]

    def __call__(self, split: str, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset: ...
    def num_examples(self, split: str) -> int: ...
    def num_files(self, split: str) -> int: ...
    def validate(self) -> None: ...


def shard_of(context: tf.distribute.InputContext | None) -> Shard | None:
    """The shard an input context asks for, None where there is only one pipeline."""
    if context is None or context.num_input_pipelines <= 1:
        return None
    return context.num_input_pipelines, context.input_pipeline_id


def _name(input_fn: InputFunction) -> str:
    if inspect.isfunction(input_fn) or inspect.ismethod(input_fn):
        return f"{input_fn.__module__}.{input_fn.__qualname__}"
    return type(input_fn).__name__


def _checked_signature(input_fn: InputFunction) -> inspect.Signature | None:
    """The function's signature (None for builtins without one); refuses one that cannot be called as
    `input_fn(split)` (gin may supply its other parameters)."""
    try:
        signature = inspect.signature(input_fn)
    except (TypeError, ValueError):
        return None
    try:
        "split" in signature.parameters or signature.bind("train")
    except TypeError:
        raise UserError(
            f"train.input_fn {_name(input_fn)}{signature} takes no split: the loop calls it as "
            "input_fn(split) with 'train' and each of train.eval_splits; add a first parameter "
            "`split`"
        ) from None
    return signature


def _example_bytes(spec: Any) -> int | None:
    """Bytes of one example from its spec, None where unknown (strings have no fixed size)."""
    leaves = tf.nest.flatten(spec)
    if all(leaf.dtype.size for leaf in leaves):
        return sum(int(np.prod(leaf.shape, dtype=np.int64)) * leaf.dtype.size for leaf in leaves)
    return None


class Input:
    """One input function as the loop sees it; caches counts and in-memory train data (so build one per
    run: the pipeline functions also take a bare input function, but count it anew)."""

    def __init__(
        self,
        input_fn: InputFunction,
        *,
        eval_splits: Sequence[str] = ("eval",),
        sequences: sequences.SequenceBatching | None = None,
    ) -> None:
        if isinstance(input_fn, Input) or not callable(input_fn):
            raise UserError(f"the input function must be a callable input_fn(split), got {input_fn!r}")
        signature = _checked_signature(input_fn)
        self.input_fn = input_fn
        self.name = _name(input_fn)  # how a refusal names the user's function
        self.eval_splits = tuple(eval_splits)
        self.sequences = sequences or SEQUENCES  # how examples of any length are padded and bucketed
        self.num_classes: int | None = getattr(input_fn, "num_classes", None)
        # An input function that cannot give the same examples in the same order twice says so
        # (`fn.deterministic = False`): exact resume and roll-back need them again.
        self.deterministic: bool = getattr(input_fn, "deterministic", True) is not False
        self.shards_itself = signature is not None and "input_context" in signature.parameters
        self.augment: Callable[[Any, tf.Tensor], Any] | None = getattr(input_fn, "augment", None)
        self.decode_batch: Callable[[Any], Any] | None = getattr(input_fn, "decode_batch", None)
        self.bucket_keys: np.ndarray | None = None  # what bucketing sorts the held train examples by
        self._counts: dict[str, int] = {}
        self.print_fn: Callable[[str], None] | None = None
        self._memory: dict[Shard | None, Any] = {}
        self._spec: Any = None
        self._specs: dict[str, Any] = {}  # by split

    def __repr__(self) -> str:
        return f"Input({_name(self.input_fn)}, eval_splits={self.eval_splits})"

    @property
    def element_spec(self) -> Any:
        """The spec of one train example as batches hold it: ragged features dense, of unknown length."""
        if self._spec is None:
            with tf.init_scope():
                self._spec = sequences.dense_spec(self.examples("train").element_spec)
        return self._spec

    @property
    def input_shape(self) -> tuple[int, ...] | None:
        """The static shape of the features: `example[0]` of a tuple example, else the whole example."""
        spec = self.element_spec
        features = spec[0] if isinstance(spec, (tuple, list)) and len(spec) >= 2 else spec
        return tuple(features.shape) if isinstance(features, tf.TensorSpec) else None

    def examples(self, split: str, input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
        """The function's dataset for `split`, checked to be unbatched fixed-shape examples."""
        splits = getattr(self.input_fn, "splits", None)
        if splits is not None and split not in splits:
            raise UserError(
                f"input function {_name(self.input_fn)} has no split {split!r} (it has "
                f"{', '.join(splits)}): use one of those"
            )
        doing = f"for split {split!r}" + ("" if split == "train" else " (one of train.eval_splits)")
        with user_function(self.input_fn, "train.input_fn", doing):
            if self.shards_itself:
                dataset = self.input_fn(split, input_context=input_context)
            else:
                dataset = self.input_fn(split)
        self._check(dataset, split)
        self._specs[split] = dataset.element_spec
        return dataset

    def example_spec(self, split: str) -> Any:
        """The element spec of `split`'s examples, kept from its check (`validate`): no dataset made anew."""
        if split not in self._specs:
            with tf.init_scope():
                self.examples(split)
        return self._specs[split]

    def _check(self, dataset: Any, split: str) -> None:
        fix = (
            "return an unbatched tf.data.Dataset of examples (no .batch(): the loop batches, padding features "
            "of unknown length to the longest example of each batch)"
        )
        where = f"input function {_name(self.input_fn)} returned"
        if not isinstance(dataset, tf.data.Dataset):
            raise UserError(f"{where} a {type(dataset).__name__}, not a tf.data.Dataset, for split {split!r}: {fix}")
        leaves = _leaves(dataset.element_spec)
        for path, leaf in leaves:
            if not isinstance(leaf, (tf.TensorSpec, tf.RaggedTensorSpec)):
                raise UserError(f"{where} a {type(leaf).__name__} at {path} for split {split!r}: {fix}")
        # Every feature of unknown first dimension, more than one of them: a batched dataset (one feature of
        # unknown length is a sequence, as is any example that also holds a fixed-shape label).
        if len(leaves) > 1 and all(leaf.shape.rank and leaf.shape[0] is None for _, leaf in leaves):
            path, leaf = leaves[0]
            raise UserError(
                f"{where} examples of shape {leaf.shape} at {path} for split {split!r}, every feature of "
                f"unknown first dimension (batched?): {fix}"
            )
        sequences.check(dataset.element_spec, self.sequences, f"input function {_name(self.input_fn)}")

    def num_examples(self, split: str) -> int:
        if split not in self._counts:
            with tf.init_scope():
                self._counts[split] = self._count(split)
        return self._counts[split]

    def _count(self, split: str) -> int:
        if counter := getattr(self.input_fn, "num_examples", None):
            with user_function(self.input_fn, "train.input_fn", f"in its num_examples({split!r})"):
                return int(counter(split))
        dataset = self.examples(split)
        count = int(dataset.cardinality())
        if count == tf.data.INFINITE_CARDINALITY:
            raise UserError(
                f"input function {_name(self.input_fn)} returned an endless dataset for split "
                f"{split!r}: return each example once (no .repeat()); the loop repeats it"
            )
        if count < 0:
            count = self._count_by_iterating(dataset, split)
        return count

    def _count_by_iterating(self, dataset: tf.data.Dataset, split: str) -> int:
        sizes = dataset.map(_one).batch(1024).map(_batch_size)  # examples of any length counted alike
        count, started = 0, time.monotonic()
        next_line = started + COUNT_PROGRESS_SECONDS
        for size in sizes:
            count += int(size)
            now = time.monotonic()
            if now - started > COUNT_SECONDS:
                raise UserError(
                    f"counting split {split!r} of input function {_name(self.input_fn)} (its size is unknown to "
                    f"tf.data) took more than {COUNT_SECONDS:g} s ({count} examples so far): an endless dataset? "
                    "return each example once; if it is that big, declare its size "
                    f"(dataset.apply(tf.data.experimental.assert_cardinality(n)), or a num_examples(split) attribute)"
                )
            if now > next_line and self.print_fn is not None:
                self.print_fn(f"counting split {split!r} (its size is unknown to tf.data): {count} examples so far")
                next_line = now + COUNT_PROGRESS_SECONDS
        return count

    def num_files(self, split: str) -> int | None:
        if (counter := getattr(self.input_fn, "num_files", None)) is None:
            return None
        with user_function(self.input_fn, "train.input_fn", f"in its num_files({split!r})"):
            return int(counter(split))

    def validate(self) -> None:
        """Raises UserError now, before anything is written, if any split the run needs is unusable."""
        if validate := getattr(self.input_fn, "validate", None):
            with user_function(self.input_fn, "train.input_fn", "in its validate()"):
                validate()
        counts_itself = getattr(self.input_fn, "num_examples", None) is not None
        for split in self._saying_progress(("train", *self.eval_splits), "checking the splits of train.input_fn"):
            with tf.init_scope():
                dataset = self.examples(split)
                # A size tf.data knows is kept now: counting thousands of splits would make each dataset again.
                if not counts_itself and (count := int(dataset.cardinality())) >= 0:
                    self._counts.setdefault(split, count)

    def _saying_progress(self, splits: Sequence[str], doing: str) -> Iterator[str]:
        """The splits, with a progress line every COUNT_PROGRESS_SECONDS while going through them takes long
        (thousands of train.eval_splits): a start that takes minutes is never silent."""
        next_line = time.monotonic() + COUNT_PROGRESS_SECONDS
        for done, split in enumerate(splits, 1):
            yield split
            if self.print_fn is not None and done < len(splits) and (now := time.monotonic()) > next_line:
                self.print_fn(f"{doing}: {done} of {len(splits)} splits")
                next_line = now + COUNT_PROGRESS_SECONDS

    def check_sizes(self, global_batch_size: int) -> None:
        """Refuses data that cannot make one training batch or has nothing to evaluate."""
        num_train = self.num_examples("train")
        if num_train < global_batch_size:
            raise UserError(
                f"the train split has {num_train} examples, fewer than one global batch of "
                f"{global_batch_size}: add data or lower train.global_batch_size"
            )
        for split in self._saying_progress(self.eval_splits, "counting the examples of train.eval_splits"):
            if self.num_examples(split) == 0:
                raise UserError(
                    f"the {split} split has no examples: add {split} data (e.g. the eval files of tfrecord_files)"
                )

    def train_arrays(self, input_context: tf.distribute.InputContext | None = None) -> tuple[Any, Shard | None] | None:
        """The train examples as numpy arrays and the shard still to keep from them by index; None where too big
        or of unknown count (those stream). A function that shards itself is held per shard, any other whole."""
        shard = shard_of(input_context)
        if arrays := getattr(self.input_fn, "arrays", None):
            held = arrays("train")  # None: too big to hold (TFRecord files over their budget)
            return None if held is None else (held, shard)
        key = shard if self.shards_itself else None
        if key not in self._memory:
            with tf.init_scope():  # materialized eagerly even where a dataset function is traced
                self._memory[key] = self._materialize(input_context if self.shards_itself else None)
        held = self._memory[key]
        return None if held is None else (held, None if self.shards_itself else shard)

    def _materialize(self, input_context: tf.distribute.InputContext | None) -> Any:
        dataset = self.examples("train", input_context)
        if sequences.is_variable(dataset.element_spec):
            return self._materialize_sequences(dataset)
        count, size = int(dataset.cardinality()), _example_bytes(dataset.element_spec)
        if count < 0 or size is None or size * count > MAX_IN_MEMORY_BYTES:
            return None
        if count == 0:
            return tf.nest.map_structure(
                lambda s: np.zeros((0, *s.shape), s.dtype.as_numpy_dtype), dataset.element_spec
            )
        return tf.nest.map_structure(lambda t: t.numpy(), dataset.batch(count).get_single_element())

    def _materialize_sequences(self, dataset: tf.data.Dataset) -> Any:
        """Examples of any length held padded to the longest of all with each one's shapes, a gathered batch cut
        to its own longest (the held data's `decode_batch`); None where the split streams (as `_materialize`)."""
        count = int(dataset.cardinality())
        strings = any(leaf.dtype == tf.string for leaf in tf.nest.flatten(dataset.element_spec))
        if count <= 0 or getattr(self.input_fn, "decode_batch", None) is not None or strings:
            return None
        held = sequences.hold(dataset, count, self.sequences)
        if sum(array.nbytes for array in tf.nest.flatten(held)) > MAX_IN_MEMORY_BYTES:
            return None
        spec = self.element_spec
        self.decode_batch = sequences.trimmer(spec)
        if self.sequences.bucketing:
            lengths = sequences.lengths_of(held, spec, self.sequences)
            self.bucket_keys = sequences.bucket_keys(lengths, self.sequences)
        return held


@tf.autograph.experimental.do_not_convert
def _one(*_: Any) -> tf.Tensor:
    return tf.constant(1, tf.int8)


@tf.autograph.experimental.do_not_convert
def _batch_size(*batch: Any) -> tf.Tensor:
    return tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]


def _leaves(spec: Any, path: str = "") -> list[tuple[str, Any]]:
    """(where, leaf) of a nested spec, `where` naming the leaf's path (`[0]['ids']`) for error messages."""
    if isinstance(spec, dict):
        return [leaf for key in sorted(spec) for leaf in _leaves(spec[key], f"{path}[{key!r}]")]
    if isinstance(spec, (tuple, list)):
        return [leaf for i, part in enumerate(spec) for leaf in _leaves(part, f"{path}[{i}]")]
    return [(path or "the top level", spec)]


def as_input(
    x: "Input | InputFunction",
    eval_splits: Sequence[str] = ("eval",),
    sequences: "sequences.SequenceBatching | None" = None,
) -> Input:
    return x if isinstance(x, Input) else Input(x, eval_splits=eval_splits, sequences=sequences)


def check_sizes(source: "Input | InputFunction", global_batch_size: int) -> None:
    as_input(source).check_sizes(global_batch_size)
