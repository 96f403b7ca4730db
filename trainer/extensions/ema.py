"""`train.ema_decay`: an exponential moving average of the trained weights, for eval and export.

After every optimizer update, `ema = decay * ema + (1 - decay) * weight` for each trainable
variable of every model. Why it is correct on any number of replicas:

- The averages are variables created under `strategy.scope()` with the aggregation of the
  weight they follow, so they are mirrored exactly where the weights are (one copy per device
  under mirrored and multi_worker_mirrored, one on the CPU under central_storage) and go into
  the run's `tf.train.Checkpoint` (key `ema`): a resumed run continues the same averages.
- They are updated inside the compiled train loop, right after `strategy.run` returns, in
  cross-replica context: every replica's copy is assigned the same value, computed from the
  updated (mirrored, identical) weights, so the copies cannot drift apart and no collective
  is needed. The loop's automatic control dependencies order the read after the update.
- EMA eval swaps the averages into the weights, evaluates every split, and swaps back; every
  worker does the same at the same step (the eval's collectives need all of them).

EMA results are logged as their own split: `<split>_ema` (e.g. `eval_ema`) in metrics.jsonl
and TensorBoard, beside the raw `<split>` results. Not under parameter_server: the workers'
asynchronous updates have no single "after the update" point to average at.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import tensorflow as tf

from trainer.hooks.base import EvalHook, RunContext, evaluate_splits
from trainer.task.task import trainable_variables
from trainer.errors import UserError
from trainer.validation import check_number


def check_ema_decay(ema_decay: Any, strategy: str) -> None:
    """`train.ema_decay` is None or in (0, 1); refused under parameter_server."""
    check_number("train.ema_decay", ema_decay, minimum=0.0, below=1.0, optional=True)
    if ema_decay is not None and strategy == "parameter_server":
        raise UserError("train.ema_decay is not supported with parameter_server (asynchronous updates); "
                        "use a synchronous strategy or unset train.ema_decay")


def _aggregation(variable) -> tf.VariableAggregation:
    inner = getattr(variable, "value", variable)  # a Keras 3 variable wraps a tf.Variable
    aggregation = getattr(inner, "aggregation", None)
    return aggregation if isinstance(aggregation, tf.VariableAggregation) else tf.VariableAggregation.NONE


class WeightAverage(tf.Module):
    """The moving averages of `models`' trainable variables (create under the strategy's scope)."""

    def __init__(self, models: Any, decay: float):
        super().__init__(name="ema")
        self.decay = float(decay)
        self._weights = trainable_variables(models)
        self.averages = [
            tf.Variable(tf.convert_to_tensor(w), trainable=False, name=f"ema_{i}",
                        aggregation=_aggregation(w), synchronization=tf.VariableSynchronization.ON_WRITE)
            for i, w in enumerate(self._weights)
        ]

    def update(self) -> None:
        """One averaging step; call in cross-replica context after the update (inside tf.function)."""
        decay = tf.constant(self.decay, tf.float32)
        for average, weight in zip(self.averages, self._weights):
            value = tf.convert_to_tensor(weight)
            d = tf.cast(decay, value.dtype)
            average.assign(d * tf.convert_to_tensor(average) + (1 - d) * value)

    def reset(self) -> None:
        """Averages := current weights (a fresh run, after a warm start)."""
        for average, weight in zip(self.averages, self._weights):
            average.assign(tf.convert_to_tensor(weight))

    def _swap(self) -> None:
        for average, weight in zip(self.averages, self._weights):
            held = tf.identity(tf.convert_to_tensor(weight))
            weight.assign(tf.convert_to_tensor(average))
            average.assign(held)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The models hold the averages inside the block, their own weights again after it."""
        self._swap()
        try:
            yield
        finally:
            self._swap()


def attach(strategy: tf.distribute.Strategy, task: Any, decay: float | None) -> WeightAverage | None:
    """The task's weight average (None without `decay`), created under the scope and added to
    the task's checkpoint as `ema`, before any checkpoint is restored."""
    if decay is None:
        return None
    with strategy.scope():
        average = WeightAverage(task.models, decay)
    task.checkpoint.ema = average
    return average


class EmaEvalHook(EvalHook):
    """Evaluates every split with the averaged weights at each eval boundary and at the end,
    after the raw eval (EvalHook), and logs split `<split>_ema`."""

    def __init__(self, average: WeightAverage, every_steps: int):
        super().__init__(every_steps)
        self.average = average

    def _evaluate(self, run: RunContext, step: int) -> None:
        with self.average.swapped_in():
            evaluate_splits(run, step, suffix="_ema", label=" (EMA)")
        self._last_step = step
