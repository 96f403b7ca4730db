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
  is tolerated.
- No trace: every variable the traced step reads or writes (a traced function knows them all: Keras
  metrics, a `tf.random.Generator`'s state, `tf.Module` variables, beside the model's and optimizer's) has
  each local copy saved first and written back after each probe.
- Randomness keyed by the replica id differs between replicas on the same slice; N times replica 0's
  outputs (the replica a one-replica run is) are then compared instead of the sum.
- A step the probe cannot run (per-replica ON_READ variables take no update outside a replica context,
  where the one-replica reference runs) is skipped with one `warning:` line saying why: the loop traced
  it, so it trains.

Only outputs declared shares (the default; trainer/task/combine.py) are compared: a "mean", "max"
or "min" diagnostic's sum over replicas means nothing. Gradients are always compared; an undeclared
output that is off while the gradients match is no share, and is told to declare itself.

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
from trainer.errors import UserError, error_line
from trainer.loops.totals import check_outputs
from trainer.safety.scaling_findings import EXACT_RTOL, LOW_PRECISION_RTOL, SKIP_HINT, compare, message
from trainer.task import combine
from trainer.task.structure import all_variables, flat
from trainer.task.user_code import call_step
from trainer.update.recorder import GradientRecorder

ON_READ = tf.VariableSynchronization.ON_READ


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
    rule = combine.rule_of(step_fn)  # only the outputs that are shares are compared (trainer/task/combine.py)

    def probe(batch, batch_size):
        catchers = (
            {k: GradientRecorder(o, once=False) for k, o in optimizer.items()}
            if isinstance(optimizer, Mapping)
            else GradientRecorder(optimizer, once=False)
        )
        outputs = check_outputs(combine.shares(rule, call_step(step_fn, model, catchers, batch, batch_size)))
        return {k: tf.cast(v, tf.float32) for k, v in outputs.items()}, [g for c in flat(catchers) for g in c.gradients]

    full_precision = all(getattr(m, "compute_dtype", "float32") in ("float32", "float64") for m in flat(model))
    rtol = EXACT_RTOL if full_precision else LOW_PRECISION_RTOL
    distributed = _DistributedProbe(strategy, lambda batch: probe(batch, global_batch_size))
    touched = distributed.variables(lambda _: slices[0])  # traced, not run: every variable the step reads or writes
    saved = _Snapshot(strategy, [*all_variables(model), *all_variables(optimizer), *touched])
    try:
        equal, equal_others, first_replica = distributed.run(lambda _: slices[0])
        saved.restore()
        single = _numpy(probe(slices[0], per_replica))
        regularization = _regularization(model)
        again = _numpy(probe(slices[0], per_replica))  # fresh randomness, if any
        findings = compare(equal, single, again, replicas, regularization, rtol=rtol)
        if not findings:
            print_fn(f"loss-scaling check passed: step outputs summed over {replicas} replicas match one replica")
            return
        if not any(f.mistake for f in findings) and not compare(
            first_replica, single, again, replicas, regularization, rtol=rtol
        ):
            print_fn(
                f"loss-scaling check passed: the step's outputs differ between replicas on the same examples "
                f"(randomness keyed by the replica id); {replicas} times replica 0's match one replica"
            )
            return
        saved.restore()  # each replica its own slice: does a replica's output depend on the others' examples?
        varied, varied_others, _ = distributed.run(lambda i: slices[i])
        if _close(equal_others, varied_others, rtol):
            raise UserError(message(findings[0], replicas))
        saved.restore()  # it does (a gather across replicas): compare with one replica over the whole batch
        whole = [_numpy(probe(first, global_batch_size)) for _ in range(2)]
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001  (the loop traced this step: what the probe cannot run is no refusal)
        print_fn(f"warning: loss scaling not checked: {_why_not(error, touched, replicas)} {SKIP_HINT}")
        return
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


class _DistributedProbe:
    """The step on every replica, replica i on `slice_of(i)`: its outputs and gradients SUM-reduced; the sum
    of every replica's outputs but the last's (do they move when only the last one's slice does?); and
    N times replica 0's outputs and gradients (replica 0 is what a one-replica run is: the same replica
    id, so the same noise where the step keys its randomness by it)."""

    def __init__(self, strategy, probe):
        self._strategy = strategy
        replicas = strategy.num_replicas_in_sync

        def replica(batch):
            outputs, gradients = probe(batch)
            replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
            keep = tf.cast(tf.not_equal(replica_id, replicas - 1), tf.float32)
            times = tf.cast(tf.equal(replica_id, 0), tf.float32) * replicas
            first = (
                {k: v * times for k, v in outputs.items()},
                [None if g is None else g * tf.cast(times, g.dtype) for g in gradients],
            )
            return (outputs, gradients), {k: v * keep for k, v in outputs.items()}, first

        def reduced(values):
            return tf.nest.map_structure(lambda v: strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None), values)

        @tf.function(autograph=False)  # the step itself is converted by `call_step`
        def run(values):
            return reduced(strategy.run(replica, args=(values,)))

        self._run = run

    def _values(self, slice_of: Callable[[int], object]):
        return self._strategy.experimental_distribute_values_from_function(
            lambda ctx: slice_of(ctx.replica_id_in_sync_group)
        )

    def variables(self, slice_of: Callable[[int], object]) -> list:
        """Every variable the traced step reads or writes (each device's copy), traced without running it."""
        return list(self._run.get_concrete_function(self._values(slice_of)).graph.variables)

    def run(self, slice_of: Callable[[int], object]):
        summed, others, first = self._run(self._values(slice_of))
        return _numpy(summed), {k: float(v) for k, v in others.items()}, _numpy(first)


def _why_not(error: Exception, touched, replicas: int) -> str:
    """Why the probe could not run the step: a per-replica variable (synchronization=ON_READ, a buffer the step
    accumulates into) takes no update outside a replica context, where the one-replica reference runs."""
    per_replica = [v.name for v in touched if getattr(v, "synchronization", None) == ON_READ]
    if per_replica and "SyncOnReadVariable" in str(error):
        return (
            f"the step updates a per-replica variable (synchronization=ON_READ, e.g. '{per_replica[0]}'), which "
            "the one-replica reference, run outside any replica context, cannot update"
        )
    return (
        f"the step could not run as the check runs it, on {replicas} replicas and as one replica outside "
        f"the strategy ({error_line(error)})"
    )


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
    """The value of every local copy of some variables, to write back exactly (a random generator's state is
    a variable too)."""

    def __init__(self, strategy, variables):
        seen, self._saved = set(), []
        for variable in variables:
            if isinstance(variable, getattr(keras, "Variable", ())):
                variable = variable.value  # the tf.Variable (or distributed variable) it wraps
            for local in strategy.experimental_local_results(variable):
                if id(local) not in seen:
                    seen.add(id(local))
                    self._saved.append((local, tf.identity(local.read_value())))

    def restore(self) -> None:
        for local, value in self._saved:
            local.assign(value)
