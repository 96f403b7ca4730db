"""`train.jit_compile`: the per-replica step compiled with XLA, where XLA can run it.

XLA cannot compile the whole loop (iterator ops) nor, under a multi-device strategy, the
optimizer update inside the step (measured on CPU with MirroredStrategy: the compiled
update reads replica 1's variables from device 0 and fails). So:

- one device (the default strategy, OneDeviceStrategy): the whole step, update included,
  is one XLA function;
- any other strategy: the step runs in XLA with a stand-in optimizer that only records the
  gradients handed to `apply_gradients`; the real optimizer then applies them right after,
  outside XLA but still in replica context (so the cross-replica gradient sum is TF's).
  The step contract is unchanged, with two limits: the step calls `apply_gradients` (or
  `apply`) at most once, and reads no variable the update changes after calling it.
"""
from __future__ import annotations

from typing import Callable, Mapping

import tensorflow as tf

from trainer.task.user_code import call_user
from trainer.errors import UserError

ReplicaStep = Callable[[object], Mapping[str, tf.Tensor]]


def update_inside_xla(strategy: tf.distribute.Strategy) -> bool:
    """True where the optimizer update may be compiled with the step (no cross-device sum)."""
    default = not tf.distribute.has_strategy() and strategy is tf.distribute.get_strategy()
    return default or isinstance(strategy, tf.distribute.OneDeviceStrategy)


def replica_step(strategy, step_fn: Callable, model, optimizer, global_batch_size: int, *,
                 jit_compile: bool = False) -> ReplicaStep:
    """`batch -> step outputs` for `strategy.run`, compiled with XLA if `jit_compile`."""

    def step(batch):
        return call_user(step_fn, model, optimizer, batch, global_batch_size)

    if not jit_compile:
        return step
    if update_inside_xla(strategy):
        return tf.function(step, jit_compile=True, autograph=False)  # the step: call_user
    if isinstance(optimizer, Mapping):
        raise UserError("train.jit_compile with several optimizers works on one device only (under a multi-device "
                        "strategy the update runs after the compiled step, for one optimizer); set "
                        "train.jit_compile = False or use strategy 'default'/'one_device'")

    def step_then_update(batch):
        recorder = _GradientRecorder(optimizer)  # one per replica call: replicas trace in parallel threads

        @tf.function(jit_compile=True, autograph=False)
        def compiled(batch):
            return call_user(step_fn, model, recorder, batch, global_batch_size), recorder.gradients

        outputs, gradients = compiled(batch)
        if recorder.calls:
            optimizer.apply_gradients(zip(gradients, recorder.variables))
        return outputs

    return step_then_update


class _GradientRecorder:
    """The optimizer as the compiled step sees it: `apply_gradients`/`apply` only record."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.gradients: list = []
        self.variables: list = []
        self.calls = 0

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        return self._record([g for g, _ in grads_and_vars], [v for _, v in grads_and_vars])

    def apply(self, grads, trainable_variables=None, *args, **kwargs):
        variables = trainable_variables if trainable_variables is not None else self._optimizer._trainable_variables
        return self._record(list(grads), list(variables))

    def _record(self, gradients, variables):
        self.calls += 1
        if self.calls > 1:
            raise ValueError("the optimizer update runs after the step here (train.jit_compile under a multi-device "
                             "strategy, train.grad_accum_steps, train.clip_global_norm), so the step may call "
                             "apply_gradients only once per optimizer; unset those options for this step")
        self.gradients = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in gradients]
        self.variables = variables
        return self._optimizer.iterations

    def __getattr__(self, name):
        return getattr(self._optimizer, name)
