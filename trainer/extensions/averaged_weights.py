"""Weights an extension holds beside the model's (EMA, SWA), evaluated as splits of their own.

One recipe serves the run's inline eval and `--mode=evaluate` (trainer/run/evaluate.py) alike, so a
re-evaluation of a checkpoint gives what the run logged when it wrote it: swap the held weights
into the model, evaluate every eval split as `<split>_<name>`, swap the model's own weights back.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ContextManager

from trainer.extensions.protocol import Extension, name_of

if TYPE_CHECKING:
    from trainer.extensions.context import Context


class AveragedWeights(Extension, abc.ABC):
    """An extension whose weights the run evaluates after every eval of the model's own, as split
    `<split>_<name>` (`name`: the extension's; `weights_label`: how eval lines show them)."""

    weights_label: str = ""

    @abc.abstractmethod
    def swapped_in(self) -> ContextManager[None]:
        """The model holds these weights inside the block, its own again after it."""

    def holds_weights(self) -> bool:
        """Whether there is anything to evaluate yet (SWA: not before its first snapshot)."""
        return True

    def evaluate_weights(self, context: "Context", step: int) -> dict[str, dict[str, float]]:
        """Every eval split with these weights swapped in, recorded and printed as the run's evals are."""
        with self.swapped_in():
            return context.evaluate(step, suffix=f"_{name_of(self)}", label=f" ({self.weights_label})")
