"""The loss-scaling guard: a step that trains differently on N replicas is stopped before step 1.

The step contract (docs/design.md, rule 2) makes SUM over replicas of a step's outputs equal its
outputs on one replica over the same global batch. The classic mistakes break that by a factor: a
per-replica mean (N times too large), a default-reduction Keras 3 loss scaled again by hand (N
times too small), `model.losses` without `scale_regularization_loss` (counted N times), a
hard-coded global batch size (reported as a per-replica mean). `check_loss_scaling` runs the step
both ways and compares; a mismatch is a UserError naming the likely mistake and its fix.

The probe, exact and free of side effects:
- Every replica gets the same per-replica batch S; a correct step on N replicas at global batch
  N*|S| then sums to its value on one replica over S at global batch |S| (same input shape, so
  the same batch statistics and dropout masks from the same seed state).
- A stand-in optimizer only records the gradients (summed over replicas: what would be applied).
- The one-replica reference runs eagerly outside `strategy.scope()` (`num_replicas_in_sync == 1`).
- It runs twice, so a step whose randomness the seed does not fix shows its own noise, which
  is tolerated; every variable's local copy is saved first and written back after each probe.

Only outputs declared shares (the default; trainer/task/combine.py) are compared: a "mean", "max"
or "min" diagnostic's sum over replicas means nothing. Gradients are always compared.

A step may depend on other replicas' examples (all_gather'ed negatives, rule 15). So when the
equal-slice probe does not match, the step runs with each replica on its own slice; if the
outputs of replicas whose slice did not change moved, it is compared with one replica over the
whole global batch instead. A known mistake in either is refused; matching neither comparison
nor a known mistake gives one `warning:` line, and the run trains.
"""

from __future__ import annotations

from typing import Callable, Mapping

import keras
import numpy as np
import tensorflow as tf

from trainer import data
from trainer.distribution import modes
from trainer.errors import UserError
from trainer.safety.scaling_findings import EXACT_RTOL, LOW_PRECISION_RTOL, SKIP_HINT, compare, message
from trainer.task import combine
from trainer.task.structure import all_variables, flat
from trainer.task.user_code import call_step
from trainer.update.recorder import GradientRecorder


def check_loss_scaling(
    strategy: tf.distribute.Strategy,
    model,
    optimizer,
    step_fn: Callable,
    source,
    *,
    global_batch_size: int,
    seed: int,
    print_fn: Callable[[str], None] = print,
) -> None:
    """Raises UserError if `step_fn` on N > 1 replicas disagrees with one replica (none for parameter_server,
    whose workers run whole batches). Call it outside `strategy.scope()`; it leaves every variable as it was."""
    replicas = strategy.num_replicas_in_sync
    if replicas <= 1 or not modes.of(strategy).synchronous:
        return
    if tf.distribute.has_strategy():
        raise RuntimeError("check_loss_scaling must be called outside strategy.scope()")
    per_replica = global_batch_size // replicas
    first = next(iter(data.train_dataset(source, global_batch_size, seed)))  # the first global batch
    slices = [
        tf.nest.map_structure(lambda t, i=i: t[i * per_replica : (i + 1) * per_replica], first) for i in range(replicas)
    ]
    saved = _Snapshot(strategy, [*all_variables(model), *all_variables(optimizer)])

    rule = combine.rule_of(step_fn)  # only the outputs that are shares are compared (trainer/task/combine.py)

    def probe(batch, batch_size):
        catchers = (
            {k: GradientRecorder(o, once=False) for k, o in optimizer.items()}
            if isinstance(optimizer, Mapping)
            else GradientRecorder(optimizer, once=False)
        )
        outputs = combine.shares(rule, call_step(step_fn, model, catchers, batch, batch_size))
        return {k: tf.cast(v, tf.float32) for k, v in outputs.items()}, [g for c in flat(catchers) for g in c.gradients]

    full_precision = all(getattr(m, "compute_dtype", "float32") in ("float32", "float64") for m in flat(model))
    rtol = EXACT_RTOL if full_precision else LOW_PRECISION_RTOL
    distributed_probe = lambda batch: probe(batch, global_batch_size)  # noqa: E731
    try:
        equal, equal_others = _run_distributed(strategy, distributed_probe, lambda _: slices[0])
        saved.restore()
        single = _numpy(probe(slices[0], per_replica))
        regularization = _regularization(model)
        again = _numpy(probe(slices[0], per_replica))  # fresh randomness, if any
        findings = compare(equal, single, again, replicas, regularization, rtol=rtol)
        if not findings:
            print_fn(f"loss-scaling check passed: step outputs summed over {replicas} replicas match one replica")
            return
        saved.restore()  # each replica its own slice: does a replica's output depend on the others' examples?
        varied, varied_others = _run_distributed(strategy, distributed_probe, lambda i: slices[i])
        if _close(equal_others, varied_others, rtol):
            raise UserError(message(findings[0], replicas))
        saved.restore()  # it does (a gather across replicas): compare with one replica over the whole batch
        whole = [_numpy(probe(first, global_batch_size)) for _ in range(2)]
    finally:
        saved.restore()
    whole_findings = compare(varied, whole[0], whole[1], replicas, regularization, rtol=rtol)
    if not whole_findings:
        print_fn(
            f"loss-scaling check passed: the step depends on other replicas' examples; its outputs summed over "
            f"{replicas} replicas match one replica over the whole global batch"
        )
        return
    known = next((f for f in (*findings, *whole_findings) if f.mistake), None)
    if known is not None:
        raise UserError(message(known, replicas))
    print_fn(
        f"warning: loss scaling not checked: the step depends on other replicas' examples, and its outputs on "
        f"{replicas} replicas match neither one replica on the same slice nor one replica over the whole batch "
        f"('{whole_findings[0].name}' {whole_findings[0].ratio:.4g} times; batch statistics or randomness "
        f"differ between the two), with no known scaling mistake to explain it {SKIP_HINT}"
    )


