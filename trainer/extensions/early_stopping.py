"""`train.early_stopping = @early_stopping()`: stop when an eval metric has not improved for a while.

Keras' rule, on the eval history, which is the extension's state (checkpointed): a resumed run
stops where an uninterrupted one would, and a stopped run does not train on when restarted.
The decision is agreed across workers; the run ends cleanly with a final checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.extensions.context import Context
from trainer.extensions.monitoring import AnyWorker, Monitored, monitored
from trainer.extensions.protocol import Extension, Outputs
from trainer.validation import check_int


@dataclasses.dataclass(frozen=True)
class EarlyStoppingOptions:
    """Stop when `metric` (an eval output of the first split, or '<split>/<name>') has not improved
    in direction `mode` ('min'/'max') by more than `min_delta` for `patience` evals in a row."""

    metric: str = "loss"
    mode: str = "min"
    patience: int = 3
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        check_int("early_stopping.patience", self.patience)


class EarlyStop(Extension):
    """The extension `EarlyStoppingOptions` configures."""

    name = "early_stopping"
    setting = "train.early_stopping"
    after = ("eval",)

    def __init__(self, metric: Monitored, patience: int):
        self.metric, self.patience = metric, patience
        self._history: list[tuple[int, float]] = []  # (step, value) of every eval so far
        self._any_worker: AnyWorker | None = None

    @classmethod
    def of(cls, config: EarlyStoppingOptions, splits: tuple[str, ...]) -> "EarlyStop":
        return cls(monitored("early_stopping.", config.metric, config.mode, splits, config.min_delta), config.patience)

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric.name, "mode": self.metric.mode, "history": self._history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("metric") == self.metric.name and state.get("mode") == self.metric.mode:
            self._history = [(int(s), float(v)) for s, v in state.get("history", [])]

    def verify(self, outputs: Outputs) -> None:
        self.metric.verify(outputs)

    def begin(self, context: Context) -> None:
        self._any_worker = AnyWorker(context.runtime.strategy)
        self.rewind(context, context.start_step)
        best_step, wait = self._standing()
        if self._history and wait >= self.patience:
            context.request_stop()
            context.print(
                f"early stopping: {self.metric.name} has not improved since step {best_step} "
                f"({wait} evals); this run stopped at step {context.start_step}, nothing more to train"
            )

    def _standing(self) -> tuple[int | None, int]:
        """The best eval's step and the evals since it that did not improve on it."""
        best, best_step, wait = None, None, 0
        for step, value in self._history:
            if self.metric.improves(value, best):
                best, best_step, wait = value, step, 0
            else:
                wait += 1
        return best_step, wait

    def _record(self, context: Context, step: int) -> bool:
        """Adds this step's eval to the history; False if there is none (or it is there already)."""
        results = context.evaluations.at(step)
        if results is None or (self._history and self._history[-1][0] == step):
            return False
        self._history.append((step, self.metric.value(results)))
        return True

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if not self._record(context, step):
            return
        best_step, wait = self._standing()
        if self._any_worker(wait >= self.patience) and step < context.settings.total_steps:
            context.request_stop()
            context.print(
                f"early stopping at step {step}: {self.metric.name} {self._history[-1][1]:.6g} has not "
                f"improved by more than {self.metric.min_delta:g} for {wait} evals (best "
                f"{dict(self._history)[best_step]:.6g} at step {best_step})"
            )

    def end(self, context: Context, step: int) -> None:
        self._record(context, step)  # the final eval counts too (the final checkpoint holds it)

    def rewind(self, context: Context, step: int) -> None:
        self._history = [(s, v) for s, v in self._history if s <= step]
