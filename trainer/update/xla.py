"""`train.jit_compile`: the per-replica step compiled with XLA, where XLA can run it.

XLA cannot compile the loop (iterator ops) nor, under a multi-device strategy, the update inside the step
(measured under Mirrored: the compiled update reads replica 1's variables from device 0). So on one device
the whole step is one XLA function; elsewhere the step runs in XLA with a recorder for the optimizer, and the
real optimizer applies the gradients right after, in replica context (the step may then call
`apply_gradients` once, and read no variable the update changes after calling it).
"""

from __future__ import annotations

from typing import Callable, Mapping

import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.task.user_code import call_step
from trainer.update.recorder import GradientRecorder

ReplicaStep = Callable[[object], Mapping[str, tf.Tensor]]


def update_inside_xla(strategy: tf.distribute.Strategy) -> bool:
    return modes.of(strategy).one_device


def replica_step(
    strategy, step_fn: Callable, model, optimizer, global_batch_size: int, *, jit_compile: bool = False
) -> ReplicaStep:
    """`batch -> step outputs` for `strategy.run`, compiled with XLA if `jit_compile`."""

    def step(batch):
        return call_step(step_fn, model, optimizer, batch, global_batch_size)

    if not jit_compile:
        return step
    if update_inside_xla(strategy):
        return tf.function(step, jit_compile=True, autograph=False)  # the step: call_user
    if isinstance(optimizer, Mapping):
        raise UserError(
            "train.jit_compile with several optimizers works on one device only (under a multi-device "
            "strategy the update runs after the compiled step, for one optimizer); set "
            "train.jit_compile = False or use strategy 'default'/'one_device'"
        )

    def step_then_update(batch):
        recorder = GradientRecorder(optimizer)  # one per replica call: replicas trace in parallel threads

        @tf.function(jit_compile=True, autograph=False)
        def compiled(batch):
            return call_step(step_fn, model, recorder, batch, global_batch_size), recorder.gradients

        outputs, gradients = compiled(batch)
        if recorder.calls:
            optimizer.apply_gradients(zip(gradients, recorder.variables))
        return outputs

    return step_then_update
