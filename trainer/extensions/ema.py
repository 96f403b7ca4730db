"""`train.ema_decay`: an exponential moving average of the trained weights, for eval and export.

After every update, `ema = decay * ema + (1 - decay) * weight` per trainable variable. Correct
on any number of replicas because:
- the averages are created under `strategy.scope()` with their weight's aggregation, so they are
  placed where the weights are, and checkpointed (key `ema`): a resumed run continues them;
- they are updated inside the compiled loop, after `strategy.run`, in cross-replica context, from
  the identical updated weights: every copy gets the same value, no collective is needed, and
  automatic control dependencies order the read after the update;
- EMA eval swaps them in, evaluates every split (`<split>_ema`), and swaps back, on every worker.
Not under parameter_server: asynchronous updates have no single "after the update" point.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import tensorflow as tf

from trainer.distribution import modes
from trainer.extensions.averaged_weights import AveragedWeights
from trainer.extensions.context import Context
from trainer.extensions.export import EXPORT_WEIGHTS, ExportWeights
from trainer.task.structure import trainable_variables
from trainer.validation import check_number


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
            tf.Variable(
                tf.convert_to_tensor(w),
                trainable=False,
                name=f"ema_{i}",
                aggregation=_aggregation(w),
                synchronization=tf.VariableSynchronization.ON_WRITE,
            )
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


class Ema(AveragedWeights):
    """`train.ema_decay`: the averages, their eval after every raw eval, and the weights to export."""

    name = "ema"
    weights_label = "EMA"
    setting = "train.ema_decay"
    supports = modes.SYNCHRONOUS
    unsupported_reason = "asynchronous updates have no single point after an update to average at"
    after = ("warm_start", "eval")  # a fresh run averages from the warm-started weights

    def __init__(self, decay: float):
        check_number("train.ema_decay", decay, minimum=0.0, below=1.0)
        self.decay = float(decay)
        self._evaluated: int | None = None

    def attach(self, context: Context) -> None:
        with context.scope():
            self.average = WeightAverage(context.task.models, self.decay)
        context.add_checkpoint_item("ema", self.average)  # before the restore: a resumed run continues it
        context.after_update(self.average.update)
        context.provide(EXPORT_WEIGHTS, ExportWeights("EMA weights", self.average.swapped_in, {"ema": self.average}))

    def restored(self, context: Context, path: str | None) -> None:
        if path is None:
            self.average.reset()

    def swapped_in(self) -> contextlib.AbstractContextManager[None]:
        return self.average.swapped_in()

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if context.evaluations.at(step) is not None and self._evaluated != step:
            self.evaluate_weights(context, step)
            self._evaluated = step

    def end(self, context: Context, step: int) -> None:
        self.after_loop(context, step, {})  # the final eval, if it was not at a boundary
