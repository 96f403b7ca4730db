"""Batches of any input function's examples (any structure), in a deterministic, resumable order: the order
depends only on the seed, so a resumed run skips to exactly the batches it would have seen (docs/design.md,
rule 5), for input functions that are themselves deterministic."""

from typing import Any, Callable, Sequence

import tensorflow as tf

from trainer.data import order, sequences
from trainer.data.inputs import Input, InputFunction, Shard, as_input, shard_of
from trainer.errors import UserError

SHARD_POLICIES = {name: getattr(tf.data.experimental.AutoShardPolicy, name) for name in ("AUTO", "FILE", "DATA", "OFF")}
MAX_SHUFFLE_BUFFER = 10_000
GATHER_BATCHES = 8  # batches gathered from memory per call (see `gathered`)
INDEX_BATCHES = 8  # batches of example indices computed per call (see `shuffled_index_batches`)
MAX_GATHER_BYTES = 16 * 1024**2


def options(shard_policy: str) -> tf.data.Options:
    policy = SHARD_POLICIES.get(shard_policy.upper())
    if policy is None:
        raise UserError(f"unknown shard_policy {shard_policy!r}: use one of {', '.join(SHARD_POLICIES)}")
    result = tf.data.Options()
    result.deterministic = True
    result.experimental_distribute.auto_shard_policy = policy
    return result


def whole(fn: Callable[[Any], Any], spec: Any) -> Callable[..., Any]:
    """`fn` of one whole element, for `Dataset.map`, which passes a plain tuple's parts as arguments."""
    return graph_code((lambda *parts: fn(parts)) if type(spec) is tuple else fn)


def graph_code(fn: Callable) -> Callable:
    """`fn` traced without AutoGraph: the pipeline's own functions are plain TF ops, and converting each costs
    start-up time (trainer/task/user_code.py)."""
    return tf.autograph.experimental.do_not_convert(fn)


def train_dataset(
    inp: Input | InputFunction,
    batch_size: int,
    seed: int,
    *,
    shard_policy: str = "AUTO",
    skip_batches: int = 0,
    drop_batches: Sequence[int] = (),
    input_context: tf.distribute.InputContext | None = None,
) -> tf.data.Dataset:
    """Endless shuffled batches, deterministic by seed, starting at batch `skip_batches` (counted among those
    kept). `drop_batches` are indices (in the unskipped stream) never to train on, such as one that made the
    loss non-finite. Data held in memory is shuffled a whole epoch at a time (`shuffled_index_batches`), any
    other streams through a shuffle buffer. With `input_context`, only that pipeline's shard."""
    inp = as_input(inp)
    dataset_options = options(shard_policy)
    drop_batches = sorted(set(drop_batches))
    first = _raw_batch_index(skip_batches, drop_batches)
    held = held_train(inp, shard_policy, input_context)
    bucketing = None
    if held is not None:
        arrays, shard = held
        keys = inp.bucket_keys if inp.bucket_keys is None or not shard else inp.bucket_keys[shard[1] :: shard[0]]
        bucketing = sequences.bucketing_of(keys, batch_size, seed, inp.sequences)
        dataset = shuffled_index_batches(
            len(tf.nest.flatten(arrays)[0]), batch_size, seed, first_batch=first, shard=shard, bucketing=bucketing
        )
    else:
        buffer = min(inp.num_examples("train"), MAX_SHUFFLE_BUFFER)
        dataset = inp.examples("train", input_context)
        if not inp.shards_itself and (shard := shard_of(input_context)):
            dataset = dataset.shard(*shard)
        dataset = dataset.shuffle(buffer, seed=seed, reshuffle_each_iteration=True).repeat()
        dataset = sequences.stream_batches(dataset, batch_size, seed, inp.sequences).skip(first)
    dropped = tf.constant([b for b in drop_batches if b >= first], tf.int64)
    kept = graph_code(lambda i, *_: tf.reduce_all(tf.not_equal(i, dropped)))
    if dropped.shape[0]:
        dataset = dataset.enumerate(start=first).filter(kept)
        dataset = dataset.map(graph_code(lambda _, batch: batch))
    if held is not None:
        dataset = gathered(dataset, held[0], batch_size)
        if inp.decode_batch is not None:  # serialized records: parsed a batch at a time, as they stream
            dataset = dataset.map(inp.decode_batch, **parallel_calls())
    if inp.augment is not None:  # seeded by each example's position: the batch numbers kept, alongside
        numbers = tf.data.Dataset.counter(first).filter(kept) if dropped.shape[0] else tf.data.Dataset.counter(first)
        positions = bucketing.batch_positions if bucketing else lambda number: order.batch_positions(number, batch_size)
        augment = graph_code(lambda batch, number: order.augment_batch(batch, inp.augment, positions(number), seed))
        dataset = tf.data.Dataset.zip((dataset, numbers)).map(augment)
    return prefetch_for_accelerators(dataset).with_options(dataset_options)


