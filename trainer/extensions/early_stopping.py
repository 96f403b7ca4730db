"""Early stopping on an eval metric, decided alike on every worker, and the pieces it shares.

`Monitored` names one eval output ('accuracy': of the first eval split; 'train_b/loss': of that
split) and a direction, as Keras' `monitor`/`mode`/`min_delta` do. Under MultiWorkerMirrored every
worker computes the same eval numbers (eval reduces across workers), so the same rule gives the
same answer; a worker that decided otherwise would leave its peers waiting in the next
collective, so each decision is also agreed with one tiny all-reduce (`AnyWorker`).

The patience count is a pure function of the eval history, kept by the chief in
`model_dir/early_stopping.json` (atomic writes) and read back by every worker on resume: a
restarted run stops where an uninterrupted one would have, and a run that stopped early does
not train on when it is started again.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import tensorflow as tf

from trainer.hooks.base import Hook, RunContext
from trainer.files.model_dir import write_text_atomic
from trainer.errors import UserError
from trainer.validation import check_choice, check_int, check_number

MODES = ("min", "max")
STATE_FILE = "early_stopping.json"


@dataclasses.dataclass(frozen=True)
class Monitored:
    """An eval output of one split and which direction is better; `name` as the user wrote it."""

    name: str
    split: str
    key: str
    mode: str
    min_delta: float = 0.0

    def value(self, run: RunContext) -> float:
        results = run.eval_results.get(self.split, {})
        if self.key not in results:
            raise UserError(f"{self.name!r} is not an output of eval split {self.split!r}; its outputs are "
                            f"{sorted(results)} (write '<split>/<name>' for another split)")
        return float(results[self.key])

    def improves(self, value: float, best: float | None) -> bool:
        """Better than `best` by more than min_delta (Keras' rule); anything beats no best; NaN never does."""
        if math.isnan(value):
            return False
        if best is None:
            return True
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta


def monitored(prefix: str, name: Any, mode: Any, splits: tuple[str, ...], min_delta: Any = 0.0) -> Monitored:
    """Checks a metric name, a mode and a min_delta (UserError lines naming `<prefix>metric` etc.)."""
    if not isinstance(name, str) or not name or name.startswith("/") or name.endswith("/"):
        raise UserError(f"{prefix}metric must be an eval output name such as 'accuracy' or '<split>/<name>', "
                        f"got {name!r}")
    check_choice(f"{prefix}mode", mode, MODES)
    check_number(f"{prefix}min_delta", min_delta, strictly=False)
    split, _, key = name.partition("/")
    if key and split in splits:
        return Monitored(name, split, key, mode, float(min_delta))
    return Monitored(name, splits[0], name, mode, float(min_delta))  # e.g. a metric 'top/k' of the first split


def eval_done_at(run: RunContext, step: int) -> bool:
    return run.last_eval_step == step


class AnyWorker:
    """`flag` agreed across workers: True where any worker says True (a SUM all-reduce of a 0/1
    through the run's strategy; every worker must call it at the same point)."""

    def __init__(self, strategy: tf.distribute.Strategy):
        self._async = isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)

        @tf.function(autograph=False)
        def total(flag):
            per_replica = strategy.run(tf.identity, args=(flag,))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        self._total = total

    def __call__(self, flag: bool) -> bool:
        if self._async:  # one coordinator process decides for all
            return flag
        return bool(self._total(tf.constant(1.0 if flag else 0.0)) > 0)


@dataclasses.dataclass(frozen=True)
class EarlyStopping:
    """`train.early_stopping = @early_stopping()`: stop when `metric` has not improved by more than
    `min_delta` for `patience` evals in a row. Ends the run cleanly (exit 0) with a final
    checkpoint at the stop step.

    Args:
      metric: an eval output name ('accuracy': of the first eval split; '<split>/<name>').
      mode: 'min' or 'max' (which direction is better).
      patience: evals without improvement before stopping.
      min_delta: the least change that counts as an improvement.
    """

    metric: str = "loss"
    mode: str = "min"
    patience: int = 3
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        check_int("early_stopping.patience", self.patience)

    def hook(self, splits: tuple[str, ...]) -> "EarlyStoppingHook":
        return EarlyStoppingHook(monitored("early_stopping.", self.metric, self.mode, splits, self.min_delta),
                                 self.patience)


def make_hooks(early_stopping: Any, splits: tuple[str, ...]) -> list[Hook]:
    """The hook of `train.early_stopping` (checked), or none."""
    if early_stopping is None:
        return []
    if not isinstance(early_stopping, EarlyStopping):
        raise UserError(f"train.early_stopping must be @early_stopping() or None, got {early_stopping!r}")
    return [early_stopping.hook(splits)]


class EarlyStoppingHook(Hook):
    """After each eval: improvement or one more eval of patience used; at `patience`, stop."""

    def __init__(self, metric: Monitored, patience: int):
        self.metric, self.patience = metric, patience
        self._history: list[tuple[int, float]] = []  # (step, value) of every eval so far
        self._any_worker: AnyWorker | None = None

    def begin(self, run: RunContext) -> None:
        self._any_worker = AnyWorker(run.strategy)
        state = _read_state(run.model_dir)
        if state.get("metric") == self.metric.name:
            self._history = [(int(s), float(v)) for s, v in state.get("history", []) if int(s) <= run.start_step]
        best_step, wait = self._standing()
        if self._history and wait >= self.patience:
            run.stop_requested = True
            run.print_fn(f"early stopping: {self.metric.name} has not improved since step {best_step} "
                         f"({wait} evals); this run stopped at step {run.start_step}, nothing more to train")

    def _standing(self) -> tuple[int | None, int]:
        """The best eval's step and the evals since it that did not improve on it."""
        best, best_step, wait = None, None, 0
        for step, value in self._history:
            if self.metric.improves(value, best):
                best, best_step, wait = value, step, 0
            else:
                wait += 1
        return best_step, wait

    def _record(self, run: RunContext, step: int) -> bool:
        """Adds this step's eval to the history (chief: to the state file); False if there is none."""
        if not eval_done_at(run, step) or (self._history and self._history[-1][0] == step):
            return False
        self._history.append((step, self.metric.value(run)))
        if run.is_chief:
            write_text_atomic(os.path.join(run.model_dir, STATE_FILE), json.dumps(
                {"metric": self.metric.name, "mode": self.metric.mode, "history": self._history}))
        return True

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        if not self._record(run, step):
            return
        best_step, wait = self._standing()
        if self._any_worker(wait >= self.patience) and step < run.total_steps:
            run.stop_requested = True
            run.print_fn(f"early stopping at step {step}: {self.metric.name} {self._history[-1][1]:.6g} has not "
                         f"improved by more than {self.metric.min_delta:g} for {wait} evals (best "
                         f"{dict(self._history)[best_step]:.6g} at step {best_step})")

    def end(self, run: RunContext, step: int) -> None:
        self._record(run, step)  # the final eval counts too (a resumed run reads it back)

    def rewind(self, run: RunContext, step: int) -> None:
        self._history = [(s, v) for s, v in self._history if s <= step]


def _read_state(model_dir: str) -> dict:
    path = os.path.join(model_dir, STATE_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)
