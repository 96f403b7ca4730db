"""The two sides of a parity run, built from the gin-bound `train` parameters.

Our side is the real thing: the configured model, optimizer and step in `TrainLoop` on
the real input pipeline, one step per call. The Keras side is `fit` from the same initial
weights on the same batches in the same order, with a fresh optimizer from the same
`optimizer_fn`, `steps_per_execution=1` and `SparseCategoricalCrossentropy(from_logits=True)`
(the loss of `classification_step`, which, like fit, adds `model.losses`).

This module is written against the `keras` module, so that the tf_keras side of the
multi-worker comparison can run it in a process where `keras` is tf_keras.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from trainer.distribution import cluster, devices, strategies
from trainer import data
from trainer.errors import UserError


@dataclasses.dataclass(frozen=True)
class Settings:
    """The `train` parameters a parity run uses, as the gin config binds them."""

    global_batch_size: int
    seed: int
    total_steps: int
    step_fn: Callable
    model_fn: Callable
    optimizer_fn: Callable
    data_source: data.DataSource
    strategy: str
    device_config: devices.DeviceConfig
    cluster_resolver: str
    cluster_resolver_options: dict
    collective_timeout_secs: float | None
    distribute_method: str
    shard_policy: str
    eval_step_fn: Callable
    steps_per_loop: int
    jit_compile: bool = False
    mixed_precision: str | None = None
    parameter_server: object = None  # ps_loop.ParameterServerConfig, for strategy 'parameter_server'


def settings_from_gin() -> Settings:
    """The parsed gin config's `train` bindings over `train`'s own defaults."""
    import gin

    from trainer.core import train as train_lib

    params = {
        name: p.default for name, p in inspect.signature(train_lib.train).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    params.update(gin.get_bindings("train"))
    fields = {f.name for f in dataclasses.fields(Settings)}
    params = {k: v for k, v in params.items() if k in fields}
    params.setdefault("cluster_resolver_options", {})
    params["cluster_resolver_options"] = params["cluster_resolver_options"] or {}
    params["data_source"] = params.get("data_source") or data.Digits()
    params["device_config"] = params.get("device_config") or devices.DeviceConfig()
    return Settings(**params)


def make_strategy(settings: Settings) -> tuple[tf.distribute.Strategy, bool]:
    """Devices, cluster and strategy as `train` sets them up; returns (strategy, is_chief)."""
    settings.data_source.validate()
    devices.configure_devices(settings.device_config)
    info = cluster.resolve(settings.strategy, settings.cluster_resolver, **settings.cluster_resolver_options)
    partitioner = getattr(settings.parameter_server, "variable_partitioner", None)
    dist = strategies.make_strategy(
        settings.strategy, cluster_resolver=info.resolver,
        collective_timeout_secs=settings.collective_timeout_secs,
        **({"variable_partitioner": partitioner} if partitioner else {}),
    )
    if settings.global_batch_size % dist.num_replicas_in_sync:
        raise UserError(f"train.global_batch_size {settings.global_batch_size} is not divisible by the "
                        f"{dist.num_replicas_in_sync} replicas")
    return dist, info.is_chief


def build(settings: Settings, dist: tf.distribute.Strategy, *, seed: bool = True, for_fit: bool = False):
    """Model and built optimizer under `dist.scope()` (rule 1), as `train` builds them.

    The global dtype policy is `train.mixed_precision` from here on (this process compares
    one config). Our side gets the optimizer as `train` wraps it (a LossScaleOptimizer under
    mixed_float16); fit's `compile` wraps its own.
    """
    from trainer.core import precision

    if seed:
        keras.utils.set_random_seed(settings.seed)
    policy = precision.set_global_policy(settings.mixed_precision)
    source = settings.data_source
    with dist.scope():
        model = settings.model_fn(source.input_shape, source.num_classes)
        optimizer = settings.optimizer_fn(global_batch_size=settings.global_batch_size,
                                          total_steps=settings.total_steps)
        if not for_fit:
            optimizer = precision.wrap_optimizer(optimizer, policy)
        optimizer.build(model.trainable_variables)
    return model, optimizer


def run_ours(settings: Settings, dist: tf.distribute.Strategy, model, optimizer, steps: int) -> list[float]:
    """`steps` steps of TrainLoop on the real pipeline, one per call; the loss of each."""
    from trainer.core.loop import TrainLoop

    with dist.scope():
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                  aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    dataset = data.distribute_train(
        dist, settings.data_source, settings.global_batch_size, settings.seed,
        method=settings.distribute_method, shard_policy=settings.shard_policy,
    )
    loop = TrainLoop(dist, model, optimizer, settings.step_fn, settings.global_batch_size, dataset, global_step,
                     jit_compile=settings.jit_compile)
    losses = []
    for _ in range(steps):
        outputs = loop.run(1)
        if "loss" not in outputs:
            raise UserError(f"the step returns {sorted(outputs)} but no 'loss'; parity compares the 'loss' "
                            "output with Keras fit's loss")
        losses.append(outputs["loss"])
    return losses


def run_ours_ps(settings: Settings, dist: tf.distribute.Strategy, model, optimizer, steps: int,
                chunk: int) -> list[float]:
    """`steps` steps of the ParameterServer loop, `chunk` steps per call; the mean loss of each call.

    With one step per call a single closure runs at a time, on one worker; with more, the
    steps are spread over the workers as in training (asynchronous updates).
    """
    from trainer.core.ps_loop import build_ps_loops

    with dist.scope():
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False)
    loop, _ = build_ps_loops(
        dist, settings.data_source, model, optimizer, global_step, settings.step_fn, settings.eval_step_fn,
        global_batch_size=settings.global_batch_size, seed=settings.seed, start_step=0,
        steps_per_loop=settings.steps_per_loop, shard_policy=settings.shard_policy,
        config=settings.parameter_server,
    )
    losses = []
    for start in range(0, steps, chunk):
        losses.append(loop.run(min(chunk, steps - start))["loss"])
    return losses


def run_fit_ps(settings: Settings, dist: tf.distribute.Strategy, model, optimizer, steps: int,
               chunk: int) -> list[float]:
    """tf_keras fit under ParameterServerStrategy: `steps` steps as epochs of `chunk` steps.

    One worker: one step per epoch (chunk 1) on the stored first batches, so the epoch's
    loss is the step's loss. More workers: each reads its own stream, as in ps_loop.
    """
    with dist.scope():
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=1)
    if hasattr(model, "distribute_reduction_method"):
        model.distribute_reduction_method = "first"
    source, gb, seed, policy = settings.data_source, settings.global_batch_size, settings.seed, settings.shard_policy
    workers = data.num_workers(dist)
    if workers == 1:
        batches = list(data.train_dataset(source, gb, seed, shard_policy=policy).take(steps).as_numpy_iterator())
        pipeline = tf.data.Dataset.from_tensor_slices(tuple(np.stack(parts) for parts in zip(*batches)))
    else:
        # As ps_loop feeds our workers: worker k (numbered as it builds its dataset) reads the
        # training set shuffled with seed + k.
        with dist.scope():
            counter = tf.Variable(0, dtype=tf.int64, trainable=False)

        def dataset_fn(context):
            size = context.get_per_replica_batch_size(gb)
            streams = [data.train_dataset(source, size, seed + k, shard_policy=policy) for k in range(workers)]
            which = (counter.assign_add(1) - 1) % workers
            return tf.data.Dataset.choose_from_datasets(streams, tf.data.Dataset.from_tensors(which).repeat())

        pipeline = keras.utils.experimental.DatasetCreator(dataset_fn)
    if steps % chunk:
        raise UserError(f"--metric_steps {steps} must be a multiple of train.steps_per_loop {chunk}")
    history = model.fit(pipeline, epochs=steps // chunk, steps_per_epoch=chunk, verbose=0)
    return [float(v) for v in history.history["loss"]]


def evaluate(settings: Settings, weights_list: list[np.ndarray]) -> dict[str, float]:
    """The configured eval step over the whole eval set, on this process's device, with these weights."""
    from trainer.core.loop import Evaluator

    source, gb = settings.data_source, settings.global_batch_size
    model = settings.model_fn(source.input_shape, source.num_classes)
    model.set_weights(weights_list)
    dataset = data.eval_dataset(source, gb)
    return Evaluator(tf.distribute.get_strategy(), model, settings.eval_step_fn, dataset,
                     -(-source.num_examples("eval") // gb)).evaluate()


def fit_input(settings: Settings, dist: tf.distribute.Strategy, steps: int):
    """The batches our loop sees in its first `steps` steps, fixed, split across replicas the same way.

    fit iterates its dataset more than once, and a streamed source's shuffle buffer reshuffles
    on every iteration, so fit gets the batches read once and stored. Our loop trains replica r on
    slice r of each global batch, except with per-worker file shards (the 'function' method
    with files sharded across input pipelines), where each pipeline reads its own files.
    """
    source, gb, seed, policy = settings.data_source, settings.global_batch_size, settings.seed, settings.shard_policy

    def stored(dataset: tf.data.Dataset, count: int) -> tf.data.Dataset:
        batches = list(dataset.take(count).as_numpy_iterator())
        stacked = tuple(np.stack(parts) for parts in zip(*batches))
        return tf.data.Dataset.from_tensor_slices(stacked).with_options(dataset.options())

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        if not data._shards_by_file(source, policy, context):  # the same test as data.distribute_train
            return data.replica_slices(stored(data.train_dataset(source, gb, seed, shard_policy="OFF"), steps), context)
        batches_per_step = context.num_replicas_in_sync // context.num_input_pipelines
        dataset = data.train_dataset(source, context.get_per_replica_batch_size(gb), seed,
                                     shard_policy=policy, input_context=context)
        return stored(dataset, steps * batches_per_step)

    if settings.distribute_method == "function":
        return dist.distribute_datasets_from_function(dataset_fn)
    return dist.experimental_distribute_dataset(stored(data.train_dataset(source, gb, seed, shard_policy=policy), steps))


class _StepLosses(keras.callbacks.Callback):
    """fit's loss of each batch: the loss metric is reset before every batch (it is a running mean)."""

    def __init__(self):
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.model.reset_metrics()

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def run_fit(settings: Settings, dist: tf.distribute.Strategy, model, optimizer, steps: int) -> list[float]:
    """`steps` steps of `model.fit` on `fit_input`; the loss of each."""
    with dist.scope():
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=1, jit_compile=settings.jit_compile)
    if hasattr(model, "distribute_reduction_method"):
        # tf_keras only: its default ('auto' = 'sum') adds up every replica's copy of a metric
        # that is already global under MultiWorkerMirrored, so fit logs N times the loss.
        model.distribute_reduction_method = "first"
    callback = _StepLosses()
    model.fit(fit_input(settings, dist, steps), epochs=1, steps_per_epoch=steps, callbacks=[callback],
              verbose=0, shuffle=False)
    if len(callback.losses) != steps:
        raise RuntimeError(f"fit ran {len(callback.losses)} steps instead of {steps}")
    return callback.losses


def weights(model) -> list[np.ndarray]:
    """The model's weights in its own order (the same order for Keras 3 and tf_keras)."""
    return [np.asarray(w) for w in model.get_weights()]


def copy_state(source_model, target_model) -> None:
    """Every variable (weights and seed-generator states) of one model into a twin."""
    for a, b in zip(source_model.variables, target_model.variables, strict=True):
        b.assign(np.asarray(a.numpy()))


def save(path: str, *, losses: list[float], arrays: dict[str, list[np.ndarray]], **meta) -> None:
    """`path`.json (losses and meta) and `path`.npz (named lists of arrays)."""
    flat = {f"{name}/{i}": a for name, values in arrays.items() for i, a in enumerate(values)}
    np.savez(path + ".npz", **flat)
    with open(path + ".json", "w") as f:
        json.dump({"losses": losses, **meta}, f)


def load(path: str) -> tuple[dict, dict[str, list[np.ndarray]]]:
    with open(path + ".json") as f:
        meta = json.load(f)
    arrays: dict[str, list] = {}
    with np.load(path + ".npz") as stored:
        keys = sorted(stored.files, key=lambda k: (k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1])))
        for key in keys:
            arrays.setdefault(key.rsplit("/", 1)[0], []).append(stored[key])
    return meta, arrays


def exists(path: str) -> bool:
    return os.path.exists(path + ".json") and os.path.exists(path + ".npz")
