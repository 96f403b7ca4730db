"""The loss-scaling guard: a step that trains differently on N replicas is stopped before step 1.

The step contract (DESIGN.md rule 2) makes SUM over replicas of a step's outputs equal the
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

A step that hard-codes the global batch size instead of using its `global_batch_size`
argument is reported too (as a per-replica mean): it breaks when the batch size changes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf

from trainer import data
from trainer.task.task import all_variables, flat
from trainer.task.user_code import call_user
from trainer.errors import UserError

EXACT_RTOL = 1e-4
"""Relative difference within which outputs agree for a deterministic step (float rounding)."""
LOW_PRECISION_RTOL = 1e-2
"""The same for a model computing in bfloat16 or float16 (mixed precision): 8 to 11 bits of
mantissa; the mistakes looked for are off by a factor of the replica count, far beyond it."""
NOISE_FACTOR = 5.0
"""A stochastic step may differ by this many times the difference between two reference runs."""
SKIP_HINT = "(checked before step 1; train.check_loss_scaling = False skips the check)"

FIXES = {
    "per_replica_mean": (
        "per-replica mean instead of the global-batch share (gradients {n} times too large): "
        "use tf.nn.compute_average_loss(per_example, global_batch_size=...)"
    ),
    "keras_default_scaled": (
        "a Keras 3 loss at its default reduction already divides by the replica count under a "
        "strategy; scaled again by hand it is {n} times too small: use reduction=None and "
        "compute_average_loss"
    ),
    "unscaled_regularization": "model.losses added without tf.nn.scale_regularization_loss",
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One compared quantity that does not match, and what most likely explains it."""

    name: str  # the output key, or 'gradients'
    distributed: float  # SUM over replicas (for gradients: the global norm of the summed gradients)
    single: float  # the one-replica value (for gradients: its global norm)
    mistake: str | None  # a key of FIXES, or None when no known mistake fits

    @property
    def ratio(self) -> float:
        return self.distributed / self.single if self.single else math.inf


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
    if replicas <= 1 or _is_parameter_server(strategy):
        return
    if tf.distribute.has_strategy():
        raise RuntimeError("check_loss_scaling must be called outside strategy.scope()")
    per_replica = global_batch_size // replicas
    shard = _probe_batch(source, global_batch_size, seed, per_replica)
    saved = _Snapshot(strategy, [*all_variables(model), *all_variables(optimizer)])

    def probe(batch, batch_size):
        catchers = ({k: _GradientCatcher(o) for k, o in optimizer.items()} if isinstance(optimizer, Mapping)
                    else _GradientCatcher(optimizer))
        outputs = call_user(step_fn, model, catchers, batch, batch_size)
        return {k: tf.cast(v, tf.float32) for k, v in outputs.items()}, [g for c in flat(catchers) for g in c.gradients]

    try:
        distributed = _run_distributed(strategy, lambda batch: probe(batch, global_batch_size), shard)
        saved.restore()
        single = probe(shard, per_replica)
        regularization = _regularization(model)
        again = probe(shard, per_replica)  # no rollback in between: fresh randomness, if any
    finally:
        saved.restore()

    full_precision = all(getattr(m, "compute_dtype", "float32") in ("float32", "float64") for m in flat(model))
    rtol = EXACT_RTOL if full_precision else LOW_PRECISION_RTOL
    findings = compare(distributed, _numpy(single), _numpy(again), replicas, regularization, rtol=rtol)
    if findings:
        raise UserError(message(findings[0], replicas))
    print_fn(f"loss-scaling check passed: step outputs summed over {replicas} replicas match one replica")


def compare(
    distributed: tuple[Mapping[str, float], Sequence[np.ndarray | None]],
    single: tuple[Mapping[str, float], Sequence[np.ndarray | None]],
    again: tuple[Mapping[str, float], Sequence[np.ndarray | None]],
    replicas: int,
    regularization: float,
    *,
    rtol: float = EXACT_RTOL,
) -> list[Finding]:
    """What does not match, outputs first (in the step's order), then the gradients.

    Each argument is (outputs, gradients) as numbers; `again` is a second one-replica run
    whose difference from `single` measures the step's own noise.
    """
    d_out, d_grads = distributed
    s_out, s_grads = single
    a_out, a_grads = again
    if set(d_out) != set(s_out):
        raise UserError(f"the step returns different outputs on {replicas} replicas ({sorted(d_out)}) and on one "
                        f"({sorted(s_out)}); return the same keys whatever the replica count")
    findings = []
    for name in d_out:
        d, s, a = float(d_out[name]), float(s_out[name]), float(a_out[name])
        exact = rtol * max(abs(d), abs(s))
        if abs(d - s) <= exact:
            continue
        mistake, error = _explain(d, s, replicas, regularization)
        if error < abs(d - s) and error <= max(exact, 1e-3 * abs(d)):
            findings.append(Finding(name, d, s, mistake))
        elif abs(d - s) > NOISE_FACTOR * abs(s - a):
            findings.append(Finding(name, d, s, None))
    if findings:
        return findings
    return _compare_gradients(d_grads, s_grads, a_grads, replicas, rtol)