def _run_distributed(strategy, probe, slice_of: Callable[[int], object]):
    """The step on every replica, replica i on `slice_of(i)`: outputs and gradients SUM-reduced, and the
    sum of every replica's outputs but the last's (do they move when only the last one's slice does?)."""
    SUM = tf.distribute.ReduceOp.SUM
    last = strategy.num_replicas_in_sync - 1

    def replica(batch):
        outputs, gradients = probe(batch)
        keep = tf.cast(tf.not_equal(tf.distribute.get_replica_context().replica_id_in_sync_group, last), tf.float32)
        return outputs, gradients, {k: v * keep for k, v in outputs.items()}

    @tf.function(autograph=False)  # the step itself is converted by `call_step`
    def run(values):
        outputs, gradients, others = strategy.run(replica, args=(values,))
        outputs = {k: strategy.reduce(SUM, v, axis=None) for k, v in outputs.items()}
        gradients = [None if g is None else strategy.reduce(SUM, g, axis=None) for g in gradients]
        return outputs, gradients, {k: strategy.reduce(SUM, v, axis=None) for k, v in others.items()}

    values = strategy.experimental_distribute_values_from_function(lambda ctx: slice_of(ctx.replica_id_in_sync_group))
    outputs, gradients, others = run(values)
    return _numpy((outputs, gradients)), {k: float(v) for k, v in others.items()}


def _close(a: Mapping[str, float], b: Mapping[str, float], rtol: float) -> bool:
    return all(abs(a[k] - b[k]) <= rtol * max(abs(a[k]), abs(b[k]), 1e-12) for k in a)


def _numpy(result):
    outputs, gradients = result
    return (
        {k: float(tf.cast(v, tf.float64)) for k, v in outputs.items()},
        [None if g is None else np.asarray(tf.convert_to_tensor(g), np.float64) for g in gradients],
    )


def _regularization(models) -> float:
    """sum(model.losses) of every model in the one-replica world (0 for models without `losses`)."""
    losses = [loss for m in flat(models) for loss in getattr(m, "losses", [])]
    return float(tf.add_n([tf.cast(loss, tf.float64) for loss in losses])) if losses else 0.0


class _Snapshot:
    """The value of every local copy of some variables, to write back exactly."""

    def __init__(self, strategy, variables):
        seen, self._saved = set(), []
        for variable in variables:
            if isinstance(variable, getattr(keras, "Variable", ())):
                variable = variable.value  # the tf.Variable (or distributed variable) it wraps
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            for local in strategy.experimental_local_results(variable):
                self._saved.append((local, tf.identity(local.read_value())))

    def restore(self) -> None:
        for local, value in self._saved:
            local.assign(value)
