"""`train`: the whole synchronous run from top to bottom, callable without gin.

config -> devices -> cluster -> strategy -> (model, optimizer, data) under strategy.scope()
-> restore -> loop (step in replica context, SUM in cross-replica context) -> hooks -> model_dir.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import keras
import tensorflow as tf

from trainer.distribution import cluster, devices, strategies
from trainer import data
from trainer.core import guard, models, optimizers, precision, steps
from trainer.core import nonfinite as nonfinite_lib, run_record
from trainer.core.checkpoints import CheckpointSaver
from trainer.errors import RunFailure, UserError
from trainer.core.hooks import CheckpointHook, ConfigWriter, EvalHook, HParamsWriter, Hook, ProgressLogger, RunContext
from trainer.core.loop import Evaluator, TrainLoop
from trainer.core.metrics_log import MetricsLog
from trainer.core.preemption import PreemptionHook
from trainer.core.ps_loop import ParameterServerConfig, build_ps_loops
from trainer.core.run_files import check_model_dir, prepare_model_dir

def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise UserError(f"train.{name} must be a positive integer, got {value!r}")


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
    check_loss_scaling: bool = True,
    jit_compile: bool = False,
    mixed_precision: str | None = None,
    model_fn: Callable = models.cnn,
    data_source: data.DataSource | None = None,
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
    nonfinite: str = "stop",
    max_rollbacks: int = 3,
    allow_resume_changes: bool = False,
    preemption_checkpointing: bool = False,
    hooks: Sequence[Hook] = (),
    describe_config: Callable[[], str] | None = None,
    hparams: Mapping[str, bool | int | float | str] | None = None,
    print_fn: Callable[[str], None] = print,
) -> dict[str, float]:
    """Trains until `total_steps`, resuming from the newest checkpoint in `model_dir`.

    Returns the final eval metrics (empty if the run had already finished).
    Raises UserError for mistakes the user can fix; nothing in `model_dir` is written
    before the configuration, data and checkpoint have been checked.

    Speed options: `jit_compile` compiles the per-replica step with XLA (synchronous
    strategies); `mixed_precision` is None/'float32', 'mixed_bfloat16' or 'mixed_float16'
    (with dynamic loss scaling; see trainer/precision.py for what a custom step must do).
    """
    _check_positive(
        total_steps=total_steps,
        global_batch_size=global_batch_size,
        steps_per_loop=steps_per_loop,
        log_every_steps=log_every_steps,
        checkpoint_every_steps=checkpoint_every_steps,
        eval_every_steps=eval_every_steps,
    )
    check_model_dir(model_dir)
    nonfinite_lib.check_options(nonfinite, max_rollbacks)
    if nonfinite == "rollback" and strategy == "parameter_server":
        raise UserError("train.nonfinite = 'rollback' is not supported with parameter_server; use 'stop'")
    policy = precision.check(mixed_precision)
    if jit_compile and strategy == "parameter_server":
        raise UserError("train.jit_compile works with the synchronous strategies only, not 'parameter_server'")
    source = data_source if data_source is not None else data.Digits()
    source.validate()
    data.check_sizes(source, global_batch_size)

    devices.configure_devices(device_config or devices.DeviceConfig())
    info = cluster.resolve(strategy, cluster_resolver, **(cluster_resolver_options or {}))
    dist = strategies.make_strategy(
        strategy,
        cluster_resolver=info.resolver,
        collective_timeout_secs=collective_timeout_secs,
        variable_partitioner=parameter_server.variable_partitioner if parameter_server else None,
    )
    replicas = dist.num_replicas_in_sync
    if global_batch_size % replicas:
        raise UserError(
            f"train.global_batch_size {global_batch_size} is not divisible by the {replicas} "
            f"replicas; use a multiple of {replicas}"
        )
    keras.utils.set_random_seed(seed)
    precision.set_global_policy(policy)  # before any layer exists; train's decorator puts it back

    with dist.scope():
        model = model_fn(source.input_shape, source.num_classes)
        optimizer = precision.wrap_optimizer(
            optimizer_fn(global_batch_size=global_batch_size, total_steps=total_steps), policy)
        optimizer.build(model.trainable_variables)  # rule 1: never lazily inside tf.function
        global_step = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="global_step",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        dropped = nonfinite_lib.dropped_batches_variable()
        checkpoint = tf.train.Checkpoint(
            model=model, optimizer=optimizer, global_step=global_step, dropped_batches=dropped,
            random_state=_random_states(model),
        )
    config_text = describe_config() if describe_config else ""
    record = run_record.make_record(
        strategy=strategy, num_replicas=replicas, num_workers=max(info.num_workers, 1),
        global_batch_size=global_batch_size, model=model, config_text=config_text,
    )
    run_record.check_resume(model_dir, record, allow_changes=allow_resume_changes)

    saver = CheckpointSaver(
        checkpoint, model_dir, is_chief=info.is_chief, task_name=info.task_name,
        max_to_keep=keep_checkpoints,
    )
    restored = saver.restore_latest(print_fn)
    start_step = int(global_step.numpy())
    if start_step >= total_steps:
        print_fn(f"already trained: {restored} is at step {start_step} >= train.total_steps {total_steps}; nothing to do")
        return {}
    if restored:
        print_fn(f"restored {restored}; continuing from step {start_step}")

    guard_nonfinite = nonfinite_lib.NonFiniteGuard(
        nonfinite, max_rollbacks, saver, global_step, dropped,
        rebuild_data=lambda step, drop: loop.set_dataset(data.distribute_train(
            dist, source, global_batch_size, seed, method=distribute_method, shard_policy=shard_policy,
            skip_steps=step, drop_batches=drop)),
        print_fn=print_fn,
    )
    if strategy == "parameter_server":
        loop, evaluator = build_ps_loops(
            dist, source, model, optimizer, global_step, step_fn, eval_step_fn,
            global_batch_size=global_batch_size, seed=seed, start_step=start_step,
            steps_per_loop=steps_per_loop, shard_policy=shard_policy, config=parameter_server,
            print_fn=print_fn,
        )
    else:
        loop, evaluator = _build_sync_loops(
            dist, source, model, optimizer, global_step, step_fn, eval_step_fn,
            global_batch_size=global_batch_size, seed=seed, start_step=start_step,
            distribute_method=distribute_method, shard_policy=shard_policy, jit_compile=jit_compile,
            drop_batches=guard_nonfinite.dropped,
        )

    if check_loss_scaling:  # rule 2: a mis-scaled step stops here, before its first update
        guard.check_loss_scaling(dist, model, optimizer, step_fn, source, global_batch_size=global_batch_size,
                                 seed=seed, print_fn=print_fn)

    if info.is_chief:
        prepare_model_dir(model_dir)
        if start_step == 0 and run_record.read_record(model_dir) is None:
            run_record.write_record(model_dir, record)
    if nonfinite == "rollback" and not restored:
        saver.save(0)  # something to roll back to before the first periodic checkpoint
    metrics_log = MetricsLog(model_dir, enabled=info.is_chief)
    run = RunContext(
        model_dir=model_dir, is_chief=info.is_chief, total_steps=total_steps,
        start_step=start_step, global_batch_size=global_batch_size, strategy=dist,
        model=model, optimizer=optimizer, saver=saver, evaluator=evaluator,
        metrics_log=metrics_log, print_fn=print_fn, loop=loop,
    )
    print_fn(
        f"training {type(model).__name__} with strategy '{strategy}' on {replicas} replica(s) "
        f"({max(info.num_workers, 1)} worker(s)), global batch {global_batch_size}, "
        f"steps {start_step}->{total_steps}, {policy}{' with XLA' if jit_compile else ''}, model_dir {model_dir}"
    )

    all_hooks = [
        ProgressLogger(log_every_steps),
        EvalHook(eval_every_steps),
        CheckpointHook(checkpoint_every_steps),
        *([ConfigWriter(describe_config)] if describe_config else []),
        *([HParamsWriter(hparams)] if hparams else []),
        *([PreemptionHook(dist, checkpoint, saver, print_fn)] if preemption_checkpointing else []),
        *hooks,
    ]
    try:
        _drive(loop, run, all_hooks, steps_per_loop, guard_nonfinite)
    finally:  # a run that stops (non-finite loss, preemption, a lost peer) keeps its event records too
        metrics_log.close()
    return run.last_eval


def _build_sync_loops(
    dist, source, model, optimizer, global_step, step_fn, eval_step_fn, *,
    global_batch_size, seed, start_step, distribute_method, shard_policy, jit_compile=False, drop_batches=(),
) -> tuple[TrainLoop, Evaluator]:
    """The compiled train loop and evaluator of the synchronous strategies."""
    train_data = data.distribute_train(
        dist, source, global_batch_size, seed,
        method=distribute_method, shard_policy=shard_policy, skip_steps=start_step,
        drop_batches=drop_batches,
    )
    eval_data = data.distribute_eval(
        dist, source, global_batch_size, method=distribute_method, shard_policy=shard_policy
    )
    num_eval_batches = -(-source.num_examples("eval") // global_batch_size)
    loop = TrainLoop(dist, model, optimizer, step_fn, global_batch_size, train_data, global_step,
                     jit_compile=jit_compile)
    return loop, Evaluator(dist, model, eval_step_fn, eval_data, num_eval_batches)


def _op_error_summary(error: Exception) -> str:
    """The line of a TensorFlow graph error that says what happened (not where)."""
    for line in str(error).splitlines():
        text = line.strip()
        if text and not line[0].isspace() and not text.startswith(("Graph execution error", "Detected at node", "File ")):
            return text.rstrip(".:")
    return "no detail"


def _peer_failure(error: Exception, step: int, num_steps: int, saver: CheckpointSaver) -> RunFailure:
    """A collective or remote call that failed: name the steps and where a rerun continues."""
    detail = _op_error_summary(error)
    latest = saver.latest()
    resume = f"a rerun continues from {latest}" if latest else "no checkpoint yet: a rerun starts over"
    return RunFailure(
        f"training failed in steps {step + 1}-{step + num_steps} ({type(error).__name__}: {detail}); "
        f"a peer task may have died or timed out; {resume}"
    )


def _random_states(model) -> list:
    """Keras seed-generator states (dropout and other random layers): checkpointed so that a
    resumed run draws the same random numbers as one that never stopped."""
    variables = getattr(model, "non_trainable_variables", [])
    return [v for v in variables if getattr(v, "path", "").endswith("seed_generator_state")]


def _drive(
    loop: TrainLoop, run: RunContext, hooks: Sequence[Hook], steps_per_loop: int,
    guard_nonfinite: nonfinite_lib.NonFiniteGuard,
) -> None:
    """The outer loop: compiled calls that end on the nearest hook boundary, hooks in between."""
    for hook in hooks:
        hook.begin(run)
    step = run.start_step
    while step < run.total_steps:
        boundaries = [b for h in hooks if (b := h.steps_to_boundary(step)) is not None]
        num_steps = min([steps_per_loop, run.total_steps - step, *boundaries])
        started = time.monotonic()
        try:
            metrics = loop.run(num_steps)
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError,
                tf.errors.CancelledError, tf.errors.InternalError) as e:
            raise _peer_failure(e, step, num_steps, run.saver) from e
        run.train_seconds += time.monotonic() - started
        bad_step = guard_nonfinite.first_bad_step(loop, metrics, step)
        if bad_step is not None:
            step = guard_nonfinite.recover(bad_step, metrics)
            for hook in hooks:
                hook.rewind(run, step)
            continue
        step += num_steps
        for hook in hooks:
            hook.after_loop(run, step, metrics)
    for hook in hooks:
        hook.end(run, step)
