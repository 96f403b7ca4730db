"""`train.train_metrics_reset`: Keras metrics the train step updates, as TensorFlow's custom-training
tutorials use them: created with the model (`model.train_accuracy = keras.metrics.SparseCategoricalAccuracy()`),
or by a function bound as `train.train_metrics_fn` that returns `{name: metric}` and the same objects on every
call (`functools.cache`: the loop calls it first, under the scope; the step calls it to reach them, as the
tutorial reaches its globals), updated in the step (`train_accuracy.update_state(labels, predictions)`), read
and reset by the loop.

At each log interval the loop reads every such metric's `result()` and puts it beside the step's outputs, so
metrics.jsonl, TensorBoard and the console show the value at that boundary (not a mean of running values).
The metrics are reset after each log interval ('log', the default) or after each epoch ('epoch': the train
split's examples // global batch size steps, the tutorial's `steps_per_epoch`); with 'epoch' a log line shows
the epoch's value so far. Under the synchronous strategies a metric created under the scope keeps per-replica
sums (synchronization ON_READ) that are added over every replica and worker when read: its result is the
one-device value. The metrics' variables are checkpointed (key `train_metrics`), so a resume mid-interval
continues them. Under parameter_server a worker's updates are not summed into the coordinator's metric, so a
model holding metrics is refused there: return the metric's share from the step instead.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import keras
import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension, Outputs
from trainer.loops.evaluator import metric_results
from trainer.task.contract import function_name
from trainer.task.structure import flat

RESETS = ("log", "epoch")
LATEST = "latest_train_values"  # names whose value at a log boundary is shown as is (progress, Keras callbacks)
PS_FIX = (
    "return the metric's share from the step instead, e.g. {'accuracy': tf.reduce_sum(correct) / "
    "global_batch_size}: a share is summed over every worker"
)


def train_metrics(models: Any) -> dict[str, keras.metrics.Metric]:
    """The Keras metrics the models hold (attributes of a Keras model or of its layers), by name; not those of
    `compile` (its loss tracker and compiled metrics, which `fit` alone updates)."""
    found: dict[str, keras.metrics.Metric] = {}
    for model in flat(models):
        for metric in keras.layers.Layer.metrics.fget(model) if isinstance(model, keras.layers.Layer) else []:
            if found.setdefault(metric.name, metric) is not metric:
                raise UserError(
                    f"the model holds two train metrics named {metric.name!r}; give each its own name "
                    "(keras.metrics.Mean(name=...))"
                )
    return found


def bound_metrics(metrics_fn: Callable[[], Mapping[str, Any]]) -> dict[str, keras.metrics.Metric]:
    """`metrics_fn()`, checked to be a dict of names to Keras metrics that a second call returns again (the step
    reaches them by calling it)."""
    shown = function_name(metrics_fn)
    metrics = metrics_fn()
    if not isinstance(metrics, Mapping) or not all(
        isinstance(k, str) and isinstance(m, keras.metrics.Metric) for k, m in metrics.items()
    ):
        raise UserError(
            f"train.train_metrics_fn {shown} returned {type(metrics).__name__}; return a dict of names to Keras "
            "metrics, e.g. {'train_accuracy': keras.metrics.SparseCategoricalAccuracy()}"
        )
    again = metrics_fn()
    if not isinstance(again, Mapping) or any(again.get(k) is not m for k, m in metrics.items()):
        raise UserError(
            f"train.train_metrics_fn {shown} returns new metrics on each call, so the step could not reach the ones "
            "the loop reads; decorate it with @functools.cache"
        )
    return dict(metrics)


class MetricState(tf.Module):
    """The metrics' variables, for the checkpoint (a Keras 3 model does not save its metrics)."""

    def __init__(self, metrics: dict[str, keras.metrics.Metric]):
        super().__init__(name="train_metrics")
        self.by_name = {name: list(metric.variables) for name, metric in metrics.items()}


class TrainMetrics(Extension):
    """Reads the train metrics' results at each log interval and resets them at `reset` boundaries."""

    name = "train_metrics"
    setting = "train.train_metrics_reset"

    def __init__(self, reset: str, log_every_steps: int, metrics_fn: Callable[[], Mapping[str, Any]] | None = None):
        if reset not in RESETS:
            raise UserError(
                f"train.train_metrics_reset must be one of {', '.join(map(repr, RESETS))} or None, got {reset!r}"
            )
        self.reset = reset
        self._log_every = log_every_steps
        self._reset_every = log_every_steps
        self._metrics_fn = metrics_fn
        self._metrics: dict[str, keras.metrics.Metric] = {}
        self._shown: set[str] = set()  # the names their results are logged under (`name/key` for a dict result)

    def attach(self, context: Context) -> None:
        self._metrics = train_metrics(context.task.models)
        if self._metrics_fn is not None:
            with context.scope():  # per-replica sums, added over every replica and worker when read
                bound = bound_metrics(self._metrics_fn)
            if clash := sorted(set(bound) & set(self._metrics)):
                raise UserError(
                    f"train.train_metrics_fn returns {clash[0]!r}, the name of a metric the model holds; rename one"
                )
            self._metrics.update(bound)
        if not self._metrics:
            return
        shown = ", ".join(self._metrics)
        modes.require(
            f"Keras metrics held by the model and updated in the train step ({shown})",
            modes.SYNCHRONOUS,
            context.settings.strategy,
            reason="a worker's updates are not summed into the coordinator's metric",
            fix=PS_FIX,
        )
        if self.reset == "epoch":
            self._reset_every = max(1, context.task.input.num_examples("train") // context.settings.global_batch_size)
        context.add_checkpoint_item("train_metrics", MetricState(self._metrics))
        context.provide(LATEST, self._shown)
        context.print(
            f"train metrics {shown}: result() logged every {self._log_every} steps, reset every "
            f"{self._reset_every} steps ({'each log interval' if self.reset == 'log' else 'each epoch'})"
        )

    def verify(self, outputs: Outputs) -> None:
        clash = sorted(set(self._metrics) & set(outputs.train))
        if clash:
            raise UserError(
                f"the train step returns {clash[0]!r}, the name of a Keras metric the model holds; rename one of them"
            )

    def steps_to_boundary(self, step: int) -> int | None:
        if not self._metrics:
            return None
        return min(every - step % every for every in (self._log_every, self._reset_every) if every > 0)

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if not self._metrics:
            return
        last = step >= context.settings.total_steps
        with context.scope():  # read in cross-replica context: the sum over every replica and worker
            if last or (self._log_every > 0 and step % self._log_every == 0):
                results = metric_results(self._metrics)
                self._shown.update(results)
                metrics.update(results)
            if step % self._reset_every == 0:
                for metric in self._metrics.values():
                    metric.reset_state()
