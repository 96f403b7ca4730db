"""Training and eval data for a strategy (docs/design.md, rules 4 and 5): global batches for
`experimental_distribute_dataset` ('dataset'); per-replica batches for `distribute_datasets_from_function`
('function'), cut from the same global batches unless each pipeline reads its own files; or, with a tf.data
service, per-replica batches its data workers make (trainer/data/service.py)."""

import functools
from typing import Sequence

import numpy as np
import tensorflow as tf

from trainer import internals
from trainer.data import sequences
from trainer.data import service as data_service
from trainer.data.inputs import Input, InputFunction, as_input
from trainer.data.pipeline import eval_dataset, held_train, prefetch_for_accelerators, train_dataset, whole
from trainer.errors import UserError


def num_workers(strategy: tf.distribute.Strategy) -> int:
    if count := internals.strategy_worker_count(strategy):
        return int(count)
    if resolver := getattr(strategy, "cluster_resolver", None):
        jobs = resolver.cluster_spec().as_dict()
        return max(1, len(jobs.get("worker", ())) + len(jobs.get("chief", ())))
    return 1


def check_input(strategy: tf.distribute.Strategy, inp: Input, split: str, method: str, shard_policy: str) -> None:
    """Catches, before any step, the input settings that fail or hang later (file checks need `num_files`)."""
    if method not in ("dataset", "function"):
        raise UserError(f"unknown input method {method!r}: use 'dataset' or 'function'")
    files = inp.num_files(split)
    if files is None:
        return
    workers, policy = num_workers(strategy), shard_policy.upper()
    if policy == "FILE" and files < workers:
        raise UserError(
            f"FILE sharding needs at least as many files ({files}) as workers ({workers}): write more shards "
            "with `python -m trainer.write_tfrecords --num_shards=...` or set shard_policy to DATA"
        )
    # Eval files sharded across workers give them different batch counts; their collectives then hang.
    if (
        split != "train"
        and method == "dataset"
        and workers > 1
        and (policy == "FILE" or policy == "AUTO" and files > 1)
    ):
        raise UserError(
            f"{split} with shard_policy {shard_policy} may shard by file and hang {workers} workers: "
            f"set the {split} shard_policy to DATA"
        )


def shards_by_file(source: Input | InputFunction, shard_policy: str, context: tf.distribute.InputContext) -> bool:
    """Whether each input pipeline reads its own part of the train data ('function' method): with FILE, and
    with AUTO where there is a file per pipeline and the files are not held in memory (held, every pipeline
    gathers the global batches by index); otherwise every pipeline reads all and keeps its slices."""
    if context.num_input_pipelines <= 1:
        return False
    inp = as_input(source)
    policy, files = shard_policy.upper(), inp.num_files("train")
    if policy == "FILE":
        return True
    return policy == "AUTO" and files is not None and files >= context.num_input_pipelines and not held_train(inp)


def replica_slices(dataset: tf.data.Dataset, context: tf.distribute.InputContext) -> tf.data.Dataset:
    """This pipeline's replicas' slices of global batches, in order: replica r trains on slice r of global
    batch s, as with `experimental_distribute_dataset`, so results do not depend on how work is split."""
    replicas = context.num_replicas_in_sync
    per_pipeline = replicas // context.num_input_pipelines
    first = context.input_pipeline_id * per_pipeline

    def split(batch):
        chunks = tf.nest.map_structure(
            lambda t: tf.reshape(t, sequences.per_replica_shape(t, replicas))[first : first + per_pipeline], batch
        )
        return tf.data.Dataset.from_tensor_slices(chunks)

    return prefetch_for_accelerators(dataset.flat_map(whole(split, dataset.element_spec)))


