"""Keras seed-generator state under a distribution strategy: create it so each strategy accepts it,
and find it again for the checkpoint.

Every Keras 3 random layer (Dropout, GaussianNoise, RandomFlip, ...) owns a `SeedGenerator`
whose state is a non-trainable int variable named 'seed_generator_state', created with
`aggregation="none"`. Each call in training draws `state` and then runs `state.assign(state + [0, 1])`
in replica context (inside `strategy.run`). How that assign behaves is up to the strategy:

- default / one_device: a plain variable, a plain assign.
- mirrored / multi_worker_mirrored: a MirroredVariable; with aggregation NONE an assign in replica
  context updates only that replica's own copy (`values._on_write_update_replica`). Every copy
  starts equal and advances by the same +1, so the copies stay equal, and every replica draws
  the SAME seed on each step: same input shape, same dropout mask on every replica.
- central_storage (and parameter_server with more than one replica per worker): with more than
  one replica, `ParameterServerStrategyExtended._create_var_creator` wraps every variable in a
  `ps_values.AggregatingVariable` (one copy, on the CPU). Its assign in replica context
  aggregates the replicas' values in a `merge_call` and applies the result once, and with
  aggregation NONE there is nothing to aggregate with, so it raises "You must specify an
  aggregation method to update a AggregatingVariable in Replica Context".

`model_creation_scope(strategy)` gives those seed states ONLY_FIRST_REPLICA under the strategies
that wrap variables in AggregatingVariable: the replicas all read the same state, replica 0's
`state + [0, 1]` is written once per call, so the state moves exactly as a mirrored copy does
(same seeds and same checkpointed values as under mirrored). Under every other strategy it
changes nothing.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import tensorflow as tf

SEED_STATE_NAME = "seed_generator_state"  # keras.random.SeedGenerator's variable name

# Strategies that, with more than one replica, wrap each variable in an AggregatingVariable.
_AGGREGATING_STRATEGIES = (
    tf.distribute.experimental.CentralStorageStrategy,
    tf.distribute.experimental.ParameterServerStrategy,
    tf.compat.v1.distribute.experimental.CentralStorageStrategy,
    tf.compat.v1.distribute.experimental.ParameterServerStrategy,
)


def needs_seed_state_aggregation(strategy: tf.distribute.Strategy) -> bool:
    """True where a seed state created with aggregation NONE could not be updated in replica context."""
    return isinstance(strategy, _AGGREGATING_STRATEGIES) and strategy.num_replicas_in_sync > 1


def _is_seed_state(kwargs) -> bool:
    name = kwargs.get("name") or ""
    return name.split("/")[-1].split(":")[0] == SEED_STATE_NAME and not kwargs.get("trainable", False)


def _seed_state_creator(next_creator, **kwargs):
    aggregation = kwargs.get("aggregation")
    if _is_seed_state(kwargs) and aggregation in (None, tf.VariableAggregation.NONE):
        kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
    return next_creator(**kwargs)


@contextlib.contextmanager
def model_creation_scope(strategy: tf.distribute.Strategy) -> Iterator[None]:
    """Build the model (any Keras random layers) inside this, so its seed states suit `strategy`.

    It enters `strategy.scope()` itself unless that scope is already the current one, so it
    works both inside and outside `with strategy.scope():`. A no-op where nothing is needed
    (default, one_device, mirrored, multi_worker_mirrored, one-replica parameter_server).
    """
    if not needs_seed_state_aggregation(strategy):
        yield
        return
    with contextlib.ExitStack() as stack:
        if not (tf.distribute.has_strategy() and tf.distribute.get_strategy() is strategy):
            stack.enter_context(strategy.scope())
        # Entered inside the strategy scope: this creator runs before the strategy's own,
        # so the strategy wraps the variable with the aggregation set here.
        stack.enter_context(tf.variable_creator_scope(_seed_state_creator))
        yield


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
