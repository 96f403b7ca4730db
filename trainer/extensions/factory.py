"""The one factory: the flat `train.*` settings turned into the run's extensions.

Gin files keep their flat bindings (`train.ema_decay = 0.999`, `train.keep_best = 2`, ...);
each built-in (trainer/extensions/built_in.py) makes itself from them, and `train.extensions`
adds the user's own. The list is in the default order the registry starts from: the built-ins in
their table's order, the user's extensions before the checkpoint (the registry moves what runs after it).
"""

from __future__ import annotations

from trainer.extensions.built_in import BUILT_IN
from trainer.extensions.protocol import Extension


def participants(settings) -> list[Extension]:
    """Every extension a run of `settings` has, in the default order."""
    made = {False: [], True: []}
    for entry in BUILT_IN:
        if entry.make is not None and (participant := entry.make(settings)) is not None:
            made[entry.last].append(participant)
    return [*made[False], *settings.extensions, *made[True]]
