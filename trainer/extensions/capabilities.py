"""Which feature works under which strategy, as a table made from the features' own declarations.

    python -m trainer.extensions.capabilities

prints the Markdown table that docs/around-the-step.md shows (a test keeps the two equal), so
the docs cannot drift from what the registry enforces.
"""

from __future__ import annotations

from trainer.distribution import modes
from trainer.extensions.best_checkpoints import BestCheckpoints
from trainer.extensions.early_stopping import EarlyStop
from trainer.extensions.ema import Ema
from trainer.extensions.export import Export
from trainer.extensions.keras_callbacks import KerasCallbacks
from trainer.extensions.loss_scaling import LossScalingCheck
from trainer.extensions.mlflow_tracking import MlflowHook
from trainer.extensions.nonfinite import NonFiniteHandling
from trainer.extensions.preemption import Preemption
from trainer.extensions.profiler import ProfilerHook
from trainer.extensions.update_path import UpdatePath
from trainer.extensions.warm_start import WarmStart
from trainer.run.settings import CAPABILITIES

BUILT_IN = (
    UpdatePath,
    Ema,
    WarmStart,
    BestCheckpoints,
    EarlyStop,
    KerasCallbacks,
    Export,
    Preemption,
    LossScalingCheck,
    MlflowHook,
    ProfilerHook,
)


def rows() -> list[tuple[str, modes.Support]]:
    """(setting, support) of every built-in feature and core option with a declared support."""
    found = [(f"train.nonfinite = {m!r}", NonFiniteHandling(m).supports) for m in ("stop", "rollback")]
    found += [(cls.setting, cls.supports) for cls in BUILT_IN]
    return found + list(CAPABILITIES)


def table() -> str:
    """The Markdown table: a row per feature, a column per strategy."""
    names = modes.STRATEGY_NAMES
    lines = ["| feature | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for setting, support in rows():
        lines.append(f"| `{setting}` | " + " | ".join("yes" if n in support else "no" for n in names) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
