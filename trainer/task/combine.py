"""How each step output is combined across replicas and over the steps of a log interval.

By default an output is this replica's share of a global-batch mean: SUMMED over replicas, averaged over
steps, and checked by the loss-scaling guard. A diagnostic that is no such share (a max logit, the norm of
the all-reduced gradient) is declared by name: `@trainer.combine(max_logit="max", grad_norm="mean")` (or
`my_step.combine = {...}`). "mean": the MEAN over replicas, the mean over steps; "max" / "min": the extreme
over replicas and every step of the interval.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Mapping, TypeVar

from trainer.errors import UserError

SHARE, MEAN, MAX, MIN = "share", "mean", "max", "min"
KINDS = (SHARE, MEAN, MAX, MIN)
ATTRIBUTE = "combine"

F = TypeVar("F", bound=Callable)


def _checked(rule: object, where: str) -> dict[str, str]:
    if not isinstance(rule, Mapping) or not all(isinstance(k, str) for k in rule):
        raise UserError(f"{where} must map output names to one of {', '.join(KINDS)}, got {rule!r}")
    for name, kind in rule.items():
        if kind not in KINDS:
            raise UserError(f"{where} gives output {name!r} the kind {kind!r}; use one of {', '.join(KINDS)}")
    return dict(rule)


def combine(**kinds: str) -> Callable[[F], F]:
    """Declares how the decorated step's outputs combine (see the module doc); returns the step."""
    rule = _checked(kinds, "trainer.combine")

    def declare(fn: F) -> F:
        setattr(fn, ATTRIBUTE, rule)
        return fn

    return declare


def rule_of(fn: Callable) -> dict[str, str]:
    """The step's declared kinds by output name, found on it or what it wraps (`{}`: every output a share)."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        rule = getattr(fn, "__dict__", {}).get(ATTRIBUTE)
        if rule is not None:
            return _checked(rule, f"{getattr(fn, '__name__', 'the step')}.{ATTRIBUTE}")
        fn = getattr(fn, "__wrapped__", None) or (fn.func if isinstance(fn, functools.partial) else None)
    return {}


def check_names(rule: Mapping[str, str], names: Iterable[str], what: str) -> None:
    """Refuses a declared kind for an output the step does not return (a typo would else go unseen)."""
    names = list(names)
    unknown = [name for name in rule if name not in names]
    if unknown:
        raise UserError(
            f"{what} declares how output {unknown[0]!r} combines, but returns no such output (it returns "
            f"{', '.join(names) or 'nothing'}); fix the name in its combine declaration"
        )


def kinds(rule: Mapping[str, str], names: Iterable[str]) -> list[str]:
    return [rule.get(name, SHARE) for name in names]


def shares(rule: Mapping[str, str], outputs: Mapping) -> dict:
    return {k: v for k, v in outputs.items() if rule.get(k, SHARE) == SHARE}


def over_steps(rule: Mapping[str, str], totals, outputs):
    """`outputs` of one more step added to `totals` (None at first): summed, or the max/min kept. Tensors or
    Python floats alike."""
    import tensorflow as tf  # here: `import trainer` (which offers `trainer.combine`) stays free of TensorFlow

    if totals is None:
        return dict(outputs)
    merged = {}
    for k, total in totals.items():
        kind = rule.get(k, SHARE)
        if kind == MAX:
            merged[k] = tf.maximum(total, outputs[k]) if tf.is_tensor(total) else max(total, outputs[k])
        elif kind == MIN:
            merged[k] = tf.minimum(total, outputs[k]) if tf.is_tensor(total) else min(total, outputs[k])
        else:
            merged[k] = total + outputs[k]
    return merged


def per_interval(rule: Mapping[str, str], totals: Mapping, num_steps) -> dict:
    """`over_steps` totals of `num_steps` steps as reported: averaged, max and min as they are."""
    return {k: v if rule.get(k, SHARE) in (MAX, MIN) else v / num_steps for k, v in totals.items()}
