"""The registry: every extension of a run, checked, ordered, and taken through the stages.

Before anything is built it refuses an extension under a strategy it does not support (the run's
one capability check, `modes.require`), two of one name, an `after` naming nothing known or
forming a cycle, and an extension with state ordered after the checkpoint (the checkpoint of step
S would miss its state at S). Every stage then runs in the default order, moved only as far as the
`after` declarations require.
"""

from __future__ import annotations

from typing import Sequence

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.extensions import built_in
from trainer.extensions.context import Context, Contributions
from trainer.extensions.protocol import Extension, Outputs, name_of, setting_of
from trainer.files.run_checkpoint import ExtensionState

CHECKPOINT = "checkpoint"


class Registry:
    """The run's extensions in their one order, and their stages."""

    def __init__(self, participants: Sequence[Extension], settings) -> None:
        self._settings = settings
        names = [name_of(p) for p in participants]
        for name in names:
            if names.count(name) > 1:
                raise UserError(
                    f"two extensions of this run are named {name!r}; give one another name (its `name` attribute)"
                )
        for e in participants:
            modes.require(
                setting_of(e), e.supports, settings.strategy, reason=e.unsupported_reason, fix=e.unsupported_fix
            )
        self.extensions: list[Extension] = _ordered(list(participants))
        self.contributions = Contributions()

    def check(self) -> None:
        """Each extension's `check(settings)`: before any TensorFlow op or write."""
        for extension in self.extensions:
            extension.check(self._settings)

    def attach(self, context: Context) -> None:
        """Each extension's `attach`, taking part in the run through `context`."""
        self._each_owning(lambda extension: extension.attach(context))

    def states(self) -> dict[str, ExtensionState]:
        """The checkpoint holders of the extensions that keep state of their own, by name."""
        return {name_of(e): ExtensionState(e) for e in self.extensions if e.state_dict() is not None}

    def restored(self, context: Context, path: str | None) -> None:
        """Each extension's `restored`; after it nothing more joins the run's build (`contributions`)."""
        self._each_owning(lambda extension: extension.restored(context, path))
        self.contributions.owner = None

    def _each_owning(self, stage) -> None:
        for extension in self.extensions:
            self.contributions.owner = name_of(extension)
            stage(extension)

    def verify(self, outputs: Outputs) -> None:
        for extension in self.extensions:
            extension.verify(outputs)


def _ordered(participants: list[Extension]) -> list[Extension]:
    """The participants in their given order, each moved after what its `after` names (and the
    checkpoint after every extension with state), as little as that requires."""
    names = [name_of(p) for p in participants]
    present = set(names)
    needs: dict[str, set[str]] = {}
    for participant, name in zip(participants, names):
        after = tuple(getattr(participant, "after", ()) or ())
        unknown = [a for a in after if a not in present and a not in built_in.NAMES]
        if unknown:
            raise UserError(
                f"{name} runs after {unknown[0]!r}, which is neither an extension of this run nor a "
                f"built-in one ({', '.join(sorted(built_in.NAMES))}); fix its `after`"
            )
        needs[name] = {a for a in after if a in present}
    stateful = [n for p, n in zip(participants, names) if p.state_dict() is not None]
    if CHECKPOINT in present:
        for name in stateful:
            if _reaches(needs, name, CHECKPOINT):
                raise UserError(
                    f"{name} keeps state of its own, so it must run before the checkpoint (the checkpoint "
                    f"of a step holds what it decided at that step); remove {CHECKPOINT!r} from its after"
                )
            needs[CHECKPOINT].add(name)
    placed: list[int] = []
    done: set[str] = set()
    while len(placed) < len(participants):
        ready = next((i for i, n in enumerate(names) if i not in placed and needs[n] <= done), None)
        if ready is None:
            waiting = sorted(n for i, n in enumerate(names) if i not in placed)
            raise UserError(f"the `after` declarations of {', '.join(waiting)} form a cycle; remove one of them")
        placed.append(ready)
        done.add(names[ready])
    return [participants[i] for i in placed]


def _reaches(needs: dict[str, set[str]], start: str, target: str) -> bool:
    """Whether `start` must run after `target`, directly or through others."""
    seen, stack = set(), [start]
    while stack:
        for before in needs.get(stack.pop(), ()):
            if before == target:
                return True
            if before not in seen:
                seen.add(before)
                stack.append(before)
    return False
