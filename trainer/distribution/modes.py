"""What each strategy can do: the one place that decides capabilities.

A feature that does not work under every strategy says what it needs as a `Support` (for
example `SYNCHRONOUS`), and `require` checks that against the run's strategy, before anything
is built, with one wording for every refusal. Code that behaves differently per strategy asks
the run's `Mode` (`mode.synchronous`, `mode.aggregates_variables`, ...) instead of comparing
strategy names or types; `of` maps a strategy object back to its mode.

This module imports no TensorFlow at import time: entry points read it before TensorFlow
starts (an embedded parameter-server cluster is decided from the gin text alone).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from trainer.errors import UserError


@dataclasses.dataclass(frozen=True)
class Mode:
    """One strategy name and what training under it is like.

    Attributes:
      name: the `train.strategy` value.
      synchronous: every step is one update that all replicas agree on (all but parameter_server).
      multi_worker: it may span processes described by TF_CONFIG or SLURM.
      task_types: the cluster task types it can use.
      one_device: one replica, no cross-device sum (the optimizer update may compile with the step).
      aggregates_variables: with several replicas each variable is one AggregatingVariable, whose
        replica-context updates need an aggregation (layer state, see trainer/task/layer_state.py).
      coordinates_workers: the training program only coordinates; remote workers run the steps.
    """

    name: str
    synchronous: bool = True
    multi_worker: bool = False
    task_types: frozenset[str] = frozenset({"chief", "worker"})
    one_device: bool = False
    aggregates_variables: bool = False
    coordinates_workers: bool = False


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("default", one_device=True),
        Mode("one_device", one_device=True),
        Mode("mirrored"),
        Mode("central_storage", aggregates_variables=True),
        Mode("multi_worker_mirrored", multi_worker=True),
        Mode(
            "parameter_server",
            synchronous=False,
            multi_worker=True,
            aggregates_variables=True,
            coordinates_workers=True,
            task_types=frozenset({"chief", "worker", "ps", "evaluator"}),
        ),
        Mode("tpu"),
    )
}
STRATEGY_NAMES = tuple(MODES)


def get(name: str) -> Mode:
    """The mode of strategy `name`; an unknown name is one UserError line."""
    if not isinstance(name, str) or name not in MODES:
        raise UserError(f"unknown train.strategy {name!r}: use one of {', '.join(map(repr, STRATEGY_NAMES))}")
    return MODES[name]


def of(strategy: Any) -> Mode:
    """The mode a strategy object runs in (TensorFlow's default strategy: 'default')."""
    import tensorflow as tf

    kinds = (
        (
            (
                tf.distribute.experimental.ParameterServerStrategy,
                tf.compat.v1.distribute.experimental.ParameterServerStrategy,
            ),
            "parameter_server",
        ),
        (
            (
                tf.distribute.MultiWorkerMirroredStrategy,
                tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy,
            ),
            "multi_worker_mirrored",
        ),
        (
            (
                tf.distribute.experimental.CentralStorageStrategy,
                tf.compat.v1.distribute.experimental.CentralStorageStrategy,
            ),
            "central_storage",
        ),
        ((tf.distribute.OneDeviceStrategy,), "one_device"),
        ((tf.distribute.TPUStrategy,), "tpu"),
        ((tf.distribute.MirroredStrategy,), "mirrored"),
    )
    for types, name in kinds:
        if isinstance(strategy, types):
            return MODES[name]
    return MODES["default"]


@dataclasses.dataclass(frozen=True)
class Support:
    """The strategies a feature works under, and how to say so in a message."""

    names: frozenset[str]
    description: str

    def __contains__(self, strategy: str) -> bool:
        return strategy in self.names


def support(names: Iterable[str], description: str) -> Support:
    """A `Support` of the given strategy names (each checked)."""
    names = frozenset(names)
    unknown = sorted(names - set(MODES))
    if unknown:
        raise ValueError(f"unknown strategies {unknown} in a Support; known: {', '.join(STRATEGY_NAMES)}")
    return Support(names, description)


ALL = support(MODES, "every strategy")
SYNCHRONOUS = support((m.name for m in MODES.values() if m.synchronous), "the synchronous strategies")


def require(setting: str, needs: Support, strategy: str, *, reason: str = "", fix: str = "") -> None:
    """Refuses `setting` under `strategy` unless `needs` holds it, in the one wording of every refusal:

    `<setting> is not supported with <strategy> (<reason>); it works with <support>: <fix>`
    (the fix defaults to unsetting it).
    """
    if strategy in needs:
        return
    because = f" ({reason})" if reason else ""
    instead = fix or f"unset {setting} or use one of them"
    raise UserError(
        f"{setting} is not supported with {strategy}{because}; it works with {needs.description}: {instead}"
    )
