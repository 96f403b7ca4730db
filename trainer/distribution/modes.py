"""What each strategy can do: the one place that decides capabilities.

A feature that does not work under every strategy states a `Support` (e.g. `SYNCHRONOUS`) that `require`
checks before anything is built, in one wording; code that differs per strategy asks the run's `Mode`
instead of comparing strategy names or types. `RUN_MODES` declares the same for each `trainer.main --mode`.
No TensorFlow at import: entry points read this before it starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from trainer.errors import UserError


@dataclasses.dataclass(frozen=True)
class Mode:
    """One `train.strategy` name and what training under it is like."""

    name: str
    synchronous: bool = True  # every step is one update all replicas agree on
    multi_worker: bool = False  # it may span processes (TF_CONFIG or SLURM)
    task_types: frozenset[str] = frozenset({"chief", "worker"})
    one_device: bool = False  # one replica, no cross-device sum (the update may compile with the step)
    # With several replicas each variable is one AggregatingVariable, whose replica-context updates need an
    # aggregation (trainer/task/layer_state.py).
    aggregates_variables: bool = False
    coordinates_workers: bool = False  # the program only coordinates; remote workers run the steps


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
    if not isinstance(name, str) or name not in MODES:
        raise UserError(f"unknown train.strategy {name!r}: use one of {', '.join(map(repr, STRATEGY_NAMES))}")
    return MODES[name]


def of(strategy: Any) -> Mode:
    """The mode a strategy object runs in (TensorFlow's default strategy: 'default')."""
    import tensorflow as tf

    v1 = tf.compat.v1.distribute.experimental
    kinds = (  # subclasses before their base classes (MirroredStrategy last)
        ("parameter_server", tf.distribute.experimental.ParameterServerStrategy, v1.ParameterServerStrategy),
        ("multi_worker_mirrored", tf.distribute.MultiWorkerMirroredStrategy, v1.MultiWorkerMirroredStrategy),
        ("central_storage", tf.distribute.experimental.CentralStorageStrategy, v1.CentralStorageStrategy),
        ("one_device", tf.distribute.OneDeviceStrategy),
        ("tpu", tf.distribute.TPUStrategy),
        ("mirrored", tf.distribute.MirroredStrategy),
    )
    return next((MODES[name] for name, *types in kinds if isinstance(strategy, tuple(types))), MODES["default"])


@dataclasses.dataclass(frozen=True)
class Support:
    """The strategies a feature works under, and how to say so in a message."""

    names: frozenset[str]
    description: str

    def __contains__(self, strategy: str) -> bool:
        return strategy in self.names


def support(names: Iterable[str], description: str) -> Support:
    names = frozenset(names)
    if unknown := sorted(names - set(MODES)):
        raise ValueError(f"unknown strategies {unknown} in a Support; known: {', '.join(STRATEGY_NAMES)}")
    return Support(names, description)


ALL = support(MODES, "every strategy")
SYNCHRONOUS = support((m.name for m in MODES.values() if m.synchronous), "the synchronous strategies")


def require(setting: str, needs: Support, strategy: str, *, reason: str = "", fix: str = "") -> None:
    """Refuses `setting` under `strategy` unless `needs` holds it, in the one wording of every refusal
    (the fix defaults to unsetting it)."""
    if strategy in needs:
        return
    because = f" ({reason})" if reason else ""
    instead = fix or f"unset {setting} or use one of them"
    raise UserError(
        f"{setting} is not supported with {strategy}{because}; it works with {needs.description}: {instead}"
    )


@dataclasses.dataclass(frozen=True)
class RunMode:
    """One `trainer.main --mode`: what it does (its --help line), the strategies it works under, and
    whether it runs where training does (under a parameter_server run's embedded cluster, so its
    process isolates itself early as training's does) or on this process alone."""

    name: str
    help: str
    supports: Support = ALL
    on_the_run_cluster: bool = True
    needs_model_dir: bool = False  # it reads a run's model_dir; one must be named


RUN_MODES: dict[str, RunMode] = {
    m.name: m
    for m in (
        RunMode("train", "train and evaluate inline"),
        RunMode(
            "eval_continuous",
            "a sidecar evaluator that evaluates every new checkpoint in --model_dir as it appears, until "
            "the one at train.total_steps, on this process's first device",
            on_the_run_cluster=False,
            needs_model_dir=True,
        ),
        RunMode(
            "evaluate",
            "evaluate one checkpoint of --model_dir (--checkpoint, default the newest) on every eval split "
            "(--eval_splits) with the run's own strategy, and append the results marked as a re-evaluation",
            needs_model_dir=True,
        ),
        RunMode(
            "predict",
            "write the model's outputs over a split (predict.split, or predict.input_fn) at --checkpoint into "
            "one .npz (--output); a parameter_server run is restored onto this process's device, as the "
            "sidecar does",
            supports=support((name for name in MODES if name != "tpu"), "every strategy but tpu (untried there)"),
            on_the_run_cluster=False,
            needs_model_dir=True,
        ),
    )
}


def require_run_mode(name: str, strategy: str) -> RunMode:
    """The run mode `name`, refused under a strategy it does not support in the one wording."""
    mode = RUN_MODES[name]
    require(f"--mode={name}", mode.supports, strategy, fix="use another train.strategy for it")
    return mode
