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


def keras_layers_held(module: Any) -> list[str]:
    """The attribute paths (`embeddings[0]`) of the Keras layers a `tf.Module` holds (also in lists, dicts and
    nested tf.Modules): their weights are invisible to `tf.Module.trainable_variables` (Keras 3 layers are
    neither tf.Modules nor hold tf.Variables)."""
    import keras
    import tensorflow as tf

    found: list[str] = []
    seen: set[int] = set()

    def walk(value: Any, path: str) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, keras.layers.Layer):
            found.append(path)
        elif isinstance(value, tf.Module):
            for name, item in sorted(vars(value).items()):
                if not name.startswith("_"):
                    walk(item, f"{path}.{name}" if path else name)
        elif isinstance(value, Mapping):
            for key in value:
                walk(value[key], f"{path}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]")

    if isinstance(module, tf.Module):  # a Keras model is no tf.Module: it tracks its own layers
        walk(module, "")
    return found