def held_train(
    inp: Input, shard_policy: str = "AUTO", input_context: tf.distribute.InputContext | None = None
) -> tuple[Any, Shard | None] | None:
    """The train split held in memory (`Input.train_arrays`), None where it streams: too big, of unknown size,
    or in files that shard_policy 'FILE' asks each worker to read its own of."""
    if shard_policy.upper() == "FILE" and (inp.num_files("train") or 0) > 1:
        return None
    return inp.train_arrays(input_context)


def gathered(index_batches: tf.data.Dataset, arrays: Any, batch_size: int) -> tf.data.Dataset:
    """The batches of `arrays` (equally long arrays of any structure) at each batch of indices, in order.

    Up to GATHER_BATCHES batches are gathered per map call and handed out one by one, which halves the
    pipeline's cost per batch (measured: 100 -> 50 us); the order is that of one batch per call.
    """
    tensors = tf.nest.map_structure(tf.constant, arrays)
    batch_bytes = batch_size * sum(t.dtype.size * t.shape[1:].num_elements() for t in tf.nest.flatten(tensors))
    chunk = max(1, min(GATHER_BATCHES, MAX_GATHER_BYTES // max(1, batch_bytes)))

    @graph_code
    def gather(index):
        return tf.nest.map_structure(lambda t: tf.gather(t, index), tensors)

    if chunk == 1:
        return index_batches.map(gather)
    return index_batches.batch(chunk).map(gather).unbatch()


def on_accelerator() -> bool:
    return any(tf.config.list_logical_devices(kind) for kind in ("GPU", "TPU"))


def prefetch_for_accelerators(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Prefetches where the steps run on an accelerator. Where the CPU is the device, the step keeps every core
    busy and a prefetch thread only takes cores from it (measured on 2 cores: 5% more steps/s without)."""
    return dataset.prefetch(tf.data.AUTOTUNE) if on_accelerator() else dataset


def parallel_calls() -> dict[str, Any]:
    """Keywords for the sources' `interleave` and `map`: parallel on an accelerator, else none (on a CPU they
    cost the step's cores: measured 274k -> 201k examples/s). `deterministic=True`: exact resume needs the order."""
    return {"num_parallel_calls": tf.data.AUTOTUNE, "deterministic": True} if on_accelerator() else {}


def _raw_batch_index(skip_batches: int, drop_batches: Sequence[int]) -> int:
    """The index in the unfiltered stream of the first batch after `skip_batches` kept ones."""
    raw = skip_batches
    for dropped in drop_batches:  # sorted
        if dropped <= raw:
            raw += 1
    return raw


def shuffled_index_batches(
    num_examples: int,
    batch_size: int,
    seed: int,
    *,
    first_batch: int = 0,
    shard: Shard | None = None,
    bucketing: sequences.Bucketing | None = None,
) -> tf.data.Dataset:
    """Endless `[batch_size]` int64 batches of example indices, from batch `first_batch` on.

    Batch i holds positions `[i * batch_size, (i + 1) * batch_size)` of the one global order
    (`order.example_indices`: epoch e a permutation keyed by (seed, e)); batches run across epoch boundaries,
    as in `shuffle().repeat().batch()`, but a batch costs one vectorized op instead of `batch_size` trips
    through a shuffle buffer, and a resumed run starts at its batch without replaying those before it.
    `shard` keeps every n-th example (the examples of one input pipeline) and orders those. `bucketing`
    takes each batch's positions from a bucketed order (trainer/data/sequences.py) instead.
    """
    ids = tf.range(num_examples, dtype=tf.int64)
    if shard:
        ids = ids[shard[1] :: shard[0]]
    count = int(ids.shape[0])
    if count == 0:
        raise UserError(
            f"input pipeline {shard} of {num_examples} training examples holds none: use fewer workers or more data"
        )

    @graph_code
    def indices(batch):  # INDEX_BATCHES batches from `batch` on, in one op: the op's call is most of its cost
        positions = batch * batch_size + tf.range(INDEX_BATCHES * batch_size, dtype=tf.int64)
        ordered = tf.reshape(order.example_indices(positions, count, seed), [INDEX_BATCHES, batch_size])
        return tf.gather(ids, ordered) if shard else ordered

    if bucketing is not None:

        @graph_code
        def bucketed(batch):
            ordered = order.example_indices(bucketing.batch_positions(batch), count, seed)
            return tf.gather(ids, ordered) if shard else ordered

        return tf.data.Dataset.counter(first_batch).map(bucketed)
    return tf.data.Dataset.counter(first_batch, INDEX_BATCHES).map(indices).unbatch()


def with_weight(example: Any, weight: float | tf.Tensor) -> tuple:
    """A tuple example `(x, y)` as `(x, y, w)`, any other example as `(example, w)`."""
    weight = tf.constant(weight, tf.float32)
    return (*example, weight) if type(example) is tuple else (example, weight)


def eval_dataset(
    inp: Input | InputFunction,
    batch_size: int,
    *,
    split: str = "eval",
    pad_to_multiple_of: int | None = None,
    shard_policy: str = "AUTO",
    input_context: tf.distribute.InputContext | None = None,
    batches: tuple[Any, Any] | None = None,
) -> tf.data.Dataset:
    """Every example of `split` once, weight 1.0 appended (`with_weight`), batched, the last batch partial.

    Examples of any length are padded to the longest of each batch (trainer/data/sequences.py).
    Padding to a multiple of `pad_to_multiple_of` gives every worker and replica the same number of batches,
    so collectives cannot hang; so the padded examples are sharded, never the files. The padding is copies of
    the split's first examples with weight 0, never zeros: a model may be NaN on an all-zero example (a masked
    mean of no tokens is 0/0), and the steps exclude weight-0 rows with a select (`steps.weighted_sum`).
    `batches=(first, count)` (ints or tensors; unpadded) keeps those batches alone, skipping the examples
    before them unread by the map: a part of the pass run apart (trainer/loops/ps_eval.py).
    """
    inp = as_input(inp)
    dataset_options = options(shard_policy)
    examples = source = sequences.dense_examples(inp.examples(split), inp.sequences)
    spec = examples.element_spec
    if batches is not None:
        first, count = batches
        examples = examples.skip(first * batch_size).take(count * batch_size)
    dataset = examples.map(whole(lambda example: with_weight(example, 1.0), spec), num_parallel_calls=tf.data.AUTOTUNE)
    padding = -inp.num_examples(split) % pad_to_multiple_of if pad_to_multiple_of else 0
    if padding:
        copies = source.repeat().take(padding)
        dataset = dataset.concatenate(copies.map(whole(lambda example: with_weight(example, 0.0), spec)))
    if shard := shard_of(input_context):
        dataset = dataset.shard(*shard)
    padding = with_weight(sequences.padding_structure(spec, inp.sequences, inp.name), 0.0)
    dataset = sequences.batched(dataset, batch_size, padding, drop_remainder=False)
    return prefetch_for_accelerators(dataset).with_options(dataset_options)
