"""Which feature works under which strategy, as a table made from the features' own declarations:
`python -m trainer.extensions.capabilities` prints the Markdown table docs/around-the-step.md
shows (a test keeps the two equal), so the docs cannot drift from what the registry enforces.
"""

from __future__ import annotations

from trainer.data import device
from trainer.distribution import modes
from trainer.extensions.built_in import BUILT_IN
from trainer.run.settings import CAPABILITIES


def rows() -> list[tuple[str, modes.Support]]:
    """(setting, support) of every built-in extension (in the table's order), then the core's options, then
    the train split held on the devices (elsewhere the tf.data path, not a refusal)."""
    found = []
    for entry in BUILT_IN:
        if entry.cls.setting or entry.shown_as:
            found += [(e.setting, e.supports) for e in (entry.shown_as() if entry.shown_as else [entry.cls])]
    return found + list(CAPABILITIES) + [("train.device_data_max_bytes", device.SUPPORT)]


def table() -> str:
    """The Markdown table: a row per feature, a column per strategy."""
    names = modes.STRATEGY_NAMES
    lines = ["| feature | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for setting, support in rows():
        lines.append(f"| `{setting}` | " + " | ".join("yes" if n in support else "no" for n in names) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
