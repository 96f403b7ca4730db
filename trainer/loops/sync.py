"""The compiled parts of the synchronous loop: several train steps per call, and a full eval pass.

Each call runs `num_steps` steps on device in a graph while loop (the count a tensor, so a new
count never retraces), calls the step in replica context with `strategy.run`, sums its outputs on
each replica and reduces those sums with SUM in cross-replica context once per call
(DESIGN.md rule 3; see `ReplicaTotals`). Hooks run between calls.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import keras
import tensorflow as tf

from trainer.safety import tracing as checks
from trainer.update import xla
from trainer.task.user_code import call_user
from trainer.errors import UserError

StepFn = Callable[..., Mapping[str, tf.Tensor]]
SUM = tf.distribute.ReduceOp.SUM
WEIGHT_KEY = "__weight__"  # the real examples of a batch, counted by the loop itself


def check_outputs(outputs, what: str = "train.step_fn") -> Mapping[str, tf.Tensor]:
    """`outputs` if it is a dict of scalar numbers (one replica's, or any replica's local value); else UserError."""
    if not isinstance(outputs, Mapping):
        raise UserError(f"{what} returned {type(outputs).__name__}; return a dict of scalar tensors, "
                        "e.g. {'loss': loss}")
    for name, value in outputs.items():
        if not isinstance(name, str) or not hasattr(value, "shape") or value.shape.rank != 0 \
                or not (value.dtype.is_floating or value.dtype.is_integer):
            shown = getattr(value, "shape", type(value).__name__)
            raise UserError(f"{what} output {name!r} is {shown} of {getattr(value, 'dtype', '?')}; each output must "
                            "be a scalar number (reduce a per-example vector with a sum or mean first)")
    return outputs


def reduce_outputs(strategy: tf.distribute.Strategy, outputs, what: str = "train.step_fn") -> dict[str, tf.Tensor]:
    """SUM across replicas of a step's `{name: scalar}` outputs (refused in one line otherwise)."""
    if isinstance(outputs, Mapping):
        check_outputs({k: strategy.experimental_local_results(v)[0] for k, v in outputs.items()}, what)
    else:
        check_outputs(outputs, what)
    return {k: tf.cast(strategy.reduce(SUM, v, axis=None), tf.float32) for k, v in outputs.items()}


def repeated(step: Callable, num_steps: tf.Tensor):
    """The state after `num_steps` (>= 1) calls of `step` on it, `step(None)` the first.

    The first call is peeled so that the loop variables take the shapes of the step's own
    outputs; the others are a graph while loop (bounded by their count, as AutoGraph bounds a
    `tf.range` loop), written out because the loops trace without AutoGraph.
    """
    state = step(None)
    _, state = tf.while_loop(lambda i, _: i < num_steps, lambda i, state: (i + 1, step(state)),
                             (tf.constant(1), state), maximum_iterations=tf.maximum(num_steps - 1, 0))
    return state


