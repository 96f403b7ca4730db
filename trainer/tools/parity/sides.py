"""The two sides of a parity run, built by `train`'s own setup, so that parity checks what a run trains: our loop
as `train` chooses it, and `fit` on a twin of our model from our initial state, on exactly our batches in our
order. Written against `keras`: in a tf_keras process (multi-worker, parameter server) it runs tf_keras fit."""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Mapping

import keras
import numpy as np
import tensorflow as tf

from trainer import configurables, data
from trainer.distribution import devices, local_cluster
from trainer.distribution.runtime import Runtime
from trainer.errors import UserError
from trainer.loops.build import build_loops
from trainer.loops.evaluator import Evaluator, make_metrics
from trainer.run.settings import Settings
from trainer.run.setup import setup
from trainer.task.task import Task, build_eval_models, build_task
from trainer.tools.parity.config import ParityConfig


def single_model(task: Task):
    """The one model fit can train (fit knows nothing of a dict of models or optimizers)."""
    if isinstance(task.models, Mapping) or isinstance(task.optimizers, Mapping):
        raise UserError(
            "parity compares with Keras fit, which trains one model with one optimizer; this "
            "train.model_fn/optimizer_fn returns a dict of them"
        )
    return task.models


def weights(model) -> list[np.ndarray]:
    return [np.asarray(w) for w in model.get_weights()]  # in the model's order, the same in Keras 3 and tf_keras


def save(path: str, result) -> None:
    with open(path, "wb") as f:
        pickle.dump(result, f)


def load(path: str):
    with open(path, "rb") as f:
        return pickle.load(f)


def run_ours(runtime: Runtime, task: Task, settings: Settings, steps: int, chunk: int = 1) -> list[float]:
    """`steps` steps of the loop `train` would choose, `chunk` steps per call; the 'loss' of each call.
    Under parameter_server with several workers a call of `steps_per_loop` steps spreads over the workers."""
    loop, _ = build_loops(runtime, task, settings, start_step=0)
    losses = []
    for start in range(0, steps, chunk):
        outputs = loop.run(min(chunk, steps - start))
        if "loss" not in outputs:
            raise UserError(
                f"the step returns {sorted(outputs)} but no 'loss'; parity compares the 'loss' "
                "output with Keras fit's loss"
            )
        losses.append(outputs["loss"])
    return losses


