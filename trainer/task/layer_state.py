"""Keras layers' non-trainable state under a distribution strategy: created so that every
strategy can update it in replica context and every replica keeps the same value, and found
again for the checkpoint.

Keras 3 creates every layer variable with `aggregation="none"`, which Keras' TF backend passes
to `tf.Variable` as `VariableAggregation.NONE`. Layers update their non-trainable state inside
the step, in replica context (inside `strategy.run`):
- a random layer (Dropout, GaussianNoise, ...) owns a `SeedGenerator` whose int state
  ('seed_generator_state') advances by `state.assign(state + [0, 1])` at every call;
- BatchNormalization assigns new moving statistics ('moving_mean', 'moving_variance', ...)
  computed from this replica's part of the batch.

What an assign in replica context does to a NONE variable depends on the strategy:
- default / one_device: a plain variable, a plain assign.
- mirrored / multi_worker_mirrored: a MirroredVariable; the assign updates only this
  replica's own copy. Seed states stay equal (all copies start equal and add the same +1:
  every replica draws the same seed each step). Moving statistics DRIFT APART: each copy
  follows its own replica's batches, the checkpoint keeps one copy (so a resumed run differs
  from one that never stopped), and eval normalises each replica's examples with its own copy.
- central_storage (and parameter_server with several replicas per worker): the variable is one
  `AggregatingVariable`, whose replica-context assign must combine the replicas' values and
  with NONE cannot: "You must specify an aggregation method to update a AggregatingVariable in
  Replica Context" (Dropout and BatchNorm both fail).

`model_creation_scope(strategy)`, with more than one replica in sync, creates these variables
with an aggregation that says what the update means:
- floating-point state (moving statistics) -> MEAN: the replicas' new values are averaged and
  every copy holds the average (as tf.keras' BatchNormalization aggregated them), so copies never
  drift, the checkpoint holds the state of all of them, resume is exact and eval normalises every
  example alike (measured under mirrored: equal copies after training; one small all-reduce per
  statistic and step);
- integer state (seed generators, counters) under the aggregating strategies -> ONLY_FIRST_REPLICA:
  every replica reads the same state and replica 0's update is written once, so it advances as a
  mirrored copy does; under mirrored it stays NONE (its copies already advance alike, and every
  replica draws the same seed each step).
With one replica it changes nothing.

Losses made inside a model call (`add_loss`, activity regularisers) need the same care.
Keras 3 keeps them in each layer's `_losses` list, cleared when the outermost call starts
and read by `model.losses`; that list is one Python object, while the replicas of a
MirroredStrategy or CentralStorageStrategy call the model in threads of their own. The
threads take turns wherever a replica synchronises with the others (`merge_call`): the MEAN
update of BatchNorm statistics above inside the model call, any assign to a CentralStorage
variable, a cross-replica sum in a layer, `apply_gradients`. So replica 0 could clear the list,
be paused inside the call, and later read replica 1's activity penalty with its own (measured:
the penalty summed over 2 replicas 1.5 times one device's, and the loss-scaling guard
stopping a correct step). `separate_replica_losses(strategy, models)` gives every layer of
the models one such list per thread, so each replica reads exactly the losses its own call
made, as on one device.
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
    """Build the models inside this, so that their layers' non-trainable state suits `strategy`.

    It enters `strategy.scope()` itself unless that scope is already the current one, so it
    works both inside and outside `with strategy.scope():`. A no-op where nothing is needed.
    """
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
    """A list with one content per thread: what a Keras layer's `_losses` must be when
    several replica threads call the same model (see the module docstring). It supports what
    Keras does with `_losses` (`extend`, `append`, `clear`, `[:]`, iteration, `len`); the
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
    """With more than one replica, gives every Keras layer of `models` a `PerThreadLosses` in place
    of its `_losses` list, so that a replica's `model.losses` holds the losses of its own call only.

    Call it once the models are built. Set past Keras' attribute tracking (`object.__setattr__`):
    the list is per-call scratch, never state to track or save.
    """
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
