"""The loss-scaling guard: a step that trains differently on N replicas is stopped before step 1.

The step contract (docs/design.md, rule 2) makes SUM over replicas of a step's outputs equal the
step's outputs on one replica over the same global batch. The classic mistakes break that
by a factor: a per-replica mean (N times too large), a default-reduction Keras 3 loss scaled
again by hand (N times too small), `model.losses` added without `scale_regularization_loss`
(the regularisation counted N times). `check_loss_scaling` runs the step once both ways and
compares; a mismatch raises UserError (exit 2) with the likely mistake and its fix.

The probe is a rescaled copy of that comparison, exact, cheap and free of side effects:
- Every replica gets the same per-replica batch S (the first GB/N examples of the first
  global batch). On N replicas at global batch N*|S| a correct step then sums to the same
  numbers as on one replica over S at global batch |S|: the same per-example mean, the
  same regularisation. The one-replica run sees the same input shape, so batch statistics
  (BatchNormalization) and dropout masks drawn from the same seed state are the same too.
- The step gets a stand-in optimizer whose `apply_gradients`/`apply` only record the
  gradients (everything else is read from the real optimizer), so no update happens; the
  recorded gradients, summed over replicas, are what the real optimizer would apply.
- The one-replica reference runs eagerly outside `strategy.scope()`: TensorFlow and Keras
  see one replica there (`num_replicas_in_sync == 1`), reading each variable's local copy.
- It runs twice without rollback in between, so that a step whose randomness the seed
  state does not fix (a stateful RNG) shows its own noise; differences within a few times
  that noise are not called mistakes (unless a known mistake explains them better).
- Every local copy of every model and optimizer variable (seed-generator states, moving
  statistics, `optimizer.iterations`) is saved first and written back after each probe.

Only the outputs the step declares shares (the default; trainer/task/combine.py) are compared:
a diagnostic declared "mean", "max" or "min" is no share of a global-batch mean, and its sum over
replicas means nothing. The gradients are compared whatever the step declares.

A step that hard-codes the global batch size instead of using its `global_batch_size`
argument is reported too (as a per-replica mean): it breaks when the batch size changes.

A step may depend on other replicas' examples (contrastive negatives gathered across replicas
with `get_replica_context().all_gather`, docs/design.md rule 15): with the same slice on every
replica it sums to something else than one replica's value, legitimately. So when the equal-slice
probe does not match, the step runs once more with each replica on its own slice of the first
global batch; if the outputs of the replicas whose slice did not change moved, the step depends
on the others, and it is compared with one replica over the whole global batch instead. A known
mistake in either comparison is refused as before; a step that matches neither comparison and no
known mistake gets one `warning:` line saying that it could not be checked, and trains.
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
    """Raises UserError if `step_fn` on N > 1 replicas disagrees with itself on one replica.

    Call it after the model and optimizer are built and before the first train step,
    outside `strategy.scope()`. Leaves every model and optimizer variable as it found it.
    `model` and `optimizer` may be dicts of them (the step gets them as given); `source` is
    the run's input (a `data.Input` or an input function).
    Does nothing for one replica or for ParameterServerStrategy (whose workers each run
    whole batches).
    """
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
        findings = compare(
            equal,
            single,
            _numpy(probe(slices[0], per_replica)),  # again: fresh randomness, if any
            replicas,
            regularization,
            rtol=rtol,
        )
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
    """The step on every replica, replica i on `slice_of(i)`; outputs and gradients reduced with SUM,
    and the sum of the outputs of every replica but the last (which tells, between two runs that
    differ only in the last replica's slice, whether a replica's outputs depend on other replicas')."""
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
