"""`train.check_loss_scaling`: the loss-scaling probe (trainer/safety/loss_scaling.py) run after
the loops are traced and before anything is written, on the user's own step (before any
update-path wrapper)."""

from __future__ import annotations

from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension, Outputs
from trainer.safety.loss_scaling import check_loss_scaling


class LossScalingCheck(Extension):
    """Refuses a step that trains differently on N replicas than on one, before step 1."""

    name = "loss_scaling"
    setting = "train.check_loss_scaling"

    def attach(self, context: Context) -> None:
        self._context = context

    def verify(self, outputs: Outputs) -> None:
        context = self._context
        check_loss_scaling(
            context.runtime.strategy,
            context.task.models,
            context.task.optimizers,
            context.task.step_fn,
            context.task.input,
            global_batch_size=context.settings.global_batch_size,
            seed=context.settings.seed,
            print_fn=context.print,
        )
