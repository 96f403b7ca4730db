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
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import tensorflow as tf

from trainer.distribution import modes

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
        stack.enter_context(tf.variable_creator_scope(
            _state_creator(aggregating=modes.of(strategy).aggregates_variables)))
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
