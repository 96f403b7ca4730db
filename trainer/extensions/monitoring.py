"""What the extensions acting on eval results share: the eval output they watch, its direction
(Keras' `monitor`/`mode`/`min_delta`), checked against the traced eval before anything is
written, and `AnyWorker`: every worker computes the same eval numbers, but one deciding otherwise
would leave its peers waiting in the next collective, so decisions are agreed by one all-reduce.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.extensions.protocol import Outputs
from trainer.validation import check_choice, check_number

DIRECTIONS = ("min", "max")


@dataclasses.dataclass(frozen=True)
class Monitored:
    """An eval output of one split and which direction is better; `name` as the user wrote it."""

    name: str
    split: str
    key: str
    mode: str
    min_delta: float = 0.0
    setting: str = "metric"  # the gin key that named it, for messages

    def verify(self, outputs: Outputs) -> None:
        """Refuses a name the eval split does not produce (checked once the eval is traced)."""
        produced = outputs.eval.get(self.split, ())
        if self.key not in produced:
            raise UserError(
                f"{self.setting} {self.name!r} is not an output of eval split {self.split!r}; its outputs "
                f"are {sorted(produced)} (write '<split>/<name>' for another split)"
            )

    def value(self, results: Mapping[str, Mapping[str, float]]) -> float:
        """The watched value in eval results by split."""
        return float(results[self.split][self.key])

    def improves(self, value: float, best: float | None) -> bool:
        """Better than `best` by more than min_delta (Keras' rule); anything finite beats no best; a NaN or
        infinite value never does (a model non-finite on some example is no improvement, whichever the mode)."""
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta


def monitored(prefix: str, name: Any, mode: Any, splits: tuple[str, ...], min_delta: Any = 0.0) -> Monitored:
    """Checks a metric name, a mode and a min_delta (UserError lines naming `<prefix>metric` etc.)."""
    if not isinstance(name, str) or not name or name.startswith("/") or name.endswith("/"):
        raise UserError(
            f"{prefix}metric must be an eval output name such as 'accuracy' or '<split>/<name>', got {name!r}"
        )
    check_choice(f"{prefix}mode", mode, DIRECTIONS)
    check_number(f"{prefix}min_delta", min_delta, strictly=False)
    split, _, key = name.partition("/")
    setting = f"{prefix}metric"
    if key and split in splits:
        return Monitored(name, split, key, mode, float(min_delta), setting)
    return Monitored(name, splits[0], name, mode, float(min_delta), setting)  # e.g. a metric 'top/k' of the first split


class AnyWorker:
    """`flag` agreed across workers: True where any worker says True (a SUM all-reduce of a 0/1
    through the run's strategy; every worker must call it at the same point)."""

    def __init__(self, strategy: tf.distribute.Strategy):
        self._coordinator_decides = modes.of(strategy).coordinates_workers

        @tf.function(autograph=False)
        def total(flag):
            per_replica = strategy.run(tf.identity, args=(flag,))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        self._total = total

    def __call__(self, flag: bool) -> bool:
        if self._coordinator_decides:  # one coordinator process decides for all
            return flag
        return bool(self._total(tf.constant(1.0 if flag else 0.0)) > 0)
