"""Examples of any length: features of unknown dimensions (`(None,)` token ids, `(None, d)` frames) or
`tf.RaggedTensor` features, batched to the longest example of each global batch, and, optionally, bucketed by
length so that a batch holds examples of similar length.

Padding changes shapes, never which examples a batch holds: per-batch padding keeps the one global order
(trainer/data/order.py) as it is. Bucketing reorders within windows of that order: window w is global batches
`[w * K, (w + 1) * K)` (K = `bucket_window`); its examples are sorted by length (stable, so ties keep the
order), cut into K global batches of `global_batch_size` examples each, and those K batches are trained in
an order drawn from (seed, window). Global batch i is a pure function of (seed, i), so a resumed run trains
exactly the batches the uninterrupted run would have; every global batch keeps its size, so the loss scaling
and the replica split are those of unbucketed training.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from trainer.data import order
from trainer.errors import UserError
from trainer.validation import check_int

Path = tuple[Any, ...]  # keys and indices into an example, outermost first


@dataclasses.dataclass(frozen=True)
class SequenceBatching:
    """How examples of any length are batched (gin: `train.sequences = @sequences()`).

    Attributes:
      padding_values: what pads a feature past its example's end: None (0, or '' for strings), one number
        for every feature, or the example's structure with a value (or None) per feature.
      bucket_window: global batches per bucketing window (module doc); 0: no bucketing, every batch padded
        to its own longest example in the order as it is.
      bucket_boundaries: with bucketing, lengths grouped as `tf.data.Dataset.bucket_by_sequence_length`
        groups them (bucket i holds lengths below boundary i, the last those from the last boundary on), in
        the order within a bucket; None: sorted by exact length.
      length_feature: the feature whose first dimension is the example's length, as a path of keys and
        indices into the example (`0`, `'tokens'`, `(0, 'tokens')`); None: the first feature of unknown
        length.
    """

    padding_values: Any = None
    bucket_window: int = 0
    bucket_boundaries: Sequence[int] | None = None
    length_feature: Any = None

    def __post_init__(self) -> None:
        check_int("sequences.bucket_window", self.bucket_window, minimum=0)
        boundaries = self.bucket_boundaries
        if boundaries is not None:
            if (
                isinstance(boundaries, (str, bytes))
                or not isinstance(boundaries, Sequence)
                or not boundaries
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in boundaries)
                or any(b >= c for b, c in zip(boundaries, boundaries[1:]))
            ):
                raise UserError(
                    f"sequences.bucket_boundaries must be positive lengths in increasing order, each above the "
                    f"one before (e.g. [8, 16, 32]), got {boundaries!r}"
                )
            if not self.bucket_window:
                raise UserError(
                    "sequences.bucket_boundaries are set but sequences.bucket_window is 0 (no bucketing): set "
                    "bucket_window to the global batches bucketed together (e.g. 16), or drop the boundaries"
                )
            object.__setattr__(self, "bucket_boundaries", tuple(boundaries))

    @property
    def bucketing(self) -> bool:
        return self.bucket_window > 0


def is_variable(spec: Any) -> bool:
    """Whether any feature of an example spec is ragged or of unknown shape."""
    return any(
        isinstance(leaf, tf.RaggedTensorSpec) or not leaf.shape.is_fully_defined() for leaf in tf.nest.flatten(spec)
    )


def dense_spec(spec: Any) -> Any:
    """The spec of an example after `dense`: ragged features as dense ones of their shape."""
    return tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape, s.dtype), spec)


def _leaf_paths(spec: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    if isinstance(spec, dict):
        return [leaf for key in sorted(spec) for leaf in _leaf_paths(spec[key], (*path, key))]
    if isinstance(spec, (tuple, list)):
        return [leaf for i, part in enumerate(spec) for leaf in _leaf_paths(part, (*path, i))]
    return [(path, spec)]


def _named(path: Path) -> str:
    return "".join(f"[{p!r}]" for p in path) or "the top level"


def padding_structure(spec: Any, config: SequenceBatching, where: str) -> Any:
    """`padding_values` as the example's structure of scalars of each feature's dtype; a UserError line for a
    value of the wrong structure or dtype."""
    values = config.padding_values
    if values is None or isinstance(values, (int, float, str, bytes)) and not isinstance(values, bool):
        # One value for every feature that is padded; a fixed-shape feature (a string key) is never padded.
        values = tf.nest.map_structure(lambda leaf: values if not _fixed(leaf) else None, spec)
    else:
        try:
            tf.nest.assert_same_structure(spec, values, check_types=False)
        except (TypeError, ValueError):
            raise UserError(
                f"sequences.padding_values {config.padding_values!r} is not in the structure of {where}'s "
                f"examples {dense_spec(spec)}: give one number for every feature, or a value (or None) per "
                "feature in that structure"
            ) from None
    padding = [
        _padding_value(value, leaf, path) for (path, leaf), value in zip(_leaf_paths(spec), tf.nest.flatten(values))
    ]
    return tf.nest.pack_sequence_as(spec, padding)


def _fixed(leaf: Any) -> bool:
    return isinstance(leaf, tf.TensorSpec) and leaf.shape.is_fully_defined()


def _padding_value(value: Any, leaf: Any, path: Path) -> tf.Tensor:
    dtype = leaf.dtype
    if value is None:
        return tf.constant("" if dtype == tf.string else False if dtype == tf.bool else 0, dtype)
    if dtype == tf.string:
        fits = isinstance(value, (str, bytes))
    elif dtype == tf.bool:
        fits = isinstance(value, bool)
    elif isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        fits = dtype.is_floating or dtype.is_complex or float(value).is_integer() and dtype.min <= value <= dtype.max
    else:
        fits = False
    if not fits:
        example = "''" if dtype == tf.string else "False" if dtype == tf.bool else "0"
        raise UserError(
            f"sequences.padding_values gives {value!r} for the feature at {_named(path)}, which is {dtype.name}: "
            f"give a value of that type (e.g. {example}), or None for the default"
        )
    return tf.constant(value, dtype)


def length_path(spec: Any, config: SequenceBatching, where: str) -> Path:
    """The path of the feature whose first dimension is an example's length (`length_feature`); a UserError
    line where it names no feature, or one that is not a sequence."""
    leaves = _leaf_paths(spec)
    wanted = config.length_feature
    if wanted is None:  # the first feature of unknown length, else the first of unknown shape
        variable = [path for path, leaf in leaves if leaf.shape.rank and leaf.shape[0] is None]
        variable += [path for path, leaf in leaves if leaf.shape.rank and not _fixed(leaf)]
        return variable[0] if variable else leaves[0][0]
    path = tuple(wanted) if isinstance(wanted, (tuple, list)) else (wanted,)
    found = dict(leaves).get(path)
    if found is None:
        raise UserError(
            f"sequences.length_feature {wanted!r} names no feature of {where}'s examples (they have "
            f"{', '.join(_named(p) for p, _ in leaves)}): name one as a key, an index or a path (0, 'tokens')"
        )
    if not found.shape.rank:
        raise UserError(
            f"sequences.length_feature {wanted!r} is a scalar ({found.dtype.name}), not a sequence: name a feature "
            "whose first dimension is the example's length (token ids of shape (None,), frames (None, d))"
        )
    return path


def check(spec: Any, config: SequenceBatching, where: str) -> None:
    """Refuses, in one line each, what cannot batch: features of unknown rank, and the config's mistakes."""
    for path, leaf in _leaf_paths(spec):
        if leaf.shape.rank is None:
            raise UserError(
                f"{where} returned examples of unknown rank at {_named(path)}: give each feature a known number "
                "of dimensions (tf.ensure_shape(x, [None]) for a sequence)"
            )
    padding_structure(spec, config, where)
    if config.bucketing and not is_variable(spec):
        raise UserError(
            f"sequences.bucket_window is {config.bucket_window}, but every feature of {where}'s examples has a "
            "fixed shape: bucketing groups examples of unknown length; set bucket_window to 0"
        )
    if config.bucketing:
        length_path(spec, config, where)


