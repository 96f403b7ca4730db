"""What the loss-scaling probe found: outputs or gradients that differ between N replicas and one,
the known mistake that explains each best, and the one-line message with its fix."""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from trainer.errors import UserError

EXACT_RTOL = 1e-4  # relative difference of a deterministic step's outputs (float rounding)
LOW_PRECISION_RTOL = 1e-2  # in bfloat16/float16; the mistakes are off by the replica count, far beyond it
NOISE_FACTOR = 5.0  # a stochastic step may differ by this many times two reference runs' difference
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
    "not_a_share": (
        "the gradients match, so '{name}' is no share of a global-batch mean (an accuracy, a metric's running "
        'value): declare how it combines across replicas on the step, @trainer.combine({name}="mean") '
        '(or "max", "min")'
    ),
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


def compare(
    distributed: tuple[Mapping[str, float], Sequence[np.ndarray | None]],
    single: tuple[Mapping[str, float], Sequence[np.ndarray | None]],
    again: tuple[Mapping[str, float], Sequence[np.ndarray | None]],
    replicas: int,
    regularization: float,
    *,
    rtol: float = EXACT_RTOL,
) -> list[Finding]:
    """What does not match, outputs first, then the gradients; each argument is (outputs, gradients),
    `again` a second one-replica run whose difference from `single` measures the step's noise."""
    d_out, d_grads = distributed
    s_out, s_grads = single
    a_out, a_grads = again
    if set(d_out) != set(s_out):
        raise UserError(
            f"the step returns different outputs on {replicas} replicas ({sorted(d_out)}) and on one "
            f"({sorted(s_out)}); return the same keys whatever the replica count"
        )
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
    gradients = _compare_gradients(d_grads, s_grads, a_grads, replicas, rtol)
    if findings and not gradients and _any_gradients(d_grads, s_grads):  # the loss behind them is scaled right
        return [dataclasses.replace(f, mistake="not_a_share") for f in findings]
    return findings or gradients


def _any_gradients(d_grads, s_grads) -> bool:
    return any(d is not None and s is not None for d, s in zip(d_grads, s_grads))


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
    what = (
        f"the gradients summed over {replicas} replicas have {finding.ratio:.4g} times the norm of the "
        f"one-replica gradients"
        if finding.name == "gradients"
        else f"step output '{finding.name}' summed over {replicas} replicas is {finding.ratio:.4g} times its "
        f"one-replica value"
    )
    head = f"loss scaling: {what} ({finding.distributed:.6g} vs {finding.single:.6g})"
    if finding.mistake:
        return f"{head}: {FIXES[finding.mistake].format(n=replicas, name=finding.name)} {SKIP_HINT}"
    return (
        f"{head}; the step contract wants each replica's share of the global-batch mean (per-example "
        f"losses through tf.nn.compute_average_loss(per_example, global_batch_size=...), regularisation "
        f"through tf.nn.scale_regularization_loss; docs/design.md, rule 2) {SKIP_HINT}"
    )


def _norm(arrays) -> float:
    return math.sqrt(sum(float(np.sum(np.square(a))) for a in arrays))
