"""Standard Keras 3 callbacks (EarlyStopping, ReduceLROnPlateau, CSVLogger, your own) run as one
extension, with the calls they get from `fit` (the table: docs/around-the-step.md).

An "epoch" is the interval between two evals; `on_train_batch_end` comes after each compiled loop
call, `on_epoch_end` at each eval with the eval outputs prefixed 'val_' ('val_<split>_' for other
splits). Callbacks run on every worker, so learning-rate changes stay alike (CSVLogger writes on
the chief only); `model.stop_training` on any worker stops all after the same loop call (agreed
by an all-reduce). Callback state is not checkpointed (the learning rate is).
"""

from __future__ import annotations

import functools
import math
import shutil
import tempfile
import traceback
from typing import Any, Callable, Sequence

import keras

from trainer import internals
from trainer.distribution import modes
from trainer.errors import RunFailure, UserError
from trainer.extensions.context import Context
from trainer.extensions.monitoring import AnyWorker
from trainer.extensions.protocol import Extension
from trainer.extensions.train_metrics import LATEST
from trainer.task.user_code import raised_by

REFUSED = {
    "ModelCheckpoint": "the run checkpoints itself (train.checkpoint_every_steps; best ones: train.keep_best)",
    "BackupAndRestore": "the run resumes from its newest checkpoint by itself",
    "TensorBoard": "the run writes TensorBoard event files to model_dir itself",
}
SETS_LEARNING_RATE = (keras.callbacks.ReduceLROnPlateau, keras.callbacks.LearningRateScheduler)


def check_callbacks(callbacks: Any) -> list[keras.callbacks.Callback]:
    """`train.keras_callbacks` as a list, each a callback this loop can drive (UserError otherwise)."""
    if not isinstance(callbacks, (list, tuple)) or not all(isinstance(c, keras.callbacks.Callback) for c in callbacks):
        raise UserError(
            f"train.keras_callbacks must be a list of keras.callbacks.Callback instances, got {callbacks!r}"
        )
    for callback in callbacks:
        for refused, instead in REFUSED.items():
            if isinstance(callback, getattr(keras.callbacks, refused)):
                raise UserError(f"train.keras_callbacks: keras.callbacks.{refused} is not needed here: {instead}")
    return list(callbacks)


def _calling_callbacks(method: Callable) -> Callable:
    """An exception a callback raises in `method` becomes one line naming it, with its own frames above."""

    @functools.wraps(method)
    def calling(self: "KerasCallbacks", *args: Any) -> None:
        try:
            method(self, *args)
        except (UserError, RunFailure):
            raise
        except Exception as e:  # noqa: BLE001  (what a user's callback raises is theirs to fix)
            name = self._raiser(e)
            raise raised_by(e, name, f"{name} (train.keras_callbacks)") from e

    return calling


