"""The compiled parts of the synchronous loop: several train steps per call, and a full eval pass.

Each call runs `num_steps` steps on device in a `tf.range` loop (a tensor, so a new count
never retraces), calls the step in replica context with `strategy.run` and reduces its
outputs with SUM in cross-replica context (DESIGN.md rule 3). Hooks run between calls.
"""
from __future__ import annotations

import inspect
from typing import Callable, Mapping

import keras
import tensorflow as tf

from trainer.core import checks, xla
from trainer.errors import UserError

StepFn = Callable[..., Mapping[str, tf.Tensor]]
SUM = tf.distribute.ReduceOp.SUM
WEIGHT_KEY = "__weight__"  # the real examples of a batch, counted by the loop itself


def reduce_outputs(strategy: tf.distribute.Strategy, outputs, what: str = "train.step_fn") -> dict[str, tf.Tensor]:
    """SUM across replicas of a step's `{name: scalar}` outputs (refused in one line otherwise)."""
    if not isinstance(outputs, Mapping):
        raise UserError(f"{what} returned {type(outputs).__name__}; return a dict of scalar tensors, "
                        "e.g. {'loss': loss}")
    for name, value in outputs.items():
        local = strategy.experimental_local_results(value)[0]
        if not isinstance(name, str) or not hasattr(local, "shape") or local.shape.rank != 0 \
                or not (local.dtype.is_floating or local.dtype.is_integer):
            shown = getattr(local, "shape", type(local).__name__)
            raise UserError(f"{what} output {name!r} is {shown} of {getattr(local, 'dtype', '?')}; each output must "
                            "be a scalar number (reduce a per-example vector with a sum or mean first)")
    return {k: tf.cast(strategy.reduce(SUM, v, axis=None), tf.float32) for k, v in outputs.items()}


def _all_finite(outputs: dict[str, tf.Tensor]) -> tf.Tensor:
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in outputs.values()])


def _add(a: dict[str, tf.Tensor], b: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
    return {k: a[k] + b[k] for k in a}


class TrainLoop:
    """Runs `num_steps` training steps per call and returns the mean of each step output."""

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model,
        optimizer,
        step_fn: StepFn,
        global_batch_size: int,
        dataset,
        global_step: tf.Variable,
        *,
        jit_compile: bool = False,
        after_update: Callable[[], None] | None = None,
    ):
        self._strategy = strategy
        self._global_step = global_step
        self._iterator = iter(dataset)

        # XLA (if asked) on the replica function only: iterator ops and the reduce stay outside (rule 9).
        replica_step = xla.replica_step(strategy, step_fn, model, optimizer, global_batch_size,
                                        jit_compile=jit_compile)

        def one_step(iterator):
            outputs = reduce_outputs(strategy, strategy.run(replica_step, args=(next(iterator),)))
            if after_update is not None:  # cross-replica context, after this step's update (e.g. EMA)
                after_update()
            return outputs

        def train_steps(iterator, num_steps):
            # The first step is peeled so the loop variables take the step's own output keys.
            totals = one_step(iterator)
            first_nonfinite = tf.where(_all_finite(totals), -1, 0)
            for i in tf.range(1, num_steps):
                outputs = one_step(iterator)
                first_nonfinite = tf.where((first_nonfinite < 0) & ~_all_finite(outputs), i, first_nonfinite)
                totals = _add(totals, outputs)
            global_step.assign_add(tf.cast(num_steps, global_step.dtype))
            means = {k: v / tf.cast(num_steps, tf.float32) for k, v in totals.items()}
            return means, first_nonfinite

        self._train_steps = tf.function(train_steps)
        self.last_nonfinite_offset: int | None = None

    def run(self, num_steps: int) -> dict[str, float]:
        """Trains `num_steps` steps; returns each output's mean over them as Python floats.

        Afterwards `last_nonfinite_offset` is the 0-based index within this call of the
        first step with a non-finite output (None if every step was finite).
        """
        means, first_nonfinite = self._train_steps(self._iterator, tf.constant(num_steps, tf.int32))
        offset = int(first_nonfinite)
        self.last_nonfinite_offset = offset if offset >= 0 else None
        return {k: float(v) for k, v in means.items()}

    def trace(self, step_name: str) -> None:
        """Traces the compiled loop on the real batch spec now (the trace the first call reuses), so
        that a step or model that cannot take the batch is one UserError line before anything is written."""
        checks.traced("train.step_fn", step_name, lambda: self._train_steps.get_concrete_function(
            self._iterator, tf.TensorSpec([], tf.int32)))

    def set_dataset(self, dataset) -> None:
        """Continues from a new distributed dataset (after a roll-back); no retracing."""
        self._iterator = iter(dataset)

    @property
    def trace_count(self) -> int:
        """How often the step function was traced (1 after the first call, if nothing retraces)."""
        return self._train_steps.experimental_get_tracing_count()


