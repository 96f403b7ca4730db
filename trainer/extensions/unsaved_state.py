"""State the step writes that no checkpoint holds, named once, at the first loop call.

A Keras 3 model tracks its layers, weights and `tf.Module` attributes, but not a Python list (or dict) of
`tf.Variable`s set on it (`model.buffers = [tf.Variable(...)]`): a step that accumulates into such a
variable trains, yet a resumed run starts it anew. The variables reachable from the models and optimizers
through their public attributes, lists and dicts that the run's checkpoint does not hold are read before the
first loop call and after it; each one the call changed is named in one `warning:` line with where to keep it.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import keras
import numpy as np
import tensorflow as tf

from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.task.structure import named

KERAS_VARIABLE = getattr(keras, "Variable", tf.Variable)


def reachable_variables(roots: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(attribute path, variable) of each variable reachable from `roots` through public attributes of Keras
    layers and tf.Modules, lists, tuples and dicts; each variable once, at its first path."""
    seen: set[int] = set()

    def walk(value: Any, path: str) -> Iterator[tuple[str, Any]]:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, (tf.Variable, KERAS_VARIABLE)):
            yield path, value
        elif isinstance(value, (keras.layers.Layer, keras.optimizers.Optimizer, tf.Module)):
            for name, item in list(vars(value).items()):
                if not name.startswith("_"):
                    yield from walk(item, f"{path}.{name}")
        elif isinstance(value, Mapping):
            for key, item in list(value.items()):
                yield from walk(item, f"{path}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                yield from walk(item, f"{path}[{index}]")

    for name, root in roots.items():
        yield from walk(root, name)


def _inner(variable: Any) -> Any:
    return (
        variable.value if isinstance(variable, KERAS_VARIABLE) and not isinstance(variable, tf.Variable) else variable
    )


def checkpointed(items: Mapping[str, Any]) -> set[int]:
    """The ids of every variable the checkpoint of `items` holds (and of what a Keras variable wraps)."""
    held: set[int] = set()
    root = tf.train.Checkpoint(**items)  # the view keeps only a weak reference to it
    for trackable in tf.train.TrackableView(root).descendants():
        held.update({id(trackable), id(_inner(trackable))})
    return held


class UnsavedState(Extension):
    """Warns once about each variable the first loop call changed that no checkpoint holds."""

    name = "unsaved_state"

    def __init__(self) -> None:
        self._before: list[tuple[str, Any, list[np.ndarray]]] = []
        self._checked = False

    def begin(self, context: Context) -> None:
        task = context.task
        held = checkpointed(task.checkpoint_items)
        roots = {**named(task.models, "model"), **named(task.optimizers, "optimizer")}
        strategy = context.runtime.strategy
        self._before = [
            (path, variable, _values(strategy, variable))
            for path, variable in reachable_variables(roots)
            if id(variable) not in held and id(_inner(variable)) not in held
        ]
        self._checked = False

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if self._checked:
            return
        self._checked = True
        strategy = context.runtime.strategy
        changed = [
            path
            for path, variable, before in self._before
            if any(not np.array_equal(a, b) for a, b in zip(before, _values(strategy, variable)))
        ]
        self._before = []
        if changed and context.runtime.is_chief:
            context.print(
                f"warning: the step writes {', '.join(changed)}, which no checkpoint holds (a Python list or dict "
                "of variables on a Keras 3 model is not tracked), so a resumed run starts it anew; keep it in a "
                "tf.Module set as a model attribute (model.state = tf.Module(); model.state.buffers = [...]) or "
                "as a variable attribute of its own"
            )


def _values(strategy: tf.distribute.Strategy, variable: Any) -> list[np.ndarray]:
    return [np.array(local.numpy()) for local in strategy.experimental_local_results(_inner(variable))]
