"""The controller: restore -> loop calls -> hooks between them -> model_dir, for any loop.

The synchronous loop (`loop.TrainLoop`: strategy.run/reduce inside tf.function) and the
asynchronous one (`ps_loop.PSTrainLoop`: closures scheduled on a ClusterCoordinator) implement
the same `TrainLoopLike` protocol, and their evaluators `EvaluatorLike`; `build_loops` is the
one place that chooses between them. `drive` is the outer loop of every mode: compiled calls
that end on the nearest hook boundary, the non-finite guard after each, hooks in between.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping, Protocol, Sequence

import tensorflow as tf

from trainer import data
from trainer.safety import nonfinite as nonfinite_lib
from trainer.files.checkpoints import CheckpointSaver
from trainer.hooks.base import Hook, RunContext
from trainer.loops.sync import Evaluator, TrainLoop
from trainer.run.settings import LoopOptions
from trainer.loops.ps import ParameterServerConfig, build_ps_loops
from trainer.distribution.runtime import Runtime
from trainer.task.task import Task
from trainer.errors import RunFailure

PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError,
               tf.errors.CancelledError, tf.errors.InternalError)


class TrainLoopLike(Protocol):
    """What the controller needs of a train loop."""

    def run(self, num_steps: int) -> dict[str, float]:
        """Trains `num_steps` steps; returns each step output's mean over them."""

    def trace(self, step_name: str) -> None:
        """Traces the step on the real batch spec; a broken user function is one UserError line."""

    @property
    def trace_count(self) -> int:
        """How often the step was traced (1 when nothing retraces)."""


class EvaluatorLike(Protocol):
    def evaluate(self) -> dict[str, float]:
        """One pass over an eval split: per-example means, metric results and `num_examples`."""

    def trace(self) -> None:
        """Traces the eval pass on the real batch spec and checks what the eval step returns."""


def build_sync_loops(
    runtime: Runtime, task: Task, options: LoopOptions, *, start_step: int, drop_batches: Sequence[int] = (),
    eval_metrics_fn: Callable | None = None, after_update: Callable[[], None] | None = None,
) -> tuple[TrainLoop, dict[str, Evaluator]]:
    """The compiled train loop and, per eval split, an evaluator, for the synchronous strategies."""
    dist = runtime.strategy
    train_data = data.distribute_train(
        dist, task.input, options.global_batch_size, options.seed, method=options.distribute_method,
        shard_policy=options.shard_policy, skip_steps=start_step, drop_batches=drop_batches,
    )
    loop = TrainLoop(dist, task.models, task.optimizers, task.step_fn, options.global_batch_size, train_data,
                     task.global_step, jit_compile=options.jit_compile, after_update=after_update)
    with dist.scope():  # metric variables aggregate across replicas (and workers)
        metrics = eval_metrics_fn() if eval_metrics_fn else None
    evaluators = {}
    for split in task.input.eval_splits:
        eval_data = data.distribute_eval(dist, task.input, options.global_batch_size, split=split,
                                         method=options.distribute_method, shard_policy=options.shard_policy)
        num_batches = -(-task.input.num_examples(split) // options.global_batch_size)
        evaluators[split] = Evaluator(dist, task.models, task.eval_step_fn, eval_data, num_batches, metrics=metrics)
    return loop, evaluators


def build_loops(
    runtime: Runtime, task: Task, options: LoopOptions, *, start_step: int, drop_batches: Sequence[int] = (),
    eval_metrics_fn: Callable | None = None, parameter_server: ParameterServerConfig | None = None,
    print_fn: Callable[[str], None] = print, after_update: Callable[[], None] | None = None,
) -> tuple[TrainLoopLike, Mapping[str, EvaluatorLike]]:
    """The loop of the runtime's strategy: asynchronous for parameter_server, else synchronous."""
    if runtime.is_parameter_server:
        return build_ps_loops(runtime, task, options, start_step=start_step, eval_metrics_fn=eval_metrics_fn,
                              config=parameter_server, print_fn=print_fn)
    return build_sync_loops(runtime, task, options, start_step=start_step, drop_batches=drop_batches,
                            eval_metrics_fn=eval_metrics_fn, after_update=after_update)


def op_error_summary(error: Exception) -> str:
    """The line of a TensorFlow graph error that says what happened (not where)."""
    for line in str(error).splitlines():
        text = line.strip()
        if text and not line[0].isspace() and not text.startswith(("Graph execution error", "Detected at node", "File ")):
            return text.rstrip(".:")
    return "no detail"


def peer_failure(error: Exception, step: int, num_steps: int, saver: CheckpointSaver) -> RunFailure:
    """A collective or remote call that failed: name the steps and where a rerun continues."""
    latest = saver.latest()
    resume = f"a rerun continues from {latest}" if latest else "no checkpoint yet: a rerun starts over"
    return RunFailure(
        f"training failed in steps {step + 1}-{step + num_steps} ({type(error).__name__}: "
        f"{op_error_summary(error)}); a peer task may have died or timed out; {resume}"
    )


def drive(
    loop: TrainLoopLike, run: RunContext, hooks: Sequence[Hook], steps_per_loop: int,
    guard_nonfinite: nonfinite_lib.NonFiniteGuard,
) -> None:
    """The outer loop: compiled calls that end on the nearest hook boundary, hooks in between."""
    for hook in hooks:
        hook.begin(run)
    step = run.start_step
    while step < run.total_steps and not run.stop_requested:  # a hook may end the run early (every worker alike)
        boundaries = [b for h in hooks if (b := h.steps_to_boundary(step)) is not None]
        num_steps = min([steps_per_loop, run.total_steps - step, *boundaries])
        started = time.monotonic()
        try:
            metrics = loop.run(num_steps)
        except PEER_ERRORS as e:
            raise peer_failure(e, step, num_steps, run.saver) from e
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