def declares(fn: Callable, name: str) -> bool:
    """True if `fn` has a parameter called `name`."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


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
    """One pass over an eval split, every example once.

    The eval step returns per-replica SUMS (divided here by `num_examples`, its own or, if it
    returns none, the weight of the batch's real examples), and/or updates the Keras metric
    objects it gets as `metrics` (if it declares that parameter): they are reset before the
    pass, updated in replica context, and read once after it.
    """

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
        self._metrics = dict(metrics or {})
        takes_metrics = declares(eval_step_fn, "metrics")
        if self._metrics and not takes_metrics:
            raise UserError(f"train.eval_metrics_fn gives metrics {sorted(self._metrics)} but train.eval_step_fn "
                            f"{getattr(eval_step_fn, '__name__', eval_step_fn)} takes no `metrics` parameter; "
                            "declare eval_step_fn(model, batch, metrics) and update them there")
        self._step_name = getattr(eval_step_fn, "__name__", type(eval_step_fn).__name__)

        def replica_fn(batch):
            outputs = eval_step_fn(model, batch, self._metrics) if takes_metrics else eval_step_fn(model, batch)
            if not isinstance(outputs, Mapping):
                raise UserError(f"train.eval_step_fn {self._step_name} returned {type(outputs).__name__}; return "
                                "a dict of per-replica sums with 'num_examples' (or {} when it only updates metrics)")
            weight = batch[-1]
            return dict(outputs) | {WEIGHT_KEY: tf.reduce_sum(tf.cast(weight, tf.float32))}

        def one_batch(iterator):
            return reduce_outputs(strategy, strategy.run(replica_fn, args=(next(iterator),)), "train.eval_step_fn")

        def eval_batches(iterator, num_batches):
            totals = one_batch(iterator)
            for _ in tf.range(num_batches - 1):
                totals = _add(totals, one_batch(iterator))
            return totals

        self._eval_batches = tf.function(eval_batches)

    def trace(self) -> None:
        """Traces the eval pass on the real batch spec now (the trace `evaluate` reuses) and checks
        what the eval step returns, before anything is written."""
        concrete = checks.traced("train.eval_step_fn", self._step_name, lambda: self._eval_batches.get_concrete_function(
            iter(self._dataset), tf.TensorSpec([], tf.int32)))
        self._check_keys(concrete.structured_outputs)

    def _check_keys(self, outputs: Mapping) -> None:
        keys = set(outputs) - {WEIGHT_KEY}
        if keys and "num_examples" not in keys:
            raise UserError(f"train.eval_step_fn {self._step_name} returns {sorted(keys)} but no 'num_examples'; "
                            "return per-replica sums and 'num_examples' (the sum of the batch weights), so the loop "
                            "can divide the sums over every replica and batch")

    def evaluate(self) -> dict[str, float]:
        """Per-example means of the step's sums, each metric's result, and `num_examples`."""
        for metric in self._metrics.values():
            metric.reset_state()
        totals = self._eval_batches(iter(self._dataset), tf.constant(self._num_batches, tf.int32))
        self._check_keys(totals)
        totals = {k: float(v) for k, v in totals.items()}
        weight = totals.pop(WEIGHT_KEY)
        count = totals.pop("num_examples", weight)
        means = {k: v / count for k, v in totals.items()} if count else dict(totals)
        return means | metric_results(self._metrics) | {"num_examples": count}
