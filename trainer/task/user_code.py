"""AutoGraph for the user's functions only, not for the framework's own graph code.

A step or eval step may branch or loop on tensors in Python (`if loss > 0:`, `for x in
tf.range(n):`), as in any `tf.function`: AutoGraph rewrites such code into graph control
flow. Converting the framework's own compiled code as well (the loops, the per-call sums,
the output checks, the built-in steps, the input pipeline's map functions) rewrites about 20
functions at every start for nothing: they are plain TF ops. Measured with trainer.bench's
MLP on 2 cores, that took 1.65 s of the 2.9 s from the end of imports to the first step;
Keras' `fit` pays none of it (AutoGraph never converts Keras). So the loops compile with
`autograph=False`, call the user's functions through `call_user` (which converts them, and
what they call, as `tf.function` would), and mark their own functions that `tf.data` or a
user's step may reach with `tf.autograph.experimental.do_not_convert`, the same public
marker a user can put on a step written in plain TF ops to skip its conversion too.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import tensorflow as tf

from trainer.task import contract


def _call(fn: Callable, *args, **kwargs) -> Any:
    return fn(*args, **kwargs)


@functools.cache
def _converting_call() -> Callable:
    """`_call` converted by AutoGraph (once per process): its call of `fn` converts `fn`, recursively."""
    return tf.autograph.to_graph(_call)


def call_user(fn: Callable, *args, **kwargs) -> Any:
    """`fn(*args, **kwargs)` with `fn` converted by AutoGraph, as a `tf.function` would convert it.

    Works in a function traced with `autograph=False` (the conversion turns AutoGraph on for
    `fn` and what it calls) and eagerly alike. A function marked with
    `tf.autograph.experimental.do_not_convert`, a `tf.function` and Keras code are called
    as they are, by AutoGraph's own rules.
    """
    return _converting_call()(fn, *args, **kwargs)


def placed(batch: Any) -> Any:
    """`batch` with each tensor passed through `tf.identity` in replica context, so that it is placed
    on this replica's device: a tensor that enters `strategy.run` from outside carries no device
    under MultiWorkerMirroredStrategy, and a cross-replica call on it in a step
    (`get_replica_context().all_gather(labels)`) then fails with "destinations can not be empty"."""
    return tf.nest.map_structure(tf.identity, batch)


def call_step(step_fn: Callable, model: Any, optimizer: Any, batch: Any, global_batch_size: int) -> Any:
    """The user's train step on `batch` (`placed`), in replica context, through `call_user`; each
    value goes to the parameter of its name, else of its position (trainer/task/contract.py)."""
    return call_user(contract.adapt(step_fn, contract.STEP), model, optimizer, placed(batch), global_batch_size)
