"""`train.grad_accum_steps` (and the update for `train.clip_global_norm`): the step's update taken over.

`train.global_batch_size` stays the batch of ONE update: each replica's share is cut inside the step into K
micro-batches (memory, not a bigger batch), so the global step counts updates and resume is unchanged. The
user's step is called once per micro-batch with a recorder for an optimizer (trainer/update/recorder.py) and
the update's `global_batch_size`, so each micro-step's loss and gradients are its share of the update's
mean; the gradients are added locally and the real optimizer sums them across replicas once per update.
With `train.clip_global_norm` the loop sums and clips them itself (trainer/update/clipping.py) and adds a
`grad_norm` output (`grad_norm/<key>` per optimizer of a dict).

With K > 1: outputs are the micro-steps' sums (an output that is not a share comes out K times unless
declared "mean"/"max"/"min" with `trainer.combine`); BatchNormalization and dropout see K micro-batches
(so K micro-batches are bit-identical to one batch only without such layers); the micro-steps are traced
one after another, so one micro-batch's activations are live at a time; the step may call
`apply_gradients` once per optimizer and should not read a variable the update changes after calling it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import tensorflow as tf

from trainer.errors import UserError
from trainer.task import combine
from trainer.update import clipping
from trainer.update.recorder import GradientRecorder
from trainer.validation import check_int, check_number

NORM_KEY = "grad_norm"


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
    grad_accum_steps: int = 1
    clip_global_norm: float | None = None

    def __post_init__(self) -> None:
        check_int("train.grad_accum_steps", self.grad_accum_steps)
        check_number("train.clip_global_norm", self.clip_global_norm, optional=True)

    @property
    def takes_over(self) -> bool:
        return self.grad_accum_steps > 1 or self.clip_global_norm is not None

    def check_batch_size(self, global_batch_size: int, num_replicas: int) -> None:
        parts = self.grad_accum_steps * num_replicas
        if self.grad_accum_steps > 1 and global_batch_size % parts:
            raise UserError(
                f"train.global_batch_size {global_batch_size} is not divisible by train.grad_accum_steps "
                f"{self.grad_accum_steps} x {num_replicas} replica(s); use a multiple of {parts}"
            )


def micro_batches(batch: Any, k: int) -> list:
    """`batch` (any structure, batched on axis 0) as `k` equal consecutive slices."""
    sizes = {int(t.shape[0]) for t in tf.nest.flatten(batch) if t.shape.rank and t.shape[0] is not None}
    if len(sizes) > 1 or (sizes and next(iter(sizes)) % k):
        raise UserError(
            f"the per-replica batch (sizes {sorted(sizes)}) cannot be cut into train.grad_accum_steps "
            f"{k} equal micro-batches"
        )
    size = next(iter(sizes), None)

    def cut(t, i):
        n = size if size is not None else tf.shape(t)[0]
        return t[i * n // k : (i + 1) * n // k]

    return [tf.nest.map_structure(lambda t, i=i: cut(t, i), batch) for i in range(k)]


def update_step(step_fn: Callable, options: UpdateOptions) -> Callable:
    """`step_fn` with its update taken over as `options` says (the same function if nothing is)."""
    if not options.takes_over:
        return step_fn
    k, clip_norm = options.grad_accum_steps, options.clip_global_norm
    rule = combine.rule_of(step_fn)  # declared mean/max/min outputs: over the micro-steps as declared

    @functools.wraps(step_fn)
    def step(model, optimizer, batch, global_batch_size):
        optimizers = dict(optimizer) if isinstance(optimizer, Mapping) else {None: optimizer}
        totals, gradients, variables = None, None, None
        for micro in micro_batches(batch, k):
            if gradients is not None:  # one micro-batch at a time: the next waits for these gradients
                with tf.control_dependencies([g for gs in gradients.values() for g in gs if g is not None]):
                    micro = tf.nest.map_structure(tf.identity, micro)
            recorders = {key: GradientRecorder(o) for key, o in optimizers.items()}
            outputs = step_fn(
                model, recorders if isinstance(optimizer, Mapping) else recorders[None], micro, global_batch_size
            )
            if not isinstance(outputs, Mapping):
                raise UserError(
                    f"train.step_fn returned {type(outputs).__name__}; return a dict of scalar tensors, "
                    "e.g. {'loss': loss}"
                )
            recorded = {key: r.gradients for key, r in recorders.items() if r.calls}
            if totals is None:
                totals, gradients = dict(outputs), recorded
                variables = {key: r.variables for key, r in recorders.items() if r.calls}
            else:
                totals = combine.over_steps(rule, totals, {n: tf.cast(outputs[n], totals[n].dtype) for n in totals})
                gradients = {key: [_add(a, b) for a, b in zip(gradients[key], recorded[key])] for key in gradients}
        totals = {n: v / k if rule.get(n) == combine.MEAN else v for n, v in totals.items()}
        for key, grads in gradients.items():
            if clip_norm is not None:
                grads, norm = clipping.sum_and_clip(grads, clip_norm)
                name = NORM_KEY if key is None else f"{NORM_KEY}/{key}"
                if name in totals:
                    raise UserError(
                        f"train.step_fn returns {name!r}, the output train.clip_global_norm adds; rename it"
                    )
                replicas = tf.distribute.get_replica_context().num_replicas_in_sync
                totals[name] = norm / replicas  # a share: the loop's SUM over replicas gives the norm
            if pairs := [(g, v) for g, v in zip(grads, variables[key]) if g is not None]:
                optimizers[key].apply_gradients(pairs)
        return totals

    return step


def _add(a, b):
    if a is None or b is None:
        if (a is None) != (b is None):
            raise UserError(
                "train.step_fn gives a gradient for a variable in one micro-batch and None in another; "
                "train.grad_accum_steps needs the same variables trained by every micro-step"
            )
        return None
    return a + b


def prepare(
    options: UpdateOptions, optimizers: Any, *, num_replicas: int, global_batch_size: int, jit_compile: bool = False
) -> None:
    """Checks made once the task is built (before anything is written), and the sum taken over if clipping."""
    options.check_batch_size(global_batch_size, num_replicas)
    if options.clip_global_norm is not None and jit_compile and num_replicas > 1:
        raise UserError(
            "train.clip_global_norm with train.jit_compile works on one device only (its cross-replica "
            "sum cannot run inside the compiled step); set train.jit_compile = False or use strategy "
            "'default'/'one_device'"
        )
    clipping.check_keras_clipping(optimizers, num_replicas, options.clip_global_norm)
    if options.clip_global_norm is not None:
        clipping.take_over_gradient_sum(optimizers)
