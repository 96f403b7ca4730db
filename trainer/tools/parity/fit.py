"""The Keras side of a parity run: `fit` from our initial weights on our batches, in our order.

fit gets a twin of our model and a fresh optimizer from the same `optimizer_fn` (built by the
core's `build_task`, under the same scope), the loss `parity.loss` names, `steps_per_execution=1`,
and exactly the batches our loop trains on, of whatever structure the input function yields
(fit unpacks them as `(x, y)` or `(x, y, sample_weight)`). Written against the `keras` module:
in a tf_keras process (multi-worker, parameter server) it runs tf_keras fit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from trainer import data
from trainer.distribution.runtime import Runtime
from trainer.errors import UserError
from trainer.run.settings import Settings
from trainer.task.task import Task, build_task
from trainer.tools.parity.config import ParityConfig
from trainer.tools.parity.runs import single_model


def build_fit_task(runtime: Runtime, inp: data.Input, settings: Settings) -> Task:
    """fit's model and built optimizer, by the core's `build_task`, with no seed set (the caller
    copies our model's state into it) and the optimizer unwrapped: fit's `compile` adds its own
    loss scaling under mixed_float16. Layers still follow the global dtype policy."""
    unscaled = dataclasses.replace(runtime, policy="float32")  # read only by the optimizer wrapping
    return build_task(
        unscaled,
        inp,
        model_fn=settings.model_fn,
        optimizer_fn=settings.optimizer_fn,
        step_fn=settings.step_fn,
        eval_step_fn=settings.eval_step_fn,
        global_batch_size=settings.global_batch_size,
        total_steps=settings.total_steps,
    )


def check_fit_example(inp: data.Input) -> None:
    """fit reads an example as (x, y) or (x, y, sample_weight); x itself may be any structure."""
    spec = inp.element_spec
    if type(spec) is not tuple or len(spec) not in (2, 3):
        raise UserError(
            "parity compares with Keras fit, which takes examples (x, y) or (x, y, sample_weight); "
            f"this input function yields {tf.nest.map_structure(lambda s: s.shape, spec)}"
        )


def compile_for_fit(runtime: Runtime, task: Task, config: ParityConfig, *, jit_compile: bool = False):
    """The task's one model compiled with its optimizer and fit's loss, one step per execution."""
    model = single_model(task)
    with runtime.strategy.scope():
        model.compile(
            optimizer=task.optimizers, loss=config.keras_loss(), steps_per_execution=1, jit_compile=jit_compile
        )
    if hasattr(model, "distribute_reduction_method"):
        # tf_keras only: its default ('auto' = 'sum') adds up every replica's copy of a metric
        # that is already global under MultiWorkerMirrored, so fit logs N times the loss.
        model.distribute_reduction_method = "first"
    return model


def stored(dataset: tf.data.Dataset, count: int) -> tf.data.Dataset:
    """The first `count` batches of `dataset`, read once and held (of any nested structure)."""
    batches = list(dataset.take(count).as_numpy_iterator())
    stacked = tf.nest.map_structure(lambda *parts: np.stack(parts), *batches)
    return tf.data.Dataset.from_tensor_slices(stacked).with_options(dataset.options())


def fit_input(dist: tf.distribute.Strategy, inp: data.Input, settings: Settings, steps: int):
    """The batches our loop sees in its first `steps` steps, fixed, split across replicas the same way.

    fit iterates its dataset more than once, and a streamed source's shuffle buffer reshuffles
    on every iteration, so fit gets the batches read once and stored. Our loop trains replica r on
    slice r of each global batch, except with per-worker file shards (the 'function' method
    with files sharded across input pipelines), where each pipeline reads its own files.
    """
    gb, seed, policy = settings.global_batch_size, settings.seed, settings.shard_policy

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        if not data.shards_by_file(inp, policy, context):  # the same test as data.distribute_train
            return data.replica_slices(stored(data.train_dataset(inp, gb, seed, shard_policy="OFF"), steps), context)
        batches_per_step = context.num_replicas_in_sync // context.num_input_pipelines
        dataset = data.train_dataset(
            inp, context.get_per_replica_batch_size(gb), seed, shard_policy=policy, input_context=context
        )
        return stored(dataset, steps * batches_per_step)

    if settings.distribute_method == "function":
        return dist.distribute_datasets_from_function(dataset_fn)
    return dist.experimental_distribute_dataset(stored(data.train_dataset(inp, gb, seed, shard_policy=policy), steps))


class _StepLosses(keras.callbacks.Callback):
    """fit's loss of each batch: the loss metric is reset before every batch (it is a running mean)."""

    def __init__(self):
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.model.reset_metrics()

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def run_fit(runtime: Runtime, task: Task, settings: Settings, config: ParityConfig, steps: int) -> list[float]:
    """`steps` steps of `model.fit` on `fit_input`; the loss of each."""
    check_fit_example(task.input)
    model = compile_for_fit(runtime, task, config, jit_compile=settings.jit_compile)
    callback = _StepLosses()
    model.fit(
        fit_input(runtime.strategy, task.input, settings, steps),
        epochs=1,
        steps_per_epoch=steps,
        callbacks=[callback],
        verbose=0,
        shuffle=False,
    )
    if len(callback.losses) != steps:
        raise RuntimeError(f"fit ran {len(callback.losses)} steps instead of {steps}")
    return callback.losses


def run_fit_ps(
    runtime: Runtime, task: Task, settings: Settings, config: ParityConfig, steps: int, chunk: int
) -> list[float]:
    """tf_keras fit under ParameterServerStrategy: `steps` steps as epochs of `chunk` steps.

    One worker: one step per epoch (chunk 1) on the stored first batches, so the epoch's
    loss is the step's loss. More workers: each reads its own stream, as in ps_loop.
    """
    check_fit_example(task.input)
    model = compile_for_fit(runtime, task, config)
    dist, inp = runtime.strategy, task.input
    gb, seed, policy = settings.global_batch_size, settings.seed, settings.shard_policy
    workers = data.num_workers(dist)
    pipeline: Any
    if workers == 1:
        pipeline = stored(data.train_dataset(inp, gb, seed, shard_policy=policy), steps)
    else:
        # As ps_loop feeds our workers: worker k (numbered as it builds its dataset) reads the
        # training set shuffled with seed + k.
        with dist.scope():
            counter = tf.Variable(0, dtype=tf.int64, trainable=False)

        def dataset_fn(context):
            size = context.get_per_replica_batch_size(gb)
            streams = [data.train_dataset(inp, size, seed + k, shard_policy=policy) for k in range(workers)]
            which = (counter.assign_add(1) - 1) % workers
            return tf.data.Dataset.choose_from_datasets(streams, tf.data.Dataset.from_tensors(which).repeat())

        pipeline = keras.utils.experimental.DatasetCreator(dataset_fn)
    if steps % chunk:
        raise UserError(f"--metric_steps {steps} must be a multiple of train.steps_per_loop {chunk}")
    history = model.fit(pipeline, epochs=steps // chunk, steps_per_epoch=chunk, verbose=0)
    return [float(v) for v in history.history["loss"]]
