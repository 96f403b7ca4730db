"""The one place that chooses the loop: asynchronous closures for a mode whose workers are
remote (parameter_server), else the compiled synchronous loop; and, per eval split, an evaluator."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import tensorflow as tf

from trainer import data
from trainer.data import device, sequences
from trainer.data.distribute import check_input
from trainer.distribution.runtime import Runtime
from trainer.errors import UserError
from trainer.files.event_writers import event_writer
from trainer.loops import ps_eval
from trainer.loops.controller import EvaluatorLike, TrainLoopLike
from trainer.loops.evaluator import Evaluator, make_metrics
from trainer.loops.options import ParameterServerConfig
from trainer.loops.ps import (
    PSEvaluator,
    PSTrainLoop,
    check_partitioner,
    describe_placement,
    per_worker_train_data,
)
from trainer.loops.ps_schedules import count_steps_atomically
from trainer.loops.step_summaries import StepSummaries
from trainer.loops.sync import StepFn, TrainLoop
from trainer.task.task import Task

if TYPE_CHECKING:
    from trainer.run.settings import Settings


def build_loops(
    runtime: Runtime,
    task: Task,
    settings: "Settings",
    *,
    start_step: int,
    step_fn: StepFn | None = None,
    drop_batches: Sequence[int] = (),
    after_update: Callable[[], None] | None = None,
    print_fn: Callable[[str], None] = print,
) -> tuple[TrainLoopLike, Mapping[str, EvaluatorLike]]:
    """The train loop and evaluators of the runtime's mode, from `start_step`; `step_fn` as the extensions
    wrapped it, `drop_batches` skipped, `after_update` run after every update (synchronous only)."""
    step_fn = step_fn or task.step_fn
    if runtime.mode.coordinates_workers:
        if after_update is not None:
            raise UserError(
                "an extension added an action after each update, which the parameter_server loop "
                "cannot run (no single point after an asynchronous update); declare it synchronous only"
            )
        return build_ps_loops(runtime, task, settings, step_fn=step_fn, start_step=start_step, print_fn=print_fn)
    return build_sync_loops(
        runtime,
        task,
        settings,
        step_fn=step_fn,
        start_step=start_step,
        drop_batches=drop_batches,
        after_update=after_update,
    )


def build_sync_loops(
    runtime: Runtime,
    task: Task,
    settings: "Settings",
    *,
    step_fn: StepFn,
    start_step: int,
    drop_batches: Sequence[int] = (),
    after_update: Callable[[], None] | None = None,
) -> tuple[TrainLoop, dict[str, Evaluator]]:
    """The compiled train loop and, per eval split, an evaluator, for the synchronous strategies."""
    dist = runtime.strategy
    train_data = train_batches(dist, task.input, settings, skip_steps=start_step, drop_batches=drop_batches)
    loop = TrainLoop(
        dist,
        task.models,
        task.optimizers,
        step_fn,
        settings.global_batch_size,
        train_data,
        task.global_step,
        jit_compile=settings.jit_compile,
        after_update=after_update,
        summaries=step_summaries(runtime, settings),
        lengths_vary=sequences.is_variable(task.input.element_spec) and settings.steps_per_loop > 1,
    )
    with dist.scope():  # metric variables aggregate across replicas (and workers)
        metrics = make_metrics(settings.eval_metrics_fn)
    evaluators = {}
    by_structure: dict[str, Evaluator] = {}  # one evaluator, traced, per example structure of the eval splits
    for split in task.input.eval_splits:

        def eval_data(split=split):
            return data.distribute_eval(
                dist,
                task.input,
                settings.global_batch_size,
                split=split,
                method=settings.distribute_method,
                shard_policy=settings.shard_policy,
            )

        num_batches = _num_batches(task, split, settings)
        structure = repr(task.input.example_spec(split))
        if (first := by_structure.get(structure)) is not None:
            check_input(dist, task.input, split, settings.distribute_method, settings.shard_policy)  # now, not later
            evaluators[split] = first.on(eval_data, num_batches)
        else:
            evaluators[split] = by_structure[structure] = Evaluator(
                dist, task.models, task.eval_step_fn, eval_data(), num_batches, metrics=metrics
            )
    return loop, evaluators


def build_ps_loops(
    runtime: Runtime,
    task: Task,
    settings: "Settings",
    *,
    step_fn: StepFn,
    start_step: int,
    print_fn: Callable[[str], None] = print,
) -> tuple[PSTrainLoop, dict[str, PSEvaluator]]:
    """The ParameterServer loop and, per eval split, an evaluator spread over the workers or on the coordinator."""
    config = settings.parameter_server or ParameterServerConfig()
    if config.variable_partitioner is not None:
        check_partitioner(task.models)
        print_fn(f"variable placement: {describe_placement(task.models)}")
    dist = runtime.strategy
    workers = data.num_workers(dist)
    steps_per_closure = config.steps_per_closure or max(1, -(-settings.steps_per_loop // (2 * workers)))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(dist)
    count_steps_atomically(task.optimizers, task.global_step)  # schedules and Adam follow every step
    indexed = (
        None
        if settings.data_service
        else data.indexed_batches(task.input, settings.global_batch_size, settings.seed, settings.shard_policy)
    )
    train_data = per_worker_train_data(
        dist,
        coordinator,
        task.input,
        settings.global_batch_size,
        settings.seed,
        start_step=start_step,
        shard_policy=settings.shard_policy,
        service=settings.data_service,
        model_dir=settings.model_dir,
        indexed=indexed,
    )
    loop = PSTrainLoop(
        dist,
        coordinator,
        task.models,
        task.optimizers,
        step_fn,
        settings.global_batch_size,
        train_data,
        task.global_step,
        steps_per_closure=steps_per_closure,
        indexed=indexed,
        print_fn=print_fn,
        batch_spec=tf.nest.map_structure(lambda s: tf.TensorSpec([None, *s.shape], s.dtype), task.input.element_spec),
    )
    local = tf.distribute.get_strategy()  # the default strategy: the coordinator's own device
    metrics = make_metrics(settings.eval_metrics_fn)  # on the coordinator, where eval runs
    shards, why = ps_eval.shard_count(
        config.eval_shards,
        workers=workers,
        replicas=dist.num_replicas_in_sync,
        cluster=runtime.cluster.cluster,
        has_metrics=bool(metrics),
    )
    if task.input.eval_splits:
        where = f"spread over {workers} worker(s) in up to {shards} shards" if shards else "on the coordinator"
        print_fn(f"eval under parameter_server: {where} (parameter_server.eval_shards = {config.eval_shards!r}: {why})")
    evaluators = {}
    for split in task.input.eval_splits:

        def eval_data(*batches, split=split):
            return data.eval_dataset(
                task.input,
                settings.global_batch_size,
                split=split,
                shard_policy=settings.shard_policy,
                batches=batches or None,
            )

        num_batches = _num_batches(task, split, settings)
        evaluator = Evaluator(local, task.models, task.eval_step_fn, eval_data(), num_batches, metrics=metrics)
        if shards:
            evaluator = ps_eval.WorkerEvaluator(dist, coordinator, evaluator, eval_data, num_batches, shards)
        evaluators[split] = PSEvaluator(evaluator)
    return loop, evaluators


def data_choice(inp: data.Input, settings: "Settings") -> tuple[device.Choice, object]:
    """Whether the train split is held on the devices (trainer/data/device.py) and its arrays where it is;
    the choice's line is said at the start of a run (trainer/extensions/data_position.py)."""
    return device.choose(
        settings.strategy,
        inp,
        max_bytes=settings.device_data_max_bytes,
        shard_policy=settings.shard_policy,
        data_service=settings.data_service,
    )


