"""Models and optimizers come as one object or as a dict of them (a GAN's generator and
discriminator); these helpers treat both alike, in a fixed (key) order."""
from __future__ import annotations

from typing import Any, Mapping


def flat(structure: Any) -> list:
    """The values of a dict (in key order), or the one object itself."""
    if isinstance(structure, Mapping):
        return [structure[k] for k in sorted(structure)]
    return [structure]


def named(structure: Any, default: str) -> dict[str, Any]:
    """`{key: value}` of a dict, `{default: value}` of a single object."""
    if isinstance(structure, Mapping):
        return {str(k): structure[k] for k in sorted(structure)}
    return {default: structure}


def trainable_variables(models: Any) -> list:
    return [v for m in flat(models) for v in m.trainable_variables]


def all_variables(structure: Any) -> list:
    return [v for m in flat(structure) for v in getattr(m, "variables", [])]