def _explain(d: float, s: float, n: int, reg: float) -> tuple[str, float]:
    """The known mistake that best predicts `d` from `s`, and how far off its prediction is."""
    data_part = s - reg
    candidates = [
        ("per_replica_mean", n * s),
        ("per_replica_mean", n * data_part + reg),
        ("keras_default_scaled", s / n),
        ("keras_default_scaled", data_part / n + reg),
    ]
    if reg:
        candidates.append(("unscaled_regularization", s + (n - 1) * reg))
    name, predicted = min(candidates, key=lambda c: abs(d - c[1]))
    return name, abs(d - predicted)


def _compare_gradients(d_grads, s_grads, a_grads, n: int, rtol: float = EXACT_RTOL) -> list[Finding]:
    pairs = [(d, s, a) for d, s, a in zip(d_grads, s_grads, a_grads) if d is not None and s is not None]
    if not pairs:
        return []
    d_norm = _norm(d for d, _, _ in pairs)
    s_norm = _norm(s for _, s, _ in pairs)
    difference = _norm(d - s for d, s, _ in pairs)
    noise = _norm(s - a for _, s, a in pairs)
    if difference <= rtol * max(d_norm, s_norm):
        return []
    ratio = d_norm / s_norm if s_norm else math.inf
    mistake = None
    if abs(ratio - n) <= 1e-3 * n:
        mistake = "per_replica_mean"
    elif abs(ratio - 1 / n) <= 1e-3 / n:
        mistake = "keras_default_scaled"
    elif difference <= NOISE_FACTOR * noise:
        return []
    return [Finding("gradients", d_norm, s_norm, mistake)]


def message(finding: Finding, replicas: int) -> str:
    """One line: what differs by how much, the likely mistake, its fix."""
    what = (f"the gradients summed over {replicas} replicas have {finding.ratio:.4g} times the norm of the "
            f"one-replica gradients" if finding.name == "gradients" else
            f"step output '{finding.name}' summed over {replicas} replicas is {finding.ratio:.4g} times its "
            f"one-replica value")
    head = f"loss scaling: {what} ({finding.distributed:.6g} vs {finding.single:.6g})"
    if finding.mistake:
        return f"{head}: {FIXES[finding.mistake].format(n=replicas)} {SKIP_HINT}"
    return (f"{head}; the step contract wants each replica's share of the global-batch mean (per-example "
            f"losses through tf.nn.compute_average_loss(per_example, global_batch_size=...), regularisation "
            f"through tf.nn.scale_regularization_loss; DESIGN.md rule 2) {SKIP_HINT}")


class _GradientCatcher:
    """Stands in for the optimizer inside the probe: records gradients, applies nothing."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.gradients: list = []

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        self.gradients = [_dense(g) for g, _ in grads_and_vars]
        return self._optimizer.iterations

    def apply(self, grads, trainable_variables=None, *args, **kwargs):
        self.gradients = [_dense(g) for g in grads]
        return self._optimizer.iterations

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def _run_distributed(strategy, probe, shard):
    """The step on every replica, each on `shard`; outputs and gradients reduced with SUM."""
    SUM = tf.distribute.ReduceOp.SUM

    @tf.function(autograph=False)  # the step itself is converted by `call_user`
    def run(values):
        outputs, gradients = strategy.run(probe, args=(values,))
        outputs = {k: strategy.reduce(SUM, v, axis=None) for k, v in outputs.items()}
        gradients = [None if g is None else strategy.reduce(SUM, g, axis=None) for g in gradients]
        return outputs, gradients

    values = strategy.experimental_distribute_values_from_function(lambda _: shard)
    return _numpy(run(values))


def _dense(gradient):
    return tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient


def _numpy(result):
    outputs, gradients = result
    return ({k: float(tf.cast(v, tf.float64)) for k, v in outputs.items()},
            [None if g is None else np.asarray(tf.convert_to_tensor(g), np.float64) for g in gradients])


def _norm(arrays) -> float:
    return math.sqrt(sum(float(np.sum(np.square(a))) for a in arrays))


def _regularization(models) -> float:
    """sum(model.losses) of every model in the one-replica world (0 for models without `losses`)."""
    losses = [loss for m in flat(models) for loss in getattr(m, "losses", [])]
    return float(tf.add_n([tf.cast(l, tf.float64) for l in losses])) if losses else 0.0


def _probe_batch(source, global_batch_size: int, seed: int, per_replica: int):
    """The first per-replica batch of the first global batch of the training data."""
    batch = next(iter(data.train_dataset(source, global_batch_size, seed)))
    return tf.nest.map_structure(lambda t: t[:per_replica], batch)


def _is_parameter_server(strategy) -> bool:
    return isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)


class _Snapshot:
    """The value of every local copy of some variables, to write back exactly."""

    def __init__(self, strategy, variables):
        seen, self._saved = set(), []
        for variable in variables:
            if isinstance(variable, keras.Variable):
                variable = variable.value  # the tf.Variable (or distributed variable) it wraps
            if id(variable) in seen:
                continue
            seen.add(id(variable))
            for local in strategy.experimental_local_results(variable):
                self._saved.append((local, tf.identity(local.read_value())))

    def restore(self) -> None:
        for local, value in self._saved:
            local.assign(value)