def train_batches(
    strategy: tf.distribute.Strategy,
    inp: data.Input,
    settings: "Settings",
    *,
    skip_steps: int = 0,
    drop_batches: Sequence[int] = (),
) -> "tf.distribute.DistributedDataset | device.DeviceBatches":
    """What the synchronous loop reads its batches from, from `skip_steps` on without `drop_batches` (a fresh
    loop, a roll-back, the benchmark): the split on the devices where it is held there, else
    `distributed_train_data`; both give the same batches."""
    choice, arrays = data_choice(inp, settings)
    if choice.held:
        return device.device_batches(
            strategy,
            inp,
            arrays,
            settings.global_batch_size,
            settings.seed,
            skip_steps=skip_steps,
            drop_batches=drop_batches,
        )
    return distributed_train_data(strategy, inp, settings, skip_steps=skip_steps, drop_batches=drop_batches)


def distributed_train_data(
    strategy: tf.distribute.Strategy,
    inp: data.Input,
    settings: "Settings",
    *,
    skip_steps: int = 0,
    drop_batches: Sequence[int] = (),
) -> tf.distribute.DistributedDataset:
    """The train data as the synchronous loop gets it, from `skip_steps` on without `drop_batches`
    (a fresh loop, a roll-back, the benchmark: one recipe, so none can feed other batches)."""
    return data.distribute_train(
        strategy,
        inp,
        settings.global_batch_size,
        settings.seed,
        method=settings.distribute_method,
        shard_policy=settings.shard_policy,
        skip_steps=skip_steps,
        drop_batches=drop_batches,
        service=settings.data_service,
        model_dir=settings.model_dir,
    )


def step_summaries(runtime: Runtime, settings: "Settings") -> StepSummaries:
    """Where the step's tf.summary calls go: the chief's train event file (other workers record
    nothing, as they write no train records); nowhere without a model_dir."""
    if settings.model_dir is None:
        return StepSummaries(None, settings.log_every_steps)
    if not runtime.is_chief:
        return StepSummaries(tf.summary.create_noop_writer(), settings.log_every_steps)
    return StepSummaries(event_writer(os.path.join(settings.model_dir, "train")), settings.log_every_steps)


def _num_batches(task: Task, split: str, settings: "Settings") -> int:
    return -(-task.input.num_examples(split) // settings.global_batch_size)