class KerasCallbacks(Extension):
    """Keras callbacks driven from the loop's boundaries and evals (see the module doc)."""

    name = "keras_callbacks"
    setting = "train.keras_callbacks"
    supports = modes.SYNCHRONOUS
    unsupported_reason = "fit's callbacks expect one synchronous model"
    unsupported_fix = "use train.early_stopping there"
    after = ("eval",)

    def __init__(self, callbacks: Sequence[keras.callbacks.Callback], eval_every_steps: int):
        self._callbacks = check_callbacks(callbacks)
        self._eval_every = eval_every_steps
        self._list: keras.callbacks.CallbackList | None = None
        self._temp_dirs: list[str] = []
        self._sums: dict[str, float] = {}  # step-weighted train outputs of this epoch's steps so far
        self._latest: dict[str, float] = {}  # train metrics' results at their latest log boundary
        self._count = 0  # those steps
        self._epoch_start = 0  # the step the current epoch started after
        self._last_step = 0
        self._last_logs: dict[str, float] = {}
        self._any_worker: AnyWorker | None = None

    def attach(self, context: Context) -> None:
        model, optimizer = context.task.models, context.task.optimizers
        if not isinstance(model, keras.Model) or not isinstance(optimizer, keras.optimizers.Optimizer):
            raise UserError(
                "train.keras_callbacks needs one Keras model and one Keras optimizer (train.model_fn / "
                f"train.optimizer_fn returned {type(model).__name__} / {type(optimizer).__name__})"
            )
        schedule = isinstance(internals.keras_learning_rate(optimizer), keras.optimizers.schedules.LearningRateSchedule)
        for callback in self._callbacks:
            if schedule and isinstance(callback, SETS_LEARNING_RATE):
                raise UserError(
                    f"train.keras_callbacks: {type(callback).__name__} sets the learning rate, but the "
                    "optimizer's rate is a schedule (make_optimizer's reference_batch_size, warmup_steps "
                    "or decay); use a constant rate or leave the callback out"
                )
        self._model, self._optimizer = model, optimizer

    def _raiser(self, error: Exception) -> str:
        """`Class.method` of the callback whose method raised `error` (the innermost one)."""
        for frame, _ in reversed(list(traceback.walk_tb(error.__traceback__))):
            owner = frame.f_locals.get("self")
            if any(owner is callback for callback in self._callbacks):
                return f"{type(owner).__name__}.{frame.f_code.co_name}"
        return "a Keras callback"

    @_calling_callbacks
    def begin(self, context: Context) -> None:
        self._any_worker = AnyWorker(context.runtime.strategy)
        if not context.runtime.is_chief:
            for callback in self._callbacks:
                if isinstance(callback, keras.callbacks.CSVLogger):
                    self._temp_dirs.append(tempfile.mkdtemp(prefix="trainer-csvlogger-"))
                    callback.filename = f"{self._temp_dirs[-1]}/log.csv"
        self._model.optimizer = self._optimizer
        self._model.stop_training = False
        self._list = keras.callbacks.CallbackList(
            self._callbacks,
            model=self._model,
            verbose=0,
            steps=self._eval_every,
            epochs=math.ceil(context.settings.total_steps / self._eval_every),
        )
        self._list.on_train_begin()
        self._epoch_start = context.start_step - context.start_step % self._eval_every
        self._last_step = context.start_step
        self._list.on_epoch_begin(self._epoch(context.start_step + 1))

    def _epoch(self, step: int) -> int:
        return math.ceil(step / self._eval_every) - 1

    @_calling_callbacks
    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        steps, self._last_step = step - self._last_step, step
        self._count += steps
        latest = context.values.get(LATEST, frozenset())  # a train metric's result(), as read at a log boundary
        for key, value in metrics.items():
            if key in latest:
                self._latest[key] = value
            else:
                self._sums[key] = self._sums.get(key, 0.0) + value * steps
        logs = self._train_logs()
        self._list.on_train_batch_end(step - self._epoch_start - 1, logs)
        if context.evaluations.at(step) is not None:
            self._end_epoch(context, step, logs)
            if step < context.settings.total_steps:
                self._list.on_epoch_begin(self._epoch(step + 1))
        if self._any_worker(bool(self._model.stop_training)):
            self._model.stop_training = True
            context.request_stop()

    def _end_epoch(self, context: Context, step: int, logs: dict[str, float]) -> None:
        for index, (split, results) in enumerate(context.evaluations.latest.items()):
            prefix = "val_" if index == 0 else f"val_{split}_"
            logs = logs | {prefix + k: v for k, v in results.items()}
        self._list.on_epoch_end(self._epoch(step), logs)
        self._last_logs = logs
        self._sums, self._count, self._epoch_start = {}, 0, step

    def _train_logs(self) -> dict[str, float]:
        return ({k: v / self._count for k, v in self._sums.items()} if self._count else {}) | self._latest

    @_calling_callbacks
    def end(self, context: Context, step: int) -> None:
        # the final eval (or one after a stop)
        if context.evaluations.at(step) is not None and self._epoch_start != step:
            self._end_epoch(context, step, self._train_logs())
        self._list.on_train_end(self._last_logs)
        for temp_dir in self._temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)

    def rewind(self, context: Context, step: int) -> None:
        self._sums, self._count, self._last_step = {}, 0, step
        self._epoch_start = step - step % self._eval_every