def evaluate(settings: Settings, weights_list: list[np.ndarray]) -> dict[str, float]:
    """The configured eval step over the first eval split, on this process's device, with these weights."""
    inp = settings.make_input()
    model, _, _ = build_eval_models(inp, settings.model_fn)
    model.set_weights(weights_list)
    split, gb = inp.eval_splits[0], settings.global_batch_size
    dataset, batches = data.eval_dataset(inp, gb, split=split), -(-inp.num_examples(split) // gb)
    metrics = make_metrics(settings.eval_metrics_fn)
    return Evaluator(
        tf.distribute.get_strategy(), model, settings.eval_step_fn, dataset, batches, metrics=metrics
    ).evaluate()


def compile_for_fit(runtime: Runtime, task: Task, config: ParityConfig, *, jit_compile: bool = False):
    """The task's one model compiled with its optimizer and fit's loss, one step per execution."""
    spec = task.input.element_spec
    if type(spec) is not tuple or len(spec) not in (2, 3):
        raise UserError(
            "parity compares with Keras fit, which takes examples (x, y) or (x, y, sample_weight); "
            f"this input function yields {tf.nest.map_structure(lambda s: s.shape, spec)}"
        )
    model = single_model(task)
    with runtime.strategy.scope():
        model.compile(task.optimizers, config.keras_loss(), steps_per_execution=1, jit_compile=jit_compile)
    if hasattr(model, "distribute_reduction_method"):
        # tf_keras only: its default ('auto' = 'sum') adds up every replica's copy of a metric
        # that is already global under MultiWorkerMirrored, so fit logs N times the loss.
        model.distribute_reduction_method = "first"
    return model


def run_fit(runtime: Runtime, task: Task, settings: Settings, config: ParityConfig, steps: int, chunk: int = 1):
    """`steps` steps of fit as epochs of `chunk` steps; each epoch's loss (with one step, that step's). On our
    batches, stored, except under parameter_server with several workers: there worker k (numbered as it builds
    its dataset) reads the training set shuffled with seed + k, as ps_loop feeds ours."""
    dist, inp, ps = runtime.strategy, task.input, runtime.mode.coordinates_workers
    model = compile_for_fit(runtime, task, config, jit_compile=settings.jit_compile and not ps)
    gb, seed, policy, workers = settings.global_batch_size, settings.seed, settings.shard_policy, data.num_workers(dist)
    if not ps:  # our batches, split across replicas as ours are
        pipeline = data.distribute_train(
            dist, inp, gb, seed, method=settings.distribute_method, shard_policy=policy, held_steps=steps
        )
    elif workers == 1:
        pipeline = data.held(data.train_dataset(inp, gb, seed, shard_policy=policy), steps)
    else:
        with dist.scope():
            counter = tf.Variable(0, dtype=tf.int64, trainable=False)

        def dataset_fn(context):
            size = context.get_per_replica_batch_size(gb)
            streams = [data.train_dataset(inp, size, seed + k, shard_policy=policy) for k in range(workers)]
            which = (counter.assign_add(1) - 1) % workers
            return tf.data.Dataset.choose_from_datasets(streams, tf.data.Dataset.from_tensors(which).repeat())

        pipeline = keras.utils.experimental.DatasetCreator(dataset_fn)
    history = model.fit(pipeline, epochs=steps // chunk, steps_per_epoch=chunk, verbose=0, shuffle=False)
    return [float(v) for v in history.history["loss"]]


def compare_in_process(settings: Settings, config: ParityConfig, steps: int) -> tuple[list[dict], int]:
    """Ours and Keras 3 fit in this process, on the configured strategy, from the same state; the results and
    the replica count. fit's optimizer is built unwrapped (fit's `compile` adds its own loss scaling)."""
    runtime, task = setup(settings)
    names = ["model_fn", "optimizer_fn", "step_fn", "eval_step_fn", "global_batch_size", "total_steps"]
    unwrapped = dataclasses.replace(runtime, policy="float32")  # read only by the optimizer wrapping
    fit_task = build_task(unwrapped, task.input, **{name: getattr(settings, name) for name in names})
    model, fit_model = single_model(task), single_model(fit_task)
    for a, b in zip(model.variables, fit_model.variables, strict=True):  # weights and seed-generator states
        b.assign(np.asarray(a.numpy()))
    ours, fit = run_ours(runtime, task, settings, steps), run_fit(runtime, fit_task, settings, config, steps)
    runs = [{"losses": ours, "final": weights(model)}, {"losses": fit, "final": weights(fit_model)}]
    return runs, runtime.num_replicas


def run_side(role: str, settings: Settings, config: ParityConfig, steps: int, result: str, replicas: list) -> None:
    """One worker process's part (one of trainer.launch's, or a parameter_server coordinator of its own local
    cluster): `ours`, `replicas` (ours on logical CPUs under MirroredStrategy) or `tf_keras_fit`. The first
    run leaves its initial weights beside its result, and every later one starts from them."""
    if role == "replicas":
        cpus = dict(logical_cpus=int(replicas[0]), logical_cpus_without_gpu=0)
        device_config = dataclasses.replace(settings.device_config or devices.DeviceConfig(), **cpus)
        settings = dataclasses.replace(
            settings, strategy="mirrored", device_config=device_config, parameter_server=None
        )
    initial = os.path.join(os.path.dirname(result), "initial")
    with local_cluster.cluster_for(settings.strategy, configurables.local_cluster, print_fn=print):
        runtime, task = setup(settings)
        model = single_model(task)
        several_ps_workers = runtime.mode.coordinates_workers and data.num_workers(runtime.strategy) > 1
        chunk = settings.steps_per_loop if several_ps_workers else 1  # else step by step
        if role != "ours" and os.path.exists(initial):
            with runtime.strategy.scope():
                model.set_weights(load(initial))
        elif runtime.is_chief:
            save(initial, weights(model))
        if role != "tf_keras_fit":
            losses = run_ours(runtime, task, settings, steps, chunk=chunk)
        else:
            losses = run_fit(runtime, task, settings, config, steps, chunk)
        if runtime.is_chief:
            final, iterations = weights(model), int(task.optimizers.iterations.numpy())
            save(result, dict(losses=losses, final=final, iterations=iterations, replicas=runtime.num_replicas))
    if role != "replicas":
        what = role.replace("_fit", " fit")
        print(f"{what}: {steps} steps on {runtime.num_replicas} replicas, last loss {losses[-1]:.6f}", flush=True)
