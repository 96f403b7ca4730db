"""The eval pass: every example of an eval split once, in one compiled call."""

from __future__ import annotations

import copy
from typing import Callable, Mapping

import keras
import tensorflow as tf

from trainer.errors import UserError
from trainer.loops.totals import ReplicaTotals
from trainer.safety import tracing
from trainer.task import contract
from trainer.task.contract import function_name
from trainer.task.user_code import call_user, placed

StepFn = Callable[..., Mapping[str, tf.Tensor]]
WEIGHT_KEY = "__weight__"  # the real examples of a batch, counted by the loop itself


def make_metrics(eval_metrics_fn: Callable | None) -> dict[str, keras.metrics.Metric] | None:
    """`eval_metrics_fn()` (called under the metrics' scope), checked to be a dict of names to metrics."""
    if eval_metrics_fn is None:
        return None
    metrics = eval_metrics_fn()
    if not isinstance(metrics, Mapping) or not all(
        isinstance(k, str) and all(callable(getattr(m, a, None)) for a in ("update_state", "result", "reset_state"))
        for k, m in metrics.items()
    ):
        shown = type(metrics).__name__
        if isinstance(metrics, Mapping):
            shown = "{" + ", ".join(f"{k!r}: {type(m).__name__}" for k, m in metrics.items()) + "}"
        raise UserError(
            f"train.eval_metrics_fn {function_name(eval_metrics_fn)} returned {shown}; return a dict of names to Keras metrics, "
            "e.g. {'auc': keras.metrics.AUC()}"
        )
    return dict(metrics)


def metric_results(metrics: Mapping[str, keras.metrics.Metric]) -> dict[str, float]:
    """Each metric's result as a float; a metric returning a dict gives `name/key` entries."""
    results = {}
    for name, metric in metrics.items():
        value = metric.result()
        if isinstance(value, Mapping):
            results.update({f"{name}/{k}": float(v) for k, v in value.items()})
        else:
            results[name] = float(value)
    return results


class Evaluator:
    """One pass over an eval split. The eval step returns per-replica SUMS (divided by `num_examples`, its own
    or the weight of the real examples, or `x` by `x/denominator`), and/or updates the Keras metrics it gets
    as `metrics` (reset before the pass, read once after it)."""

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model,
        eval_step_fn: StepFn,
        dataset,
        num_batches: int,
        *,
        metrics: Mapping[str, keras.metrics.Metric] | None = None,
    ):
        self._dataset = dataset
        self._num_batches = num_batches
        self._outputs: tuple[str, ...] | None = None  # the result names, once traced
        self._metrics = dict(metrics or {})
        eval_step_fn = contract.adapt(eval_step_fn, contract.EVAL_STEP)  # by name, else by position
        takes_metrics = contract.takes(eval_step_fn, "metrics", contract.EVAL_STEP)
        if self._metrics and not takes_metrics:
            raise UserError(
                f"train.eval_metrics_fn gives metrics {sorted(self._metrics)} but train.eval_step_fn "
                f"{function_name(eval_step_fn)} takes no `metrics` parameter; "
                "declare eval_step_fn(model, batch, metrics) and update them there"
            )
        self._step_name = function_name(eval_step_fn)
        self.model = model  # its variables read once a pass under parameter servers (trainer/loops/ps_eval.py)

        def replica_fn(batch):
            batch = placed(batch)
            outputs = call_user(eval_step_fn, model, batch, *([self._metrics] if takes_metrics else []))
            if not isinstance(outputs, Mapping):
                raise UserError(
                    f"train.eval_step_fn {self._step_name} returned {type(outputs).__name__}; return "
                    "a dict of per-replica sums with 'num_examples' (or {} when it only updates metrics)"
                )
            return dict(outputs) | {WEIGHT_KEY: tf.reduce_sum(tf.cast(batch[-1], tf.float32))}

        # One replica's eval step, for a pass run elsewhere (trainer/loops/ps_eval.py).
        self.replica_fn = replica_fn
        totals = ReplicaTotals(strategy, replica_fn, "train.eval_step_fn", count_finite=False)

        def eval_batches(iterator, num_batches):
            return totals.sums(totals.accumulate(num_batches, lambda: next(iterator)))

        self._eval_batches = tf.function(eval_batches, autograph=False)

    def on(self, make_dataset: Callable[[], object], num_batches: int) -> "Evaluator":
        """The same compiled pass over another split of the same example structure, its data made at its
        first pass: thousands of eval splits are traced once and start at once, not one by one."""
        other = copy.copy(self)
        other._dataset, other._make_dataset, other._num_batches = None, make_dataset, num_batches
        other._original = self
        return other

    def trace(self) -> tuple[str, ...]:
        """Traces the eval pass now (the trace `evaluate` reuses) and checks what the step returns, before
        anything is written; the names of the results, without `num_examples`."""
        if self._dataset is None:  # a copy made by `on`: its original's trace serves it
            return self._original.trace()
        if self._outputs is not None:
            return self._outputs
        concrete = tracing.traced(
            "train.eval_step_fn",
            self._step_name,
            lambda: self._eval_batches.get_concrete_function(iter(self._dataset), tf.TensorSpec([], tf.int32)),
        )
        self._check_keys(concrete.structured_outputs)
        sums = [
            k
            for k in concrete.structured_outputs
            if k not in (WEIGHT_KEY, "num_examples") and not k.endswith(contract.DENOMINATOR)
        ]
        self._outputs = (*sums, *metric_results(self._metrics))
        return self._outputs

    def _check_keys(self, outputs: Mapping) -> None:
        keys = set(outputs) - {WEIGHT_KEY}
        for key in sorted(keys):
            if key.endswith(contract.DENOMINATOR) and key.removesuffix(contract.DENOMINATOR) not in keys:
                raise UserError(
                    f"train.eval_step_fn {self._step_name} returns {key!r} but no "
                    f"{key.removesuffix(contract.DENOMINATOR)!r}; '<name>{contract.DENOMINATOR}' is "
                    "what the loop divides the sum '<name>' by: return both, or rename it"
                )
        if keys and "num_examples" not in keys:
            raise UserError(
                f"train.eval_step_fn {self._step_name} returns {sorted(keys)} but no 'num_examples'; "
                "return per-replica sums and 'num_examples' (the sum of the batch weights), so the loop "
                "can divide the sums over every replica and batch"
            )

    def evaluate(self) -> dict[str, float]:
        for metric in self._metrics.values():
            metric.reset_state()
        if self._dataset is None:
            self._dataset = self._make_dataset()
        return self.results(self._eval_batches(iter(self._dataset), tf.constant(self._num_batches, tf.int32)))

    def results(self, totals: Mapping[str, float]) -> dict[str, float]:
        """The pass's results from its sums over every batch: means, metric results and `num_examples`."""
        self._check_keys(totals)
        totals = {k: float(v) for k, v in totals.items()}
        weight = totals.pop(WEIGHT_KEY)
        count = totals.pop("num_examples", weight)
        denominators = {
            k.removesuffix(contract.DENOMINATOR): totals.pop(k)
            for k in list(totals)
            if k.endswith(contract.DENOMINATOR)
        }
        means = {k: v / d if (d := denominators.get(k, count)) else v for k, v in totals.items()}
        return means | metric_results(self._metrics) | {"num_examples": count}
