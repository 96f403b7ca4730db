"""The extension protocol: the one plug-in type of every feature around the loop, built in or a
researcher's own. Every stage but `check` and `verify` gets the same `Context`; the names an
author needs are listed in docs/extensions.md.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from trainer.distribution import modes
from trainer.errors import UserError

if TYPE_CHECKING:
    from trainer.extensions.context import Context
    from trainer.run.settings import Settings


class Extension:
    """Base class of every extension; override what you need (`name` empty: the class name)."""

    every_steps: int = 0
    name: str = ""
    after: tuple[str, ...] = ()
    supports: modes.Support = modes.ALL
    setting: str = ""
    unsupported_reason: str = ""  # why not under the other strategies, said in the refusal
    unsupported_fix: str = ""  # what to do instead (default: unset it)

    def check(self, settings: "Settings") -> None:
        """Refuse settings this extension cannot work with (a UserError line); no TensorFlow here."""

    def attach(self, context: "Context") -> None:
        """Take part in the built run; called under no strategy scope."""

    def restored(self, context: "Context", path: str | None) -> None:
        """After the restore: `path` is the checkpoint restored, None for a fresh run."""

    def verify(self, outputs: "Outputs") -> None:
        """After the loops are traced and before anything is written: check output names."""

    def state_dict(self) -> dict[str, Any] | None:
        """This extension's own state, JSON-able, saved in every checkpoint (None: it keeps none)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The state `state_dict` returned, read back from the checkpoint being restored."""

    def begin(self, context: "Context") -> None:
        """Before the first loop call (also on a resumed run, at `context.start_step`)."""

    def rollback_to(self, context: "Context", step: int, num_steps: int, metrics: Mapping[str, float]) -> int | None:
        """After the call of `num_steps` steps from `step`, before any `after_loop`: the step to
        roll back to if the call's results must be thrown away (None: keep them)."""
        return None

    def after_loop(self, context: "Context", step: int, metrics: dict[str, float]) -> None:
        """After each loop call that ended at `step`; `metrics`: the step outputs' means over it."""

    def end(self, context: "Context", step: int) -> None:
        """After the last loop call (also when an extension asked to stop early)."""

    def rewind(self, context: "Context", step: int) -> None:
        """Training went back to `step` (a roll-back after a non-finite loss)."""

    def close(self, context: "Context") -> None:
        """After the run however it ended (an error, an exit, after `end`): give back what `begin`
        took from the process (signal handlers), so a caller of `train` gets it back."""

    def steps_to_boundary(self, step: int) -> int | None:
        if self.every_steps <= 0:
            return None
        return self.every_steps - step % self.every_steps

    def at_boundary(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0


def name_of(extension: Extension) -> str:
    """The name an extension is known by: its `name`, else its class name."""
    return getattr(extension, "name", "") or type(extension).__name__


PROTOCOL_METHODS = frozenset(
    name for name in dir(Extension) if not name.startswith("_") and callable(getattr(Extension, name))
)
# What a near miss is: difflib's ratio at least this (`atach` 0.91, `restore` 0.93), of a method
# name of at least 4 letters (`send` is no typo of `end`).
NEAR_MISS_RATIO = 0.85
_MISSABLE = sorted(name for name in PROTOCOL_METHODS if len(name) >= 4)


def check_method_names(participants: Sequence[Extension]) -> None:
    """Refuses a public method whose name is a near miss of a protocol method the extension does not
    define (`atach`): never called, the feature would fail later, far from the typo."""
    for participant in participants:
        cls = type(participant)
        own = {name for klass in cls.__mro__ if klass not in (Extension, object) for name in vars(klass)}
        for name in sorted(own):
            if name.startswith("_") or name in PROTOCOL_METHODS or not callable(getattr(cls, name, None)):
                continue
            close = [m for m in difflib.get_close_matches(name, _MISSABLE, n=3, cutoff=NEAR_MISS_RATIO) if m not in own]
            if close:
                raise UserError(
                    f"{cls.__name__}.{name} is not a method of the extension protocol, and "
                    f"the run never calls it; did you mean {close[0]}? (rename it; a helper of its own "
                    "starts with _)"
                )


def setting_of(extension: Extension) -> str:
    """How the user turned `extension` on, for messages."""
    return extension.setting or f"{name_of(extension)} (train.extensions)"


@dataclasses.dataclass(frozen=True)
class Outputs:
    """The names a traced run produces: the train step's outputs and, by eval split, the eval
    results (the eval step's per-example means and the eval metrics' results)."""

    train: tuple[str, ...]
    eval: Mapping[str, tuple[str, ...]]
