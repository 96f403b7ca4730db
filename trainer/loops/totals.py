"""A call's worth of steps on every replica: outputs checked, summed on each replica, and reduced with SUM
across replicas once per call (docs/design.md, rule 3), or combined as the step declares
(trainer/task/combine.py). Shared by the train loop and the eval pass: a graph while loop whose count is a
tensor (a new count never retraces), the step in replica context through `strategy.run`, traced once.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.task import combine

SUM = tf.distribute.ReduceOp.SUM


def check_outputs(outputs, what: str = "train.step_fn") -> dict[str, tf.Tensor]:
    """`outputs` as tensors if it is a dict of scalar numbers (one replica's local values: tensors, Keras or TF
    variables such as `metric.count`, Python or NumPy numbers); else UserError naming the output."""
    if not isinstance(outputs, Mapping):
        raise UserError(
            f"{what} returned {type(outputs).__name__}; return a dict of scalar tensors, e.g. {{'loss': loss}}"
        )
    checked = {}
    for name, value in outputs.items():
        tensor = _as_tensor(value)
        number = tensor is not None and (tensor.dtype.is_floating or tensor.dtype.is_integer)
        if not (isinstance(name, str) and number and tensor.shape.rank == 0):
            shown = f"{tensor.shape} of {tensor.dtype.name}" if tensor is not None else f"a {type(value).__name__}"
            raise UserError(
                f"{what} output {name!r} is {shown}; each output must be a scalar number (a tensor, a variable "
                "or a Python number; reduce a per-example vector with a sum or mean first)"
            )
        checked[name] = tensor
    return checked


def _as_tensor(value) -> tf.Tensor | None:
    """`value` as a tensor (a Keras 3 variable, whose `dtype` is a string, converts too), None if it is none."""
    try:
        return tf.convert_to_tensor(value)
    except (TypeError, ValueError):
        return None


def reduce_outputs(
    strategy: tf.distribute.Strategy, outputs, what: str = "train.step_fn", rule: Mapping[str, str] | None = None
) -> dict[str, tf.Tensor]:
    """A step's `{name: scalar}` outputs across replicas: SUM, or as `rule` declares."""
    if isinstance(outputs, Mapping):
        check_outputs({k: strategy.experimental_local_results(v)[0] for k, v in outputs.items()}, what)
    else:
        check_outputs(outputs, what)
    rule = rule or {}
    combine.check_names(rule, outputs, what)
    return {
        k: _across_replicas(strategy, tf.cast(v, tf.float32), rule.get(k, combine.SHARE)) for k, v in outputs.items()
    }


def _across_replicas(strategy: tf.distribute.Strategy, value, kind: str) -> tf.Tensor:
    if kind == combine.SHARE:
        return strategy.reduce(SUM, value, axis=None)
    if kind == combine.MEAN:
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)
    extreme = tf.reduce_max if kind == combine.MAX else tf.reduce_min
    mode = modes.of(strategy)
    if mode.multi_worker and mode.synchronous:  # other processes' replicas: gather them (no MAX reduce op)
        shape = strategy.experimental_local_results(value)[0].shape
        rows = strategy.gather(strategy.run(lambda t: tf.reshape(t, [1, -1]), args=(value,)), axis=0)
        return tf.reshape(extreme(rows, axis=0), shape)
    return extreme(tf.stack(strategy.experimental_local_results(value)), axis=0)  # all local (ps: this worker's)


def repeated(step: Callable, start, num_steps: tf.Tensor):
    """The state after `num_steps` (>= 1) calls `state = step(i, state)`, i = 0, 1, ..., from `start`: a bounded
    while loop, as AutoGraph would write it, that traces `step` once (a first step peeled off the loop to give
    the loop variables their shapes would trace it, the model's forward pass and gradient, twice). `start`'s
    tensors (in tensors or PerReplica values) may be stand-ins of another size, which a step told by `i == 0`
    that it is the first ignores: the loop variables keep only their ranks, and after the loop the shapes the
    step gave them.
    """
    flat_start = tf.nest.flatten(start, expand_composites=True)
    shapes = []

    def body(i, *flat):
        state = step(i, tf.nest.pack_sequence_as(start, flat, expand_composites=True))
        flat = tf.nest.flatten(state, expand_composites=True)
        shapes[:] = [getattr(t, "shape", None) for t in flat]
        return (i + 1, *flat)

    _, *flat = tf.while_loop(
        lambda i, *_: i < num_steps,
        body,
        (tf.constant(0, num_steps.dtype), *flat_start),
        shape_invariants=(tf.TensorShape([]), *(_any_size(t) for t in flat_start)),
        maximum_iterations=num_steps,
    )
    for t, shape in zip(flat, shapes, strict=True):
        if shape is not None:
            t.set_shape(shape)  # what the step gives: at least one step ran
    return tf.nest.pack_sequence_as(start, flat, expand_composites=True)


def _any_size(value) -> tf.TensorShape | None:
    """A tensor's rank with each dimension unknown; None (its own spec) for a TensorArray."""
    return tf.TensorShape([None] * value.shape.rank) if isinstance(value, tf.Tensor) else None


