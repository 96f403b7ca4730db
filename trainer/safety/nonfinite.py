"""`train.nonfinite`: what to do when a step's outputs, its gradients or the weights stop being
finite: stop, or roll back and skip the batch.

Three checks, each cheap:
- the step's outputs (the loop's per-replica running sums, trainer/loops/totals.py);
- every update's gradients: the step gets each optimizer behind a stand-in whose
  `apply_gradients`/`apply` reduce the gradients to one sum (finite exactly when every element
  is, short of a float32 overflow) before the real optimizer applies them; a step whose update had
  a non-finite gradient reports its float outputs as NaN, so it counts as a non-finite step
  for the same decision, on any replica. The loss can stay finite while the gradient is not:
  NaN pixels vanish in the CNN's fused conv+ReLU, yet their kernels' gradients are NaN.
  Optimizers that handle non-finite gradients themselves (a LossScaleOptimizer skips such
  updates by design under mixed_float16) are left alone;
- the weights, at every step where something is saved or evaluated (checkpoint and eval
  boundaries, the last step): one sum over the trainable variables.

'stop' ends the run naming the first non-finite step and the last good checkpoint.
'rollback' restores the newest checkpoint and trains on without the offending batch, at most
`max_rollbacks` times. The skipped batches are kept in the checkpoint (`dropped_batches`), so
a resumed run skips them too and stays identical to one that never stopped.

An extension like any other: it adds `dropped_batches` to the checkpoint, tells the loop which
batches to skip (`Setup.skip_batches`), and throws a call's results away (`rollback_to`)
before any other hook sees them.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping

import keras
import numpy as np
import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import RunFailure, UserError
from trainer.extensions.protocol import Extension, Setup
from trainer.hooks.base import Run
from trainer.loops.build import distributed_train_data
from trainer.loops.controller import TrainLoopLike
from trainer.task.structure import flat
from trainer.task.user_code import call_user
from trainer.validation import check_choice, check_int

MODES = ("stop", "rollback")
CAPACITY = 64  # most batches a run can skip; fixed so checkpoints keep one shape


def dropped_batches_variable() -> tf.Variable:
    """Create under strategy.scope() and put in the checkpoint."""
    return tf.Variable(
        tf.fill([CAPACITY], tf.constant(-1, tf.int64)),
        trainable=False,
        name="dropped_batches",
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def read_dropped(variable: tf.Variable) -> list[int]:
    return sorted(int(i) for i in variable.numpy() if i >= 0)


def batch_index(step: int, dropped: list[int]) -> int:
    """Index in the unskipped batch stream of the batch that global step `step` (1-based) used."""
    index = step - 1
    for d in sorted(dropped):
        if d <= index:
            index += 1
    return index


def first_bad_step(loop: TrainLoopLike, metrics: Mapping[str, float], step: int) -> int | None:
    """The 1-based global step of the first non-finite output of the call that started at `step`."""
    if loop.last_nonfinite_offset is not None:
        return step + loop.last_nonfinite_offset + 1
    return None if all(math.isfinite(v) for v in metrics.values()) else step + 1


def all_finite(tensors: list) -> tf.Tensor:
    """Whether every element of `tensors` (None, IndexedSlices allowed) is finite: one sum per tensor."""
    values = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors if t is not None]
    if not values:
        return tf.constant(True)
    return tf.math.is_finite(tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in values]))


class FiniteGradients:
    """Stands in for `optimizer` in the step: notes whether each update's gradients are finite,
    then lets the real optimizer apply them. Everything else is the real optimizer's."""

    def __init__(self, optimizer: Any):
        self._optimizer = optimizer
        self.finite: list[tf.Tensor] = []

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        pairs = list(grads_and_vars)
        self.finite.append(all_finite([g for g, _ in pairs]))
        return self._optimizer.apply_gradients(pairs, *args, **kwargs)

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, *args, **kwargs):
        grads = list(grads)
        self.finite.append(all_finite(grads))
        return self._optimizer.apply(grads, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def _checked(optimizer: Any) -> Any:
    if isinstance(optimizer, getattr(keras.optimizers, "LossScaleOptimizer", ())):
        return optimizer  # it skips non-finite updates itself (its scale finds them by design)
    return FiniteGradients(optimizer)


def checking_gradients(step_fn: Callable) -> Callable:
    """`step_fn` whose float outputs are NaN where an update of its had a non-finite gradient."""

    @functools.wraps(step_fn)
    @tf.autograph.experimental.do_not_convert
    def step(model, optimizer, batch, global_batch_size):
        stand_ins = (
            {k: _checked(o) for k, o in optimizer.items()} if isinstance(optimizer, Mapping) else _checked(optimizer)
        )
        outputs = call_user(step_fn, model, stand_ins, batch, global_batch_size)
        graph = tf.compat.v1.get_default_graph()
        # A flag made inside the step's own control flow (an update under `if`) cannot leave it;
        # such updates are left to the weights check.
        flags = [
            f
            for o in flat(stand_ins)
            if isinstance(o, FiniteGradients)
            for f in o.finite
            if not tf.is_tensor(f) or getattr(f, "graph", graph) is graph
        ]
        if not flags or not isinstance(outputs, Mapping):
            return outputs
        finite = tf.reduce_all(tf.stack(flags))
        return {
            name: tf.where(finite, value, tf.constant(np.nan, value.dtype))
            if tf.is_tensor(value) and value.dtype.is_floating
            else value
            for name, value in outputs.items()
        }

    return step


class NonFiniteHandling(Extension):
    """Checks every loop call's outputs; stops, or rolls back past the offending batch."""

    name = "nonfinite"

    def __init__(self, mode: str = "stop", max_rollbacks: int = 3):
        check_choice("train.nonfinite", mode, MODES)
        check_int("train.max_rollbacks", max_rollbacks, minimum=0, maximum=CAPACITY)
        self.mode, self.max_rollbacks = mode, max_rollbacks
        self.setting = f"train.nonfinite = {mode!r}"
        self.supports = modes.ALL if mode == "stop" else modes.SYNCHRONOUS
        self.unsupported_reason = "asynchronous updates cannot be rolled back to one step"
        self.unsupported_fix = "use 'stop'"
        self._bad_steps: list[int] = []
        self.dropped: list[int] = []
        self._fresh = True

    def attach(self, setup: Setup) -> None:
        inp = setup.task.input
        if self.mode == "rollback" and not inp.deterministic:
            raise UserError(
                f"train.nonfinite = 'rollback' needs a deterministic input function, and {inp!r} declares "
                "deterministic = False (a roll-back must find the offending batch again); use 'stop'"
            )
        with setup.scope():
            self._variable = dropped_batches_variable()
        setup.add_checkpoint_item("dropped_batches", self._variable)
        setup.wrap_step(checking_gradients)
        self._setup = setup
        weights = [v for m in flat(setup.task.models) for v in getattr(m, "trainable_variables", ())]
        self._weights = weights
        self._weights_finite = tf.function(lambda: all_finite(weights), autograph=False)
        settings = setup.settings
        self._check_every = sorted({settings.checkpoint_every_steps, settings.eval_every_steps})

    def restored(self, setup: Setup, path: str | None) -> None:
        self._fresh = path is None
        self.dropped = read_dropped(self._variable)
        setup.skip_batches(self.dropped)

    def begin(self, run: Run) -> None:
        if self.mode == "rollback" and self._fresh:
            run.saver.save(run.start_step)  # something to roll back to before the first periodic checkpoint

    def rollback_to(self, run: Run, step: int, num_steps: int, metrics: Mapping[str, float]) -> int | None:
        bad_step = first_bad_step(run.loop, metrics, step)
        if bad_step is not None:
            return self._recover(run, bad_step, metrics)
        end = step + num_steps
        if end >= run.total_steps or any(end % every == 0 for every in self._check_every):
            self._check_weights(run, step, end)
        return None

    def _check_weights(self, run: Run, step: int, end: int) -> None:
        """Stops a run whose weights went non-finite with finite outputs and gradients (before they are saved)."""
        if not self._weights or bool(self._weights_finite()):
            return
        name = next(
            (getattr(v, "path", v.name) for v in self._weights if not np.all(np.isfinite(v.numpy()))), "a weight"
        )
        latest = run.saver.latest()
        where = f"the last good checkpoint is {latest}" if latest else "there is no checkpoint yet"
        raise RunFailure(
            f"the weights are non-finite ({name}) after steps {step + 1}-{end}, whose outputs and "
            f"gradients were finite; stopped before saving them; {where}"
        )

    def _recover(self, run: Run, bad_step: int, metrics: Mapping[str, float]) -> int:
        """Rolls back past `bad_step` and returns the step training continues from."""
        self._bad_steps.append(bad_step)
        shown = ", ".join(f"{k} {v:g}" for k, v in metrics.items() if not math.isfinite(v)) or "non-finite output"
        latest = run.saver.latest()
        where = f"the last good checkpoint is {latest}" if latest else "there is no checkpoint yet"
        if self.mode == "stop":
            raise RunFailure(f"step {bad_step} gave a non-finite output or gradient ({shown}); stopped; {where}")
        if len(self._bad_steps) > self.max_rollbacks:
            steps = ", ".join(map(str, self._bad_steps))
            raise RunFailure(
                f"outputs were non-finite {len(self._bad_steps)} times (steps {steps}), more than "
                f"train.max_rollbacks {self.max_rollbacks}; stopped; {where}"
            )
        bad_batch = batch_index(bad_step, self.dropped)
        path = run.saver.restore_latest(run.print_fn)
        if path is None:
            raise RunFailure(
                f"step {bad_step} gave a non-finite output or gradient ({shown}) and there is no "
                "checkpoint to roll back to"
            )
        self.dropped = sorted(set(self.dropped) | set(read_dropped(self._variable)) | {bad_batch})
        if len(self.dropped) > CAPACITY:
            raise RunFailure(f"more than {CAPACITY} batches skipped; stopped; {where}")
        self._variable.assign(self.dropped + [-1] * (CAPACITY - len(self.dropped)))
        restored_step = int(self._setup.task.global_step.numpy())
        settings, runtime = self._setup.settings, self._setup.runtime
        run.loop.set_dataset(
            distributed_train_data(
                runtime.strategy, self._setup.task.input, settings, skip_steps=restored_step, drop_batches=self.dropped
            )
        )
        run.print_fn(
            f"step {bad_step} gave a non-finite output or gradient ({shown}); rolled back to {path} (step "
            f"{restored_step}) and skipping batch {bad_batch} "
            f"({len(self._bad_steps)}/{self.max_rollbacks} roll-backs)"
        )
        return restored_step
