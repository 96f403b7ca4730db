"""`train`: the gin facade over runtime, task and controller, readable top to bottom.

options (validated) -> runtime: devices -> cluster -> strategy -> precision
-> task under strategy.scope(): input, model(s), optimizer(s), steps, checkpoint
-> checks (resume record, loss scaling) -> model_dir (chief) -> controller: loop calls, hooks.
Nothing in `model_dir` is written before the configuration, data, user functions and
checkpoint have been checked.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, Sequence

import keras

from trainer import data
from trainer.safety import loss_scaling as guard
from trainer.task import models
from trainer.safety import nonfinite as nonfinite_lib
from trainer.task import optimizers
from trainer.task import precision
from trainer.files import run_record
from trainer.task import steps
from trainer.update import accumulation
from trainer.extensions import ema as ema_lib
from trainer.extensions import export as export_lib
from trainer.extensions import warm_start as warm_start_lib
from trainer.extensions import best_checkpoints
from trainer.extensions import early_stopping as early_stopping_lib
from trainer.extensions import keras_callbacks as keras_callbacks_lib
from trainer.files.checkpoints import CheckpointSaver
from trainer.loops.controller import build_loops, drive
from trainer.hooks.base import CheckpointHook, ConfigWriter, EvalHook, HParamsWriter, Hook, ProgressLogger, RunContext
from trainer.files.metrics_log import MetricsLog
from trainer.run.settings import HookOptions, LoopOptions, RecoveryOptions
from trainer.extensions.preemption import PreemptionHook
from trainer.loops.ps import ParameterServerConfig
from trainer.distribution.runtime import Runtime, RuntimeConfig, make_runtime
from trainer.files.model_dir import check_model_dir, prepare_model_dir
from trainer.task.task import Task, build_task, flat
from trainer.distribution import devices
from trainer.errors import UserError
from trainer.validation import check_bool, check_callable


@precision.keeps_global_policy
def train(
    *,
    model_dir: str,
    total_steps: int = 1000,
    global_batch_size: int = 64,
    steps_per_loop: int = 50,
    log_every_steps: int = 100,
    checkpoint_every_steps: int = 500,
    eval_every_steps: int = 500,
    seed: int = 0,
    step_fn: Callable = steps.classification_step,
    eval_step_fn: Callable = steps.classification_eval_step,
    eval_metrics_fn: Callable[[], Mapping[str, keras.metrics.Metric]] | None = None,
    check_loss_scaling: bool = True,
    jit_compile: bool = False,
    mixed_precision: str | None = None,
    model_fn: Callable = models.cnn,
    input_fn: Callable | None = None,
    data_source: Callable | None = None,
    eval_splits: Sequence[str] | None = None,
    optimizer_fn: Callable = optimizers.make_optimizer,
    strategy: str = "default",
    device_config: devices.DeviceConfig | None = None,
    cluster_resolver: str = "tf_config",
    cluster_resolver_options: dict | None = None,
    collective_timeout_secs: float | None = None,
    distribute_method: str = "dataset",
    shard_policy: str = "AUTO",
    parameter_server: ParameterServerConfig | None = None,
    keep_checkpoints: int = 3,
    async_checkpoint: bool = False,
    nonfinite: str = "stop",
    max_rollbacks: int = 3,
    allow_resume_changes: bool = False,
    preemption_checkpointing: bool = False,
    grad_accum_steps: int = 1,
    clip_global_norm: float | None = None,
    ema_decay: float | None = None,
    export_saved_model: bool = False,
    warm_start: str | None = None,
    keep_best: int = 0,
    best_metric: str = "loss",
    best_mode: str = "min",
    early_stopping: early_stopping_lib.EarlyStopping | None = None,
    keras_callbacks: Sequence[keras.callbacks.Callback] = (),
    hooks: Sequence[Hook] = (),
    describe_config: Callable[[], str] | None = None,
    hparams: Mapping[str, bool | int | float | str] | None = None,
    print_fn: Callable[[str], None] = print,
) -> dict[str, float]:
    """Trains until `total_steps`, resuming from the newest checkpoint in `model_dir`.

    Returns the final eval metrics of the first eval split (empty if the run had already finished).
    Raises UserError for mistakes the user can fix, before anything in `model_dir` is written.

    Input: `input_fn(split[, input_context])` returns unbatched examples of any structure
    (`data_source` is its older name; default: the embedded digits); `eval_splits` defaults to
    the function's `splits` other than 'train', else ('eval',). Models and optimizers: see
    trainer/task/task.py. Eval: `eval_step_fn(model, batch[, metrics])` returns per-replica sums
    with `num_examples` and/or updates the Keras metrics that `eval_metrics_fn()` creates.
    Speed options: `jit_compile` (XLA on the per-replica step, synchronous strategies) and
    `mixed_precision` (see trainer/task/precision.py). Around the step: `ema_decay` (EMA weights,
    trainer/extensions/ema.py), `export_saved_model` (trainer/extensions/export.py), `warm_start`
    (trainer/extensions/warm_start.py). After evals: `keep_best`/`best_metric`/`best_mode` (the best
    checkpoints in model_dir/best, trainer/extensions/best_checkpoints.py), `early_stopping`
    (trainer/extensions/early_stopping.py), `keras_callbacks` (trainer/extensions/keras_callbacks.py).
    `async_checkpoint` writes each checkpoint on a background thread from the values of its step,
    so training does not wait for the disk; the previous checkpoint stays in charge until the new
    one is complete, and every write is finished before a restore, the export and the run's end
    (trainer/files/checkpoints.py). Synchronous strategies only.
    """
    check_user_functions(step_fn=step_fn, eval_step_fn=eval_step_fn, model_fn=model_fn, optimizer_fn=optimizer_fn,
                         eval_metrics_fn=eval_metrics_fn, hooks=hooks, parameter_server=parameter_server)
    loop_options = LoopOptions(total_steps=total_steps, global_batch_size=global_batch_size,
                               steps_per_loop=steps_per_loop, seed=seed, distribute_method=distribute_method,
                               shard_policy=shard_policy, jit_compile=jit_compile)
    hook_options = HookOptions(log_every_steps=log_every_steps, checkpoint_every_steps=checkpoint_every_steps,
                               eval_every_steps=eval_every_steps, keep_checkpoints=keep_checkpoints)
    recovery = RecoveryOptions(check_loss_scaling=check_loss_scaling, nonfinite=nonfinite,
                               max_rollbacks=max_rollbacks, allow_resume_changes=allow_resume_changes,
                               preemption_checkpointing=preemption_checkpointing)
    runtime_config = RuntimeConfig(
        strategy=strategy, device_config=device_config, cluster_resolver=cluster_resolver,
        cluster_resolver_options=cluster_resolver_options, collective_timeout_secs=collective_timeout_secs,
        variable_partitioner=parameter_server.variable_partitioner if parameter_server else None,
        mixed_precision=mixed_precision,
    )
    check_model_dir(model_dir)
    ema_lib.check_ema_decay(ema_decay, strategy)
    export_lib.check_export(export_saved_model, strategy)
    warm_start_lib.check_warm_start(warm_start, strategy)
    if nonfinite == "rollback" and strategy == "parameter_server":
        raise UserError("train.nonfinite = 'rollback' is not supported with parameter_server; use 'stop'")
    check_bool("train.async_checkpoint", async_checkpoint)
    if async_checkpoint and strategy == "parameter_server":
        raise UserError("train.async_checkpoint works with the synchronous strategies only, not 'parameter_server'; "
                        "unset it there")
    if jit_compile and strategy == "parameter_server":
        raise UserError("train.jit_compile works with the synchronous strategies only, not 'parameter_server'")
    update = accumulation.UpdateOptions(grad_accum_steps=grad_accum_steps, clip_global_norm=clip_global_norm)
    update.check_strategy(strategy)
    runtime, task = setup(runtime_config, make_input(input_fn, data_source, eval_splits), model_fn=model_fn,
                          optimizer_fn=optimizer_fn, step_fn=accumulation.update_step(step_fn, update),
                          eval_step_fn=eval_step_fn, global_batch_size=global_batch_size, total_steps=total_steps,
                          seed=seed)
    accumulation.prepare(update, task.optimizers, num_replicas=runtime.num_replicas,
                         global_batch_size=global_batch_size, jit_compile=jit_compile)
    inp = task.input
    if not inp.deterministic:
        if nonfinite == "rollback":
            raise UserError(f"train.nonfinite = 'rollback' needs a deterministic input function, and {inp!r} declares "
                            "deterministic = False (a roll-back must find the offending batch again); use 'stop'")
        print_fn(f"warning: {inp!r} declares deterministic = False: a resumed run does not see exactly the batches "
                 "an uninterrupted one would, and eval counts are only as exact as its output")
    monitors = [  # best checkpoints, early stopping, Keras callbacks: checked before anything is written
        *best_checkpoints.make_hooks(keep_best, best_metric, best_mode, task.checkpoint, inp.eval_splits,
                                     runtime.cluster.task_name),
        *early_stopping_lib.make_hooks(early_stopping, inp.eval_splits),
        *keras_callbacks_lib.make_hooks(keras_callbacks, model=task.models, optimizer=task.optimizers,
                                        eval_every_steps=eval_every_steps, parameter_server=runtime.is_parameter_server),
    ]
    average = ema_lib.attach(runtime.strategy, task, ema_decay)  # before restore: it is in the checkpoint
    if export_saved_model:
        export_lib.check_exportable(task.models)
    serving_spec = export_lib.serving_spec(inp.element_spec) if export_saved_model else None
    config_text = describe_config() if describe_config else ""
    record = run_record.make_record(
        strategy=strategy, num_replicas=runtime.num_replicas, num_workers=runtime.num_workers,
        global_batch_size=global_batch_size, model=task.models, config_text=config_text,
    )
    run_record.check_resume(model_dir, record, allow_changes=allow_resume_changes)

    saver = CheckpointSaver(task.checkpoint, model_dir, is_chief=runtime.is_chief,
                            task_name=runtime.cluster.task_name, max_to_keep=keep_checkpoints,
                            async_checkpoint=async_checkpoint)
    restored = saver.restore_latest(print_fn)
    if warm_start and not restored:  # a fresh run only; a shape mismatch stops here, nothing written
        warm_start_lib.warm_start(task.models, warm_start, print_fn if runtime.is_chief else lambda _: None)
    if average is not None and not restored:
        average.reset()
    start_step = int(task.global_step.numpy())
    if start_step >= total_steps:
        print_fn(f"already trained: {restored} is at step {start_step} >= train.total_steps {total_steps}; nothing to do")
        return {}
    if restored:
        print_fn(f"restored {restored}; continuing from step {start_step}")

    guard_nonfinite = nonfinite_lib.NonFiniteGuard(
        nonfinite, max_rollbacks, saver, task.global_step, task.dropped_batches,
        rebuild_data=lambda step, drop: loop.set_dataset(data.distribute_train(
            runtime.strategy, inp, global_batch_size, seed, method=distribute_method, shard_policy=shard_policy,
            skip_steps=step, drop_batches=drop)),
        print_fn=print_fn,
    )
    loop, evaluators = build_loops(runtime, task, loop_options, start_step=start_step,
                                   drop_batches=guard_nonfinite.dropped, eval_metrics_fn=eval_metrics_fn,
                                   parameter_server=parameter_server, print_fn=print_fn,
                                   after_update=average.update if average is not None else None)
    check_functions(loop, evaluators, step_fn)
    if recovery.check_loss_scaling:  # rule 2: a mis-scaled step stops here, before its first update
        guard.check_loss_scaling(runtime.strategy, task.models, task.optimizers, step_fn, inp,
                                 global_batch_size=global_batch_size, seed=seed, print_fn=print_fn)

    default_hooks = [  # made here: their gin parameters are checked before anything is written
        ProgressLogger(hook_options.log_every_steps),
        EvalHook(hook_options.eval_every_steps),
        CheckpointHook(hook_options.checkpoint_every_steps),
    ]
    if runtime.is_chief:
        prepare_model_dir(model_dir)
        if start_step == 0 and run_record.read_record(model_dir) is None:
            run_record.write_record(model_dir, record)
    if nonfinite == "rollback" and not restored:
        saver.save(0)  # something to roll back to before the first periodic checkpoint
    metrics_log = MetricsLog(model_dir, enabled=runtime.is_chief)
    run = RunContext(
        model_dir=model_dir, is_chief=runtime.is_chief, total_steps=total_steps, start_step=start_step,
        global_batch_size=global_batch_size, strategy=runtime.strategy, model=task.models,
        optimizer=task.optimizers, saver=saver, evaluators=evaluators, metrics_log=metrics_log,
        print_fn=print_fn, loop=loop, hparams=dict(hparams or {}),
    )
    names = "+".join(type(m).__name__ for m in flat(task.models))
    print_fn(
        f"training {names} with strategy '{strategy}' on {runtime.num_replicas} replica(s) "
        f"({runtime.num_workers} worker(s)), global batch {global_batch_size}, "
        f"steps {start_step}->{total_steps}, {runtime.policy}{' with XLA' if jit_compile else ''}, "
        f"model_dir {model_dir}"
    )
    all_hooks = [
        *default_hooks,
        *([ConfigWriter(describe_config)] if describe_config else []),
        *([HParamsWriter(hparams)] if hparams else []),
        *([PreemptionHook(runtime.strategy, task.checkpoint, saver, print_fn)] if preemption_checkpointing else []),
        *([ema_lib.EmaEvalHook(average, hook_options.eval_every_steps)] if average is not None else []),
        *monitors,
        *([export_lib.ExportHook(serving_spec, runtime.cluster.task_name, average, best=next(
            (h for h in monitors if isinstance(h, best_checkpoints.BestCheckpointHook)), None))]
          if export_saved_model else []),
        *hooks,
    ]
    try:
        drive(loop, run, all_hooks, steps_per_loop, guard_nonfinite)
    finally:  # a run that stops (non-finite loss, preemption, a lost peer) keeps its event records too
        try:
            saver.wait()  # and finishes its pending checkpoint write, or says in one line that it failed
        finally:
            metrics_log.close()
    return run.last_eval


def check_user_functions(*, step_fn, eval_step_fn, model_fn, optimizer_fn, eval_metrics_fn, hooks,
                         parameter_server) -> None:
    """What gin binds to `train` is of the kind the loop calls: functions, hooks, settings objects."""
    for name, fn in (("step_fn", step_fn), ("eval_step_fn", eval_step_fn), ("model_fn", model_fn),
                     ("optimizer_fn", optimizer_fn), ("eval_metrics_fn", eval_metrics_fn)):
        check_callable(f"train.{name}", fn, what="a function (bind it as @name, without parentheses)",
                       optional=name == "eval_metrics_fn")
    if not isinstance(hooks, (list, tuple)) or not all(isinstance(h, Hook) for h in hooks):
        raise UserError(f"train.hooks must be a list of hooks (instances of trainer.hooks.base.Hook, bound as "
                        f"@my_hook()), got {hooks!r}")
    if parameter_server is not None and not isinstance(parameter_server, ParameterServerConfig):
        raise UserError(f"train.parameter_server must be @parameter_server(), got {parameter_server!r}")


def check_functions(loop, evaluators: Mapping, step_fn: Callable) -> None:
    """Traces the train and eval steps on the real batch specs before anything is written."""
    loop.trace(getattr(step_fn, "__name__", type(step_fn).__name__))
    for evaluator in evaluators.values():
        evaluator.trace()


def make_input(input_fn: Callable | None, data_source: Callable | None,
               eval_splits: Sequence[str] | None) -> data.Input:
    """The run's input: `train.input_fn` (or its older name `train.data_source`), digits by default."""
    if input_fn is not None and data_source is not None:
        raise UserError("both train.input_fn and train.data_source are set; they are the same thing: keep one")
    fn = input_fn if input_fn is not None else data_source if data_source is not None else data.Digits()
    if not callable(fn):
        raise UserError(f"train.input_fn must be a function fn(split) -> tf.data.Dataset, got {fn!r}")
    if eval_splits is None:
        splits = tuple(s for s in getattr(fn, "splits", ("train", "eval")) if s != "train") or ("eval",)
    elif isinstance(eval_splits, str) or not eval_splits or not all(isinstance(s, str) for s in eval_splits):
        raise UserError(f"train.eval_splits must be a non-empty list of split names, got {eval_splits!r}")
    else:
        splits = tuple(eval_splits)
    return data.as_input(fn, eval_splits=splits)