def with_step(kinds: list[str], totals: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    """A vector of outputs (of `kinds`, trainer/task/combine.py) of one more step added to `totals`: summed,
    or the max/min kept."""
    if all(kind in (combine.SHARE, combine.MEAN) for kind in kinds):
        return totals + outputs
    smallest = tf.where([k == combine.MIN for k in kinds], tf.minimum(totals, outputs), totals + outputs)
    return tf.where([k == combine.MAX for k in kinds], tf.maximum(totals, outputs), smallest)


def stacked(outputs: Mapping[str, tf.Tensor], names: list[str]) -> tf.Tensor:
    """The float32 vector of `outputs` in the order of `names`."""
    if not names:
        return tf.zeros([0], tf.float32)
    return tf.stack([tf.cast(outputs[k], tf.float32) for k in names])


class ReplicaTotals:
    """Sums a step's outputs over the steps of one call on each replica, reduced once per call.

    Each replica keeps its totals as one float32 vector and counts the steps after which it was still finite:
    a non-finite sum stays so, so the count is the replica's first non-finite step (the call's: the least over
    replicas). One reduction per call instead of per step and output saves a cross-device (under MWMS a
    cross-process) reduction per output and step (docs/design.md, rule 3). `what` names the step in refusals.
    """

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        replica_fn: Callable,
        what: str,
        *,
        count_finite: bool = True,
        rule: Mapping[str, str] | None = None,
    ):
        self._strategy = strategy
        self._replica_fn = replica_fn
        self._what = what
        self._count_finite = count_finite
        self.rule = dict(rule or {})  # output name -> "mean" | "max" | "min" (trainer/task/combine.py)
        self.names: list[str] = []  # the step's output keys, in its order, known once traced

    def _vector(self, batch) -> tf.Tensor:
        outputs = check_outputs(self._replica_fn(batch), self._what)
        self.names = list(outputs)
        combine.check_names(self.rule, self.names, self._what)
        return stacked(outputs, self.names)

    def accumulate(
        self, num_steps: tf.Tensor, next_batch: Callable[[], Any], *, after_step: Callable[[], None] | None = None
    ):
        """The per-replica totals and finite-step counts after `num_steps` steps, each on `next_batch()`, in
        cross-replica context, where `after_step` runs after each step's update (e.g. EMA)."""

        def one_step(i, state):
            state = self._strategy.run(self._add, args=(i, *state, next_batch()))
            if after_step is not None:
                after_step()
            return state

        start = self._strategy.run(lambda: (tf.zeros([0], tf.float32), tf.constant(0)))  # no outputs, no steps
        return repeated(one_step, start, num_steps)

    def each_step(self, num_steps: tf.Tensor, next_batch: Callable[[], Any]) -> tf.Tensor:
        """`[num_steps, outputs]`: each step's outputs on `next_batch()`, summed over the replicas, in step order.
        Added up row by row in float32, one replica's rows give `sums(accumulate(...))` bit for bit: a pass cut
        into parts run apart (trainer/loops/ps_eval.py) keeps the sums of one pass."""

        def one_step(i, rows):
            outputs = self._strategy.run(self._vector, args=(next_batch(),))
            return rows.write(i, self._strategy.reduce(SUM, outputs, axis=None))

        rows = tf.TensorArray(tf.float32, size=tf.cast(num_steps, tf.int32))
        return repeated(one_step, rows, tf.cast(num_steps, tf.int32)).stack()

    def _add(self, i, totals, finite_steps, batch):
        outputs = self._vector(batch)
        kinds = combine.kinds(self.rule, self.names)
        totals = tf.cond(i > 0, lambda: with_step(kinds, totals, outputs), lambda: outputs)  # the first: its own
        return totals, finite_steps + self._finite(totals)

    def _finite(self, totals: tf.Tensor) -> tf.Tensor:
        if not self._count_finite:
            return tf.constant(0)
        return tf.cast(tf.reduce_all(tf.math.is_finite(totals)), tf.int32)

    def sums(self, state) -> dict[str, tf.Tensor]:
        """Each output's sum over the call's steps and the replicas (one reduce; one more for each of max and
        min), or its mean over replicas, max or min, as declared."""
        kinds = combine.kinds(self.rule, self.names)
        sums = self._strategy.reduce(SUM, state[0], axis=None)
        combined = {name: sums[i] for i, name in enumerate(self.names)}
        replicas = self._strategy.num_replicas_in_sync
        combined.update({name: sums[i] / replicas for i, name in enumerate(self.names) if kinds[i] == combine.MEAN})
        for extreme in (combine.MAX, combine.MIN):
            if where := [i for i, kind in enumerate(kinds) if kind == extreme]:
                values = _across_replicas(
                    self._strategy,
                    self._strategy.run(lambda totals, where=where: tf.gather(totals, where), args=(state[0],)),
                    extreme,
                )
                combined.update({self.names[i]: values[j] for j, i in enumerate(where)})
        return combined

    def per_interval(self, state, num_steps: tf.Tensor) -> dict[str, tf.Tensor]:
        return combine.per_interval(self.rule, self.sums(state), tf.cast(num_steps, tf.float32))

    def first_nonfinite(self, state, num_steps: tf.Tensor) -> tf.Tensor:
        """The 0-based index of the call's first step with a non-finite output on any replica (-1 if none)."""
        finite_steps = state[1]
        if self._strategy.num_replicas_in_sync == 1:
            first = self._strategy.reduce(SUM, finite_steps, axis=None)
        else:  # the least count over replicas, with SUM only: which counts occur, then the lowest of them
            seen = self._strategy.reduce(
                SUM, self._strategy.run(lambda count: tf.one_hot(count, num_steps + 1), args=(finite_steps,)), axis=None
            )
            first = tf.cast(tf.argmax(tf.cast(seen > 0, tf.int32)), tf.int32)
        return tf.where(first < num_steps, first, -1)
