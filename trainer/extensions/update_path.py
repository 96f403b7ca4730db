"""The update path as an extension: `train.grad_accum_steps` and `train.clip_global_norm` take the
step's optimizer update over (trainer/update/) by wrapping the step. Always part of a run: it also
refuses Keras' own clipping where it would clip each replica's gradients. Synchronous strategies
only: asynchronous ps updates have neither a sum over micro-batches nor a global norm across replicas.
"""

from __future__ import annotations

from trainer.distribution import modes
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.update import accumulation


class UpdatePath(Extension):
    """Gradient accumulation over micro-batches and/or clipping by the global norm after the sum."""

    name = "update_path"
    setting = "train.grad_accum_steps, train.clip_global_norm"  # the table's row; an instance names what it uses
    supports = modes.SYNCHRONOUS
    unsupported_reason = "asynchronous updates"

    def __init__(self, grad_accum_steps: int = 1, clip_global_norm: float | None = None):
        self.options = accumulation.UpdateOptions(grad_accum_steps=grad_accum_steps, clip_global_norm=clip_global_norm)
        if not self.options.takes_over:
            self.supports = modes.ALL  # only the check of Keras' clipping: everywhere
        turned_on = {
            "train.grad_accum_steps": grad_accum_steps != 1,
            "train.clip_global_norm": clip_global_norm is not None,
        }
        self.setting = " and ".join(name for name, on in turned_on.items() if on) or "train.grad_accum_steps"

    def attach(self, context: Context) -> None:
        accumulation.prepare(
            self.options,
            context.task.optimizers,
            num_replicas=context.runtime.num_replicas,
            global_batch_size=context.settings.global_batch_size,
            jit_compile=context.settings.jit_compile,
        )
        if self.options.takes_over:
            context.wrap_step(lambda step_fn: accumulation.update_step(step_fn, self.options))
