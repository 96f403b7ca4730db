"""The registry: every hook and extension of a run, checked, ordered, and taken through the stages.

Made first, from the run's participants in their default order (core hooks, built-in
extensions, the user's hooks and extensions, then the checkpoint and what runs after it), it
refuses, before anything is built:
- an extension under a strategy it does not support (the one capability check of the run,
  `modes.require`, one wording for all);
- two participants of one name, an `after` naming nothing known, a cycle;
- an extension with state of its own ordered after the checkpoint (its state at step S would
  miss from the checkpoint of step S).
Then every stage (check, attach, restored, verify, the hooks) runs in one order: the default
order, moved only as far as the `after` declarations require.
"""

from __future__ import annotations

from typing import Callable, Sequence

from trainer.distribution import modes
from trainer.distribution.runtime import Runtime
from trainer.errors import UserError
from trainer.extensions import built_in
from trainer.extensions.protocol import Contributions, Extension, Outputs, Setup, setting_of
from trainer.files.run_checkpoint import ExtensionState
from trainer.hooks.base import Hook, name_of

CHECKPOINT = "checkpoint"


class Registry:
    """The run's hooks and extensions in their one order (`hooks`), and their stages."""

    def __init__(self, participants: Sequence[Hook], settings) -> None:
        self._settings = settings
        names = [name_of(p) for p in participants]
        for name in names:
            if names.count(name) > 1:
                raise UserError(
                    f"two hooks or extensions of this run are named {name!r}; give one another name "
                    "(its `name` attribute)"
                )
        for participant in participants:
            if isinstance(participant, Extension):
                modes.require(
                    setting_of(participant),
                    participant.supports,
                    settings.strategy,
                    reason=participant.unsupported_reason,
                    fix=participant.unsupported_fix,
                )
        self.hooks: list[Hook] = _ordered(list(participants))
        self.extensions: list[Extension] = [h for h in self.hooks if isinstance(h, Extension)]
        self.contributions = Contributions()
        self._setups: dict[str, Setup] = {}

    def check(self) -> None:
        """Each extension's `check(settings)`: before any TensorFlow op or write."""
        for extension in self.extensions:
            extension.check(self._settings)

    def attach(self, runtime: Runtime, task, print_fn: Callable[[str], None]) -> Contributions:
        """Each extension's `attach`; returns what they contributed (update path, values, ...)."""
        for extension in self.extensions:
            setup = Setup(extension, self._settings, runtime, task, self.contributions, print_fn)
            self._setups[name_of(extension)] = setup
            extension.attach(setup)
        return self.contributions

    def states(self) -> dict[str, ExtensionState]:
        """The checkpoint holders of the extensions that keep state of their own, by name."""
        return {name_of(e): ExtensionState(e) for e in self.extensions if e.state_dict() is not None}

    def restored(self, path: str | None) -> None:
        for extension in self.extensions:
            extension.restored(self._setups[name_of(extension)], path)

    def verify(self, outputs: Outputs) -> None:
        for extension in self.extensions:
            extension.verify(outputs)


def _ordered(participants: list[Hook]) -> list[Hook]:
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
                f"{name} runs after {unknown[0]!r}, which is neither a hook or extension of this run nor a "
                f"built-in one ({', '.join(sorted(built_in.NAMES))}); fix its `after`"
            )
        needs[name] = {a for a in after if a in present}
    stateful = [n for p, n in zip(participants, names) if isinstance(p, Extension) and p.state_dict() is not None]
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
