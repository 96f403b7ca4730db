"""Keras layers' non-trainable state under a distribution strategy: created so that every strategy can update
it in replica context and every replica keeps the same value, and found again for the checkpoint.

Keras 3 creates every layer variable with aggregation NONE, and layers update their non-trainable state in
replica context: a random layer's `SeedGenerator` state advances by `assign(state + [0, 1])` at every call,
BatchNormalization assigns moving statistics from this replica's part of the batch. Under mirrored /
multi_worker_mirrored such an assign updates only this replica's copy: seed states stay equal, but moving
statistics DRIFT APART (the checkpoint keeps one copy, so resume is not exact, and eval normalises each
replica's examples differently). Under central_storage (and parameter_server with several replicas per
worker) the variable is one `AggregatingVariable`, whose replica-context assign fails with NONE ("You must
specify an aggregation method to update a AggregatingVariable in Replica Context").

`model_creation_scope(strategy)`, with more than one replica in sync, creates these variables with an
aggregation that says what the update means: floating-point state -> MEAN (every copy holds the replicas'
average, as tf.keras' BatchNormalization did: copies never drift, resume is exact; one small all-reduce per
statistic and step); integer state under the aggregating strategies -> ONLY_FIRST_REPLICA (replica 0's
update written once, advancing as a mirrored copy does); under mirrored integer state stays NONE.

Losses made inside a model call (`add_loss`, activity regularisers) need the same care: Keras 3 keeps them in
each layer's `_losses` list, one Python object, while the replicas of a Mirrored or CentralStorage strategy
call the model in threads of their own that take turns wherever a replica synchronises (`merge_call`). So
replica 0 could clear the list, be paused, and later read replica 1's penalty with its own (measured: the
penalty over 2 replicas 1.5 times one device's). `separate_replica_losses` gives every layer one such list
per thread, so each replica reads exactly the losses its own call made.
"""

from __future__ import annotations

import collections.abc
import contextlib
import threading
from typing import Any, Iterable, Iterator, Mapping

import keras
import tensorflow as tf

from trainer import internals
from trainer.distribution import modes
from trainer.task.structure import flat

SEED_STATE_NAME = "seed_generator_state"  # keras.random.SeedGenerator's variable name


def needs_state_aggregation(strategy: tf.distribute.Strategy) -> bool:
    """True where a layer state created with aggregation NONE would drift apart or fail to update."""
    return strategy.num_replicas_in_sync > 1


def _state_creator(aggregating: bool):
    """A variable creator giving non-trainable NONE-aggregated variables the aggregation their
    updates need: MEAN for floating-point state, ONLY_FIRST_REPLICA for integer state where the
    strategy aggregates (elsewhere integer state stays NONE: its copies advance alike)."""

    def creator(next_creator, **kwargs):
        if kwargs.get("trainable") is False and kwargs.get("aggregation") in (None, tf.VariableAggregation.NONE):
            dtype = kwargs.get("dtype")
            if dtype is not None and tf.as_dtype(dtype).is_floating:
                kwargs["aggregation"] = tf.VariableAggregation.MEAN
            elif aggregating:
                kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
        return next_creator(**kwargs)

    return creator


@contextlib.contextmanager
def model_creation_scope(strategy: tf.distribute.Strategy) -> Iterator[None]:
    """Build the models inside this (inside or outside `strategy.scope()`), so that their layers'
    non-trainable state suits `strategy`."""
    if not needs_state_aggregation(strategy):
        yield
        return
    with contextlib.ExitStack() as stack:
        if not (tf.distribute.has_strategy() and tf.distribute.get_strategy() is strategy):
            stack.enter_context(strategy.scope())
        # Entered inside the strategy scope: this creator runs before the strategy's own,
        # so the strategy wraps the variable with the aggregation set here.
        stack.enter_context(
            tf.variable_creator_scope(_state_creator(aggregating=modes.of(strategy).aggregates_variables))
        )
        yield


class PerThreadLosses(collections.abc.MutableSequence):
    """A list with one content per thread, for a Keras layer's `_losses` (see the module docstring); the
    thread that installs it keeps the losses the list held."""

    def __init__(self, initial: Iterable = ()):
        self._local = threading.local()
        self._mine().extend(initial)

    def _mine(self) -> list:
        items = getattr(self._local, "items", None)
        if items is None:
            items = self._local.items = []
        return items

    def __getitem__(self, index):
        return self._mine()[index]

    def __setitem__(self, index, value) -> None:
        self._mine()[index] = value

    def __delitem__(self, index) -> None:
        del self._mine()[index]

    def __len__(self) -> int:
        return len(self._mine())

    def insert(self, index: int, value) -> None:
        self._mine().insert(index, value)

    def clear(self) -> None:
        self._mine().clear()

    def __repr__(self) -> str:
        return f"PerThreadLosses({self._mine()!r})"


def _keras_layers(models: Any) -> list:
    """Every Keras layer of a model, a tf.Module or a dict of them (nested ones included), once each."""
    tops = []
    for model in flat(models):
        if isinstance(model, keras.layers.Layer):
            tops.append(model)
        elif isinstance(model, tf.Module):
            tops.extend(internals.keras_layers_in(model))
    layers, seen = [], set()
    for top in tops:
        for layer in internals.keras_sublayers(top):
            if id(layer) not in seen:
                seen.add(id(layer))
                layers.append(layer)
    return layers


def separate_replica_losses(strategy: tf.distribute.Strategy, models: Any) -> None:
    """With more than one replica, gives every Keras layer of the built `models` a `PerThreadLosses` for
    `_losses`, set past Keras' attribute tracking: per-call scratch, never state to track or save."""
    if strategy.num_replicas_in_sync <= 1 or not keras.__version__.startswith("3."):
        return  # one replica; or tf_keras (the parity tool's fit), whose `_losses` are not per call
    for layer in _keras_layers(models):
        internals.replace_layer_losses(
            layer, lambda old: old if isinstance(old, PerThreadLosses) else PerThreadLosses(old)
        )


def random_states(models) -> list:
    """Keras seed-generator states (dropout and other random layers) of a model, a tf.Module or a
    dict of them (in the dict's order), each once: checkpointed so that a resumed run draws the same
    random numbers as one that never stopped."""
    if isinstance(models, Mapping):
        models = list(models.values())
    elif not isinstance(models, (list, tuple)):
        models = [models]
    states, seen = [], set()
    for model in models:
        for v in getattr(model, "non_trainable_variables", []):
            if getattr(v, "path", "").endswith(SEED_STATE_NAME) and id(v) not in seen:
                seen.add(id(v))
                states.append(v)
    return states