def distribute_train(
    strategy: tf.distribute.Strategy,
    inp: Input | InputFunction,
    global_batch_size: int,
    seed: int,
    *,
    method: str = "dataset",
    shard_policy: str = "AUTO",
    skip_steps: int = 0,
    drop_batches: Sequence[int] = (),
    held_steps: int | None = None,
    service: data_service.DataServiceConfig | None = None,
    model_dir: str | None = None,
) -> tf.distribute.DistributedDataset:
    """The training data for `strategy`, resumed after `skip_steps` global steps (see `train_dataset`); with
    `held_steps`, only the batches of that many steps, `held` (for Keras fit, trainer.parity); with a
    `service`, read from it (`served_train`: no skip, no dropped batches)."""
    inp = as_input(inp)
    if service is not None:
        data_service.check_servable(inp)
        return served_train(strategy, inp, global_batch_size, seed, service, model_dir=model_dir)
    check_input(strategy, inp, "train", method, shard_policy)
    global_batches = functools.partial(
        train_dataset, inp, global_batch_size, seed, skip_batches=skip_steps, drop_batches=drop_batches
    )
    if method == "dataset":
        return strategy.experimental_distribute_dataset(held(global_batches(shard_policy=shard_policy), held_steps))

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        if not shards_by_file(inp, shard_policy, context):
            return replica_slices(held(global_batches(shard_policy="OFF"), held_steps), context)
        per_step = context.num_replicas_in_sync // context.num_input_pipelines  # this pipeline's batches per step
        dataset = train_dataset(
            inp,
            context.get_per_replica_batch_size(global_batch_size),
            seed,
            shard_policy=shard_policy,
            skip_batches=skip_steps * per_step,
            drop_batches=[s * per_step + k for s in drop_batches for k in range(per_step)],
            input_context=context,
        )
        return held(dataset, held_steps and held_steps * per_step)

    return strategy.distribute_datasets_from_function(dataset_fn)


def served_train(
    strategy: tf.distribute.Strategy,
    inp: Input | InputFunction,
    global_batch_size: int,
    seed: int,
    service: data_service.DataServiceConfig,
    *,
    model_dir: str | None,
) -> tf.distribute.DistributedDataset:
    """Per-replica train batches from the tf.data service, every input pipeline a reader of the run's one job.
    The service hands out its stream as it comes (no position to skip to): a resumed run reads on from
    where the job is, or from a fresh job's start (docs/parameter-servers.md). Called eagerly or, under
    parameter servers, inside each worker's dataset function: `check_servable` before either."""

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        batches = data_service.train_batches(
            inp, context.get_per_replica_batch_size(global_batch_size), service.shuffle_buffer, seed
        )
        return data_service.distribute(batches, service, model_dir=model_dir)

    return strategy.distribute_datasets_from_function(dataset_fn)


def held(dataset: tf.data.Dataset, count: int | None) -> tf.data.Dataset:
    """The first `count` batches (all with None), read once and held: Keras fit iterates its data more than
    once, and a streamed source's shuffle buffer reshuffles on every iteration."""
    if count is None:
        return dataset
    batches = list(dataset.take(count).as_numpy_iterator())
    stacked = tf.nest.map_structure(lambda *parts: np.stack(parts), *batches)
    return tf.data.Dataset.from_tensor_slices(stacked).with_options(dataset.options())


def distribute_eval(
    strategy: tf.distribute.Strategy,
    inp: Input | InputFunction,
    global_batch_size: int,
    *,
    split: str = "eval",
    method: str = "dataset",
    shard_policy: str = "AUTO",
) -> tf.distribute.DistributedDataset:
    """The `split` data for `strategy`, padded so every replica sees the same number of batches."""
    inp = as_input(inp)
    check_input(strategy, inp, split, method, shard_policy)
    padded = functools.partial(
        eval_dataset, inp, split=split, pad_to_multiple_of=global_batch_size, shard_policy=shard_policy
    )
    if method == "dataset":
        return strategy.experimental_distribute_dataset(padded(global_batch_size))
    return strategy.distribute_datasets_from_function(
        lambda context: padded(context.get_per_replica_batch_size(global_batch_size), input_context=context)
    )