def dense(example: Any, padding: Any) -> Any:
    """The example with each ragged feature as a dense tensor, padded with its padding value."""
    return tf.nest.map_structure(
        lambda t, pad: t.to_tensor(default_value=pad) if isinstance(t, tf.RaggedTensor) else t,
        example,
        padding,
        expand_composites=False,
    )


def _mapped(dataset: tf.data.Dataset, fn: Callable[[Any], Any]) -> tf.data.Dataset:
    spec = dataset.element_spec
    wrapped = (lambda *parts: fn(parts)) if type(spec) is tuple else fn
    return dataset.map(tf.autograph.experimental.do_not_convert(wrapped))


def dense_examples(dataset: tf.data.Dataset, config: SequenceBatching) -> tf.data.Dataset:
    """`dataset` with ragged features made dense (a dataset without any, as it is)."""
    spec = dataset.element_spec
    if not any(isinstance(leaf, tf.RaggedTensorSpec) for leaf in tf.nest.flatten(spec)):
        return dataset
    padding = padding_structure(spec, config, "the input function")
    return _mapped(dataset, lambda example: dense(example, padding))


def batched(dataset: tf.data.Dataset, batch_size: int, padding: Any, *, drop_remainder: bool) -> tf.data.Dataset:
    """Batches of dense examples, each padded to its longest example where any feature has unknown dimensions."""
    if is_variable(dataset.element_spec):
        return dataset.padded_batch(batch_size, padding_values=padding, drop_remainder=drop_remainder)
    return dataset.batch(batch_size, drop_remainder=drop_remainder)