class ReplicaTotals:
    """Sums a step's outputs over the steps of one call on each replica, reduced once per call.

    For the train loop and the eval pass alike (`replica_fn` is their step in replica context,
    `what` names it in the one-line refusal of outputs that are not a dict of scalars; eval and
    the bench's bare loop, which have no use for it, set `count_finite=False`).

    Each replica keeps its outputs' running totals as one float32 vector and counts the steps
    after which that vector was still finite. A sum that went non-finite stays so, so the count
    is the index of the replica's first non-finite step; the call's is the least over replicas.
    Reducing once per call instead of once per step and output saves a cross-device (under
    MultiWorkerMirroredStrategy a cross-process) reduction per output and step, and keeps the
    per-step work to a few ops on one vector (DESIGN.md rule 3: still SUM, in cross-replica context).
    """

    def __init__(self, strategy: tf.distribute.Strategy, replica_fn: Callable, what: str, *,
                 count_finite: bool = True):
        self._strategy = strategy
        self._replica_fn = replica_fn
        self._what = what
        self._count_finite = count_finite
        self.names: list[str] = []  # the step's output keys, in its order, known once traced

    def _vector(self, batch) -> tf.Tensor:
        outputs = check_outputs(self._replica_fn(batch), self._what)
        self.names = list(outputs)
        if not outputs:
            return tf.zeros([0], tf.float32)
        return tf.stack([tf.cast(outputs[k], tf.float32) for k in self.names])

    def accumulate(self, num_steps: tf.Tensor, next_batch: Callable[[], Any], *,
                   after_step: Callable[[], None] | None = None):
        """The per-replica totals and finite-step counts after `num_steps` steps, each on `next_batch()`.

        Call in cross-replica context; `after_step` runs there after each step's update (e.g. EMA).
        """
        def one_step(state):
            if state is None:
                state = self._strategy.run(self._first, args=(next_batch(),))
            else:
                state = self._strategy.run(self._add, args=(*state, next_batch()))
            if after_step is not None:
                after_step()
            return state

        return repeated(one_step, num_steps)

    def _first(self, batch):
        totals = self._vector(batch)
        return totals, self._finite(totals)

    def _add(self, totals, finite_steps, batch):
        totals = totals + self._vector(batch)
        return totals, finite_steps + self._finite(totals)

    def _finite(self, totals: tf.Tensor) -> tf.Tensor:
        if not self._count_finite:
            return tf.constant(0)
        return tf.cast(tf.reduce_all(tf.math.is_finite(totals)), tf.int32)

    def sums(self, state) -> dict[str, tf.Tensor]:
        """Each output's sum over the call's steps and the replicas (one reduce)."""
        sums = self._strategy.reduce(SUM, state[0], axis=None)
        return {name: sums[i] for i, name in enumerate(self.names)}

    def first_nonfinite(self, state, num_steps: tf.Tensor) -> tf.Tensor:
        """The 0-based index of the call's first step with a non-finite output on any replica (-1 if none)."""
        finite_steps = state[1]
        if self._strategy.num_replicas_in_sync == 1:
            first = self._strategy.reduce(SUM, finite_steps, axis=None)
        else:  # the least count over replicas, with SUM only: which counts occur, then the lowest of them
            seen = self._strategy.reduce(SUM, self._strategy.run(
                lambda count: tf.one_hot(count, num_steps + 1), args=(finite_steps,)), axis=None)
            first = tf.cast(tf.argmax(tf.cast(seen > 0, tf.int32)), tf.int32)
        return tf.where(first < num_steps, first, -1)


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

        totals = ReplicaTotals(strategy, replica_step, "train.step_fn")

        def train_steps(iterator, num_steps):
            state = totals.accumulate(num_steps, lambda: next(iterator), after_step=after_update)
            global_step.assign_add(tf.cast(num_steps, global_step.dtype))
            means = {k: v / tf.cast(num_steps, tf.float32) for k, v in totals.sums(state).items()}
            return means, totals.first_nonfinite(state, num_steps)

        # Plain TF ops throughout: no AutoGraph (see trainer/task/user_code.py; the step is converted).
        self._train_steps = tf.function(train_steps, autograph=False)
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
            outputs = (call_user(eval_step_fn, model, batch, self._metrics) if takes_metrics
                       else call_user(eval_step_fn, model, batch))
            if not isinstance(outputs, Mapping):
                raise UserError(f"train.eval_step_fn {self._step_name} returned {type(outputs).__name__}; return "
                                "a dict of per-replica sums with 'num_examples' (or {} when it only updates metrics)")
            weight = batch[-1]
            return dict(outputs) | {WEIGHT_KEY: tf.reduce_sum(tf.cast(weight, tf.float32))}

        totals = ReplicaTotals(strategy, replica_fn, "train.eval_step_fn", count_finite=False)

        def eval_batches(iterator, num_batches):
            return totals.sums(totals.accumulate(num_batches, lambda: next(iterator)))

        self._eval_batches = tf.function(eval_batches, autograph=False)

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
