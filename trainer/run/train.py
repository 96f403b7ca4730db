"""`train`: the facade, a short composition readable top to bottom.

settings -> extensions (checked, ordered) -> runtime -> task -> extensions attached to the run's
one `Context` -> restore -> loops (traced, outputs verified) -> model_dir (chief) -> controller.
Nothing is written before every check; what shows only at the first step is undone while no step
has finished (trainer/run/unfinished.py). A new feature is an extension, not a line here.
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf

from trainer.data.distribute import shards_by_file
from trainer.errors import UserError, error_line
from trainer.extensions import built_in
from trainer.extensions.context import Context
from trainer.extensions.protocol import Outputs, check_method_names
from trainer.extensions.registry import Registry
from trainer.files import model_dir as model_dir_lib
from trainer.files import run_lock, run_record
from trainer.files.checkpoints import CheckpointSaver
from trainer.files.metrics_log import MetricsLog
from trainer.files.run_checkpoint import RunCheckpoint
from trainer.loops.build import build_loops
from trainer.loops.controller import drive
from trainer.run.settings import Settings, signature
from trainer.run.setup import setup
from trainer.run.unfinished import undone_unless_a_step_finishes
from trainer.task import precision
from trainer.task.contract import function_name
from trainer.task.structure import flat
from trainer.task.user_code import name_of

# What TensorFlow raises when an op gets values it cannot take (a label of 10 for 10 classes, a
# string where a number goes): in a run whose step and model traced, that is the data's doing.
DATA_ERRORS = (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError)


@precision.keeps_global_policy
@run_lock.released_at_exit  # model_dir's claim, however the run ends (trainer/extensions/run_lock.py)
def train(**arguments: Any) -> dict[str, float]:
    """Trains until `total_steps`, resuming from the newest checkpoint in `model_dir`; the arguments
    are `Settings`' fields. Returns the first eval split's final results ({} if nothing was left)."""
    settings = Settings.of(arguments)
    registry = checked_registry(settings)
    runtime, task = setup(settings)
    context = Context(settings, runtime, task, registry.contributions)
    registry.attach(context)
    record = _checked_record(settings, runtime, task, context.print)
    context.saver = saver = CheckpointSaver(
        RunCheckpoint(task.checkpoint_items, registry.states()),
        settings.model_dir,
        is_chief=runtime.is_chief,
        task_name=runtime.cluster.task_name,
        max_to_keep=settings.keep_checkpoints,
        async_checkpoint=settings.async_checkpoint,
    )
    restored = saver.restore_latest(context.print)
    registry.restored(context, restored)
    context.start_step = start_step = int(task.global_step.numpy())
    if start_step >= settings.total_steps:
        context.print(
            f"already trained: {restored} is at step {start_step} >= train.total_steps "
            f"{settings.total_steps}; nothing to do"
        )
        return {}
    if restored:
        context.print(f"restored {restored}; continuing from step {start_step}")
    contributions = registry.contributions
    context.loop, context.evaluators = build_loops(
        runtime,
        task,
        settings,
        start_step=start_step,
        step_fn=contributions.wrap(task.step_fn),
        drop_batches=contributions.skipped_batches,
        after_update=contributions.after_update_action(),
        print_fn=context.print,
    )
    registry.verify(
        Outputs(
            train=context.loop.trace(function_name(task.step_fn)),
            eval={split: evaluator.trace() for split, evaluator in context.evaluators.items()},
        )
    )
    with undone_unless_a_step_finishes(
        settings.model_dir, is_chief=runtime.is_chief, finished=lambda: int(task.global_step.numpy()) > start_step
    ):
        model_dir_lib.prepare(settings.model_dir, record, is_chief=runtime.is_chief, start_step=start_step)
        context.metrics_log = MetricsLog(settings.model_dir, enabled=runtime.is_chief)
        context.print(_start_line(settings, runtime, task, start_step))
        try:
            drive(context, registry.extensions, settings.steps_per_loop)
        except DATA_ERRORS as e:
            raise data_error(e, settings, int(task.global_step.numpy()), num_classes=task.input.num_classes) from None
    return context.evaluations.first_split


train.__signature__ = signature()  # gin reads the parameters (Settings' fields) from here


def checked_registry(settings: Settings) -> Registry:
    """The run's extensions, each having checked the settings, and model_dir checked: what a run
    refuses from its settings alone, before TensorFlow runs (and before an embedded cluster starts)."""
    participants = built_in.participants(settings)
    check_method_names(participants)
    registry = Registry(participants, settings)
    registry.check()
    model_dir_lib.check_model_dir(settings.model_dir)
    return registry


def _checked_record(settings: Settings, runtime, task, print_fn) -> dict:
    """The run record of this run, refused if model_dir holds a run started with other settings."""
    pipelines = tf.distribute.InputContext(num_input_pipelines=runtime.num_workers)
    record = run_record.make_record(
        strategy=settings.strategy,
        num_replicas=runtime.num_replicas,
        num_workers=runtime.num_workers,
        global_batch_size=settings.global_batch_size,
        model=task.models,
        config_text=settings.describe_config() if settings.describe_config else "",
        batches_independent_of_workers=settings.mode.synchronous
        and not settings.data_service
        and not shards_by_file(task.input, settings.shard_policy, pipelines),
        data_service=bool(settings.data_service),
    )
    run_record.check_resume(settings.model_dir, record, allow_changes=settings.allow_resume_changes, print_fn=print_fn)
    return record


def data_error(error: tf.errors.OpError, settings: Settings, step: int, num_classes: int | None = None) -> UserError:
    """The one line for an op that could not take a batch's values: which op, at which step, what to check. A
    label past the model's logits where the input has more classes is the model's width, not the data."""
    nodes = re.findall(r"\{\{node ([^}]+)\}\}", str(error))
    op = nodes[-1].split("/")[-1] if nodes else (error.op.type if error.op is not None else "a TensorFlow op")
    summary = error_line(error)
    summary = summary if len(summary) <= 160 else summary[:160] + "..."
    failed = f"op {op} failed on a batch after step {step} ({type(error).__name__}: {summary})"
    width = re.search(r"outside the valid range of \[0, (\d+)\)", str(error))
    if width and num_classes and int(width.group(1)) < num_classes:
        return UserError(
            f"{failed}: the model (train.model_fn = @{name_of(settings.model_fn)}) outputs {width.group(1)} logits "
            f"but {settings.input_named} has {num_classes} classes; give the model num_classes outputs (declare "
            "a num_classes parameter in model_fn: the loop passes it)"
        )
    return UserError(
        f"{failed}: check what {settings.input_named} yields and what the steps (train.step_fn = "
        f"@{name_of(settings.step_fn)}) do with it: labels must be integers 0..num_classes-1, features numbers"
    )


def _start_line(settings: Settings, runtime, task, start_step: int) -> str:
    names = "+".join(type(m).__name__ for m in flat(task.models))
    return (
        f"training {names} with strategy '{settings.strategy}' on {runtime.num_replicas} replica(s) "
        f"({runtime.num_workers} worker(s)), global batch {settings.global_batch_size}, "
        f"steps {start_step}->{settings.total_steps}, {runtime.policy}{' with XLA' if settings.jit_compile else ''}, "
        f"model_dir {settings.model_dir}"
    )