def stream_batches(examples: tf.data.Dataset, batch_size: int, seed: int, config: SequenceBatching) -> tf.data.Dataset:
    """Full batches of a stream of examples: as they come, each padded to its longest example, or bucketed."""
    examples = dense_examples(examples, config)
    if config.bucketing and is_variable(examples.element_spec):
        return bucketed_stream(examples, batch_size, seed, config)
    padding = padding_structure(examples.element_spec, config, "the input function")
    return batched(examples, batch_size, padding, drop_remainder=True)


def bucketing_of(keys: np.ndarray | None, batch_size: int, seed: int, config: SequenceBatching) -> "Bucketing | None":
    """The bucketed order of held examples with `keys` (`Input.bucket_keys`), None without bucketing."""
    return Bucketing(keys, batch_size, seed, config.bucket_window) if config.bucketing and keys is not None else None


def per_replica_shape(batch: tf.Tensor, replicas: int) -> Any:
    """The shape that splits a global batch along a new first axis of `replicas`: static where the example's
    shape is, else from the batch (examples of any length, padded per batch)."""
    if batch.shape[1:].is_fully_defined():
        return [replicas, -1, *batch.shape[1:]]
    return tf.concat([[replicas, -1], tf.shape(batch)[1:]], 0)


def shapes(example: Any, spec: Any) -> tuple[tf.Tensor, ...]:
    """The shape (int32) of each feature of unknown shape, in flattened order: what `trimmed` cuts a padded
    batch to (none for a fixed-shape feature: a gather of an empty array is not safe in every kernel)."""
    return tuple(
        tf.shape(t, out_type=tf.int32)
        for t, leaf in zip(tf.nest.flatten(example), tf.nest.flatten(spec))
        if not _fixed(leaf)
    )


def _shape_index(spec: Any, path: Path) -> int | None:
    """Where `shapes` holds the shape of the feature at `path` (None: it has a fixed shape)."""
    variable = [p for p, leaf in _leaf_paths(spec) if not _fixed(leaf)]
    return variable.index(path) if path in variable else None


def trimmer(spec: Any) -> Callable[..., Any]:
    """`trimmed` of a held batch, whether a map passes it whole or as its two parts (`Dataset.map` unpacks a
    tuple): the `decode_batch` of examples held padded."""

    @tf.autograph.experimental.do_not_convert
    def decode(*parts: Any) -> Any:
        return trimmed(spec, parts[0] if len(parts) == 1 else parts)

    return decode


def trimmed(spec: Any, held: tuple[Any, Any]) -> Any:
    """A batch of examples padded to a longer length than its own, `(examples, shapes)`, cut to the longest
    example of the batch in every dimension `spec` leaves unknown (the fixed ones keep their static size)."""
    examples, sizes = held
    sizes = iter(sizes)
    cut = []
    for t, leaf in zip(tf.nest.flatten(examples), tf.nest.flatten(spec), strict=True):
        if _fixed(leaf):
            cut.append(t)
            continue
        longest = tf.reduce_max(next(sizes), axis=0)
        cut.append(
            t[
                (slice(None),)
                + tuple(slice(None) if d is not None else slice(None, longest[i]) for i, d in enumerate(leaf.shape))
            ]
        )
    return tf.nest.pack_sequence_as(examples, cut)


def hold(dataset: tf.data.Dataset, count: int, config: SequenceBatching) -> tuple[Any, Any]:
    """The `count` examples of `dataset` as numpy arrays padded to the longest of all, and each example's shapes
    (`trimmed` cuts a gathered batch to its own longest)."""
    dataset = dense_examples(dataset, config)
    spec = dataset.element_spec
    padding = padding_structure(spec, config, "the input function")
    zeros = tuple(tf.constant(0, tf.int32) for leaf in tf.nest.flatten(spec) if not _fixed(leaf))
    with_shapes = _mapped(dataset, lambda example: (example, shapes(example, spec)))
    whole = with_shapes.padded_batch(count, padding_values=(padding, zeros)).get_single_element()
    return tf.nest.map_structure(lambda t: t.numpy(), whole)