def setup(runtime_config: RuntimeConfig, inp: data.Input, *, model_fn: Callable, optimizer_fn: Callable,
          step_fn: Callable, eval_step_fn: Callable, global_batch_size: int, total_steps: int, seed: int
          ) -> tuple[Runtime, Task]:
    """Input checked, runtime made, task built: what `train` trains, also for trainer.bench and
    trainer.parity, so that what they measure is built exactly as a run builds it."""
    runtime = make_runtime(runtime_config)  # first: devices are split before any TensorFlow op runs
    inp.validate()
    inp.check_sizes(global_batch_size)
    runtime.check_batch_size(global_batch_size)
    keras.utils.set_random_seed(seed)
    task = build_task(runtime, inp, model_fn=model_fn, optimizer_fn=optimizer_fn, step_fn=step_fn,
                      eval_step_fn=eval_step_fn, global_batch_size=global_batch_size, total_steps=total_steps)
    return runtime, task


def defaults_with(bindings: Mapping[str, Any]) -> dict[str, Any]:
    """`train`'s parameters: its defaults with `bindings` (e.g. gin's `train.*` bindings) over them."""
    defaults = {name: p.default for name, p in inspect.signature(train).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return defaults | dict(bindings)


def setup_from(settings: Mapping[str, Any]) -> tuple[Runtime, Task]:
    """`setup` from `train`'s parameters by name (see `defaults_with`), checked as `train` checks them."""
    LoopOptions(**{f.name: settings[f.name] for f in dataclasses.fields(LoopOptions)})
    partitioner = getattr(settings.get("parameter_server"), "variable_partitioner", None)
    runtime_config = RuntimeConfig(
        strategy=settings["strategy"], device_config=settings["device_config"],
        cluster_resolver=settings["cluster_resolver"], cluster_resolver_options=settings["cluster_resolver_options"],
        collective_timeout_secs=settings["collective_timeout_secs"], variable_partitioner=partitioner,
        mixed_precision=settings["mixed_precision"],
    )
    inp = make_input(settings["input_fn"], settings["data_source"], settings["eval_splits"])
    return setup(runtime_config, inp, model_fn=settings["model_fn"], optimizer_fn=settings["optimizer_fn"],
                 step_fn=settings["step_fn"], eval_step_fn=settings["eval_step_fn"],
                 global_batch_size=settings["global_batch_size"], total_steps=settings["total_steps"],
                 seed=settings["seed"])