def lengths_of(held: tuple[Any, Any], spec: Any, config: SequenceBatching) -> np.ndarray:
    """Each held example's length (the first dimension of `length_feature`), int64."""
    path = length_path(spec, config, "the input function")
    index = _shape_index(spec, path)
    if index is None:  # a fixed-length feature: every example alike
        return np.full(len(tf.nest.flatten(held[0])[0]), dict(_leaf_paths(spec))[path].shape[0], np.int64)
    return held[1][index][:, 0].astype(np.int64)


def bucket_keys(lengths: np.ndarray, config: SequenceBatching) -> np.ndarray:
    """What bucketing sorts by: the length itself, or its bucket among `bucket_boundaries`."""
    if config.bucket_boundaries is None:
        return lengths
    return np.searchsorted(np.asarray(config.bucket_boundaries), lengths, side="right").astype(np.int64)


class Bucketing:
    """The positions of global batch i in a bucketed order (module doc) of examples with `keys`."""

    def __init__(self, keys: np.ndarray, batch_size: int, seed: int, window: int) -> None:
        self.keys = np.asarray(keys, np.int64)
        self.batch_size, self.seed, self.window = batch_size, seed, window

    def batch_positions(self, batch: tf.Tensor) -> tf.Tensor:
        """The `[batch_size]` positions (int64) of the order that global batch `batch` trains on."""
        size, window = self.batch_size, self.window
        batch = tf.cast(batch, tf.int64)
        number, slot = batch // window, batch % window
        positions = number * window * size + tf.range(window * size, dtype=tf.int64)
        keys = tf.gather(tf.constant(self.keys), order.example_indices(positions, len(self.keys), self.seed))
        ordered = tf.gather(positions, tf.argsort(keys, stable=True))
        # The window's batches in an order drawn from (seed, window): short and long batches interleave.
        chosen = tf.raw_ops.RandomIndexShuffle(
            index=slot,
            seed=tf.stack([tf.constant(self.seed, tf.int64), number, tf.constant(1, tf.int64)]),
            max_index=tf.constant(window - 1, tf.int64),
            rounds=order.ROUNDS,
        )
        return tf.reshape(ordered[chosen * size : (chosen + 1) * size], [size])


def bucketed_stream(examples: tf.data.Dataset, batch_size: int, seed: int, config: SequenceBatching) -> tf.data.Dataset:
    """Endless bucketed batches of an endless stream of dense examples: each window of `bucket_window` batches
    read, sorted by length, cut and trained in an order drawn from (seed, window), as in `Bucketing`."""
    spec = examples.element_spec
    padding = padding_structure(spec, config, "the input function")
    index = _shape_index(spec, length_path(spec, config, "the input function"))
    window = config.bucket_window
    zeros = tuple(tf.constant(0, tf.int32) for leaf in tf.nest.flatten(spec) if not _fixed(leaf))
    boundaries = tf.constant(config.bucket_boundaries or [0], tf.int32)
    with_shapes = _mapped(examples, lambda example: (example, shapes(example, spec)))
    windows = with_shapes.padded_batch(window * batch_size, padding_values=(padding, zeros), drop_remainder=True)

    @tf.autograph.experimental.do_not_convert
    def cut(number, held):
        if index is None:  # a fixed-length feature: nothing to sort by
            lengths = tf.zeros([window * batch_size], tf.int32)
        else:
            lengths = held[1][index][:, 0]
        keys = lengths if config.bucket_boundaries is None else tf.searchsorted(boundaries, lengths, side="right")
        ordered = tf.nest.map_structure(lambda t: tf.gather(t, tf.argsort(keys, stable=True)), held)
        batches = tf.nest.map_structure(
            lambda t: tf.reshape(t, tf.concat([[window, batch_size], tf.shape(t)[1:]], 0)), ordered
        )
        slots = tf.raw_ops.RandomIndexShuffle(
            index=tf.range(window, dtype=tf.int64),
            seed=tf.tile([[tf.constant(seed, tf.int64), number, tf.constant(1, tf.int64)]], [window, 1]),
            max_index=tf.fill([window], tf.constant(window - 1, tf.int64)),
            rounds=order.ROUNDS,
        )
        # Batch k of the window is cut slots[k], as `Bucketing.batch_positions` draws it.
        batches = tf.nest.map_structure(lambda t: tf.gather(t, slots), batches)
        return tf.data.Dataset.from_tensor_slices(batches).map(
            tf.autograph.experimental.do_not_convert(lambda *b: trimmed(spec, b))
        )

    return windows.enumerate().flat_map(cut)
