"""`train.nonfinite`: what to do when a step's outputs, its gradients or the weights stop being
finite: stop, or roll back and skip the batch (the numerics: trainer/safety/nonfinite.py); and
`train.loss_upper_bound`: a loop call whose `loss` is above it is rolled back and its batches skipped.

Checked: the step's outputs (the loop's running sums), every update's gradients (a stand-in
optimizer makes the step's float outputs NaN where one was not finite), and the weights wherever
something is saved or evaluated. 'rollback' restores the newest checkpoint and trains on without
the offending batch. The loss bound watches the call's reduced `loss` (its mean over the call's
steps, the value logged), which cannot say which step spiked: the call's batches are all skipped.
Both count towards one bound, `max_rollbacks` roll-backs in a row (to the same checkpoint; one
newer resets the count). The skipped batches are checkpointed (a non-finite one in
`dropped_batches`, of fixed shape; those of a loss spike, a call's worth each, in this extension's
state), so a resumed run skips them too and stays identical to one that never stopped.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import tensorflow as tf

from trainer.distribution import modes
from trainer.errors import RunFailure, UserError
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension, Outputs
from trainer.loops.build import train_batches
from trainer.safety.nonfinite import (
    CAPACITY,
    all_finite,
    batch_index,
    checking_gradients,
    dropped_batches_variable,
    first_bad_step,
    read_dropped,
)
from trainer.task.structure import flat
from trainer.validation import check_choice, check_int, check_number

MODES = ("stop", "rollback")
LOSS = "loss"  # the train output the loss bound watches


class NonFiniteHandling(Extension):
    """Checks every loop call's outputs; stops, or rolls back past the offending batch (or call)."""

    name = "nonfinite"

    def __init__(self, mode: str = "stop", max_rollbacks: int = 3, loss_upper_bound: float | None = None):
        check_choice("train.nonfinite", mode, MODES)
        check_int("train.max_rollbacks", max_rollbacks, minimum=0, maximum=CAPACITY)
        check_number("train.loss_upper_bound", loss_upper_bound, minimum=None, optional=True)
        self.mode, self.max_rollbacks, self.loss_upper_bound = mode, max_rollbacks, loss_upper_bound
        self.rolls_back = mode == "rollback" or loss_upper_bound is not None
        bounded = loss_upper_bound is not None
        self.setting = "train.loss_upper_bound" if bounded else f"train.nonfinite = {mode!r}"
        self.supports = modes.SYNCHRONOUS if self.rolls_back else modes.ALL
        self.unsupported_reason = "asynchronous updates cannot be rolled back to one step"
        self.unsupported_fix = "" if bounded else "use 'stop'"
        self._streak: list[str] = []  # the roll-backs in a row to `_back_to`, each in a few words
        self._back_to: str | None = None
        self._nonfinite: list[int] = []  # batches skipped for a non-finite step (also in `dropped_batches`)
        self._spiked: list[int] = []  # batches skipped for a loss above the bound (the state)
        self._fresh = True

    @property
    def dropped(self) -> list[int]:
        """Every batch the train data leaves out (indices in the stream without skips)."""
        return sorted(set(self._nonfinite) | set(self._spiked))

    def state_dict(self) -> dict[str, Any] | None:
        return {"loss_spike_batches": self._spiked} if self.loss_upper_bound is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Also on a roll-back, restoring an older checkpoint: what this run skipped since stays skipped.
        self._spiked = sorted(set(self._spiked) | {int(i) for i in state.get("loss_spike_batches", [])})

    def attach(self, context: Context) -> None:
        inp = context.task.input
        if self.rolls_back and not inp.deterministic:
            raise UserError(
                f"{self.setting} needs a deterministic input function, and {inp!r} declares "
                "deterministic = False (a roll-back must find the offending batch again); "
                + ("unset it" if self.loss_upper_bound is not None else "use 'stop'")
            )
        with context.scope():
            self._variable = dropped_batches_variable()
        context.add_checkpoint_item("dropped_batches", self._variable)
        context.wrap_step(checking_gradients)
        weights = [v for m in flat(context.task.models) for v in getattr(m, "trainable_variables", ())]
        self._weights = weights
        self._weights_finite = tf.function(lambda: all_finite(weights), autograph=False)
        settings = context.settings
        self._check_every = sorted({settings.checkpoint_every_steps, settings.eval_every_steps})

    def restored(self, context: Context, path: str | None) -> None:
        self._fresh = path is None
        self._nonfinite = read_dropped(self._variable)
        context.skip_batches(self.dropped)

    def verify(self, outputs: Outputs) -> None:
        if self.loss_upper_bound is not None and LOSS not in outputs.train:
            raise UserError(
                f"train.loss_upper_bound bounds the train step's output {LOSS!r}, and train.step_fn returns "
                f"{sorted(outputs.train)}; return the loss as {LOSS!r} or unset train.loss_upper_bound"
            )

    def begin(self, context: Context) -> None:
        if self.rolls_back and self._fresh:
            context.saver.save(context.start_step)  # something to roll back to before the first periodic checkpoint

    def rollback_to(self, context: Context, step: int, num_steps: int, metrics: Mapping[str, float]) -> int | None:
        end = step + num_steps
        bad_step = first_bad_step(context.loop, metrics, step)
        if bad_step is not None:
            return self._nonfinite_step(context, bad_step, metrics)
        if self.loss_upper_bound is not None and metrics[LOSS] > self.loss_upper_bound:
            batches = [batch_index(s, self.dropped) for s in range(step + 1, end + 1)]
            loss = f"loss {metrics[LOSS]:.4g}"
            cause = f"{loss} > train.loss_upper_bound {self.loss_upper_bound:g} over steps {step + 1}-{end}"
            return self._roll_back(context, cause, f"{loss} in steps {step + 1}-{end}", batches, spike=True)
        if end >= context.settings.total_steps or any(end % every == 0 for every in self._check_every):
            self._check_weights(context, step, end)
        return None

    def _check_weights(self, context: Context, step: int, end: int) -> None:
        """Stops a run whose weights went non-finite with finite outputs and gradients (before they are saved)."""
        if not self._weights or bool(self._weights_finite()):
            return
        name = next(
            (getattr(v, "path", v.name) for v in self._weights if not np.all(np.isfinite(v.numpy()))), "a weight"
        )
        raise RunFailure(
            f"the weights are non-finite ({name}) after steps {step + 1}-{end}, whose outputs and "
            f"gradients were finite; stopped before saving them; {_last_good(context)}"
        )

    def _nonfinite_step(self, context: Context, bad_step: int, metrics: Mapping[str, float]) -> int:
        """Stops, or rolls back past the batch of `bad_step`; returns the step training continues from."""
        shown = ", ".join(f"{k} {v:g}" for k, v in metrics.items() if not math.isfinite(v)) or "non-finite output"
        cause = f"step {bad_step} gave a non-finite output or gradient ({shown})"
        if self.mode == "stop":
            raise RunFailure(f"{cause}; stopped; {_last_good(context)}")
        bad_batch = batch_index(bad_step, self.dropped)
        return self._roll_back(context, cause, f"step {bad_step} non-finite", [bad_batch], spike=False)

    def _roll_back(self, context: Context, cause: str, briefly: str, batches: list[int], *, spike: bool) -> int:
        """Restores the newest checkpoint and trains on from it without `batches` (a call's, for a
        loss `spike`; else a non-finite step's one); returns the step training continues from."""
        latest = context.saver.latest()
        if latest is None:
            raise RunFailure(f"{cause} and there is no checkpoint to roll back to")
        if latest != self._back_to:  # training got past a newer checkpoint: a new streak
            self._streak, self._back_to = [], latest
        self._streak.append(briefly)
        if len(self._streak) > self.max_rollbacks:
            raise RunFailure(
                f"{cause}; stopped: that would be roll-back {len(self._streak)} in a row "
                f"({'; '.join(self._streak)}), more than train.max_rollbacks {self.max_rollbacks}; "
                f"{_last_good(context)}"
            )
        path = context.saver.restore_latest(context.print)
        if path is None:
            raise RunFailure(f"{cause} and no checkpoint could be restored to roll back to")
        if spike:
            self._spiked = sorted(set(self._spiked) | set(batches))
            skipped = f"the {len(batches)} batches of those steps"
        else:
            self._nonfinite = sorted(set(self._nonfinite) | set(read_dropped(self._variable)) | set(batches))
            if len(self._nonfinite) > CAPACITY:
                raise RunFailure(f"more than {CAPACITY} batches skipped; stopped; {_last_good(context)}")
            skipped = f"batch {batches[0]}"
        self._variable.assign(self._nonfinite + [-1] * (CAPACITY - len(self._nonfinite)))
        restored_step = int(context.task.global_step.numpy())
        context.loop.set_dataset(
            train_batches(
                context.runtime.strategy,
                context.task.input,
                context.settings,
                skip_steps=restored_step,
                drop_batches=self.dropped,
            )
        )
        context.print(
            f"{cause}; rolled back to {path} (step {restored_step}) and skipping {skipped} "
            f"(roll-back {len(self._streak)} of at most {self.max_rollbacks} in a row)"
        )
        return restored_step


def _last_good(context: Context) -> str:
    latest = context.saver.latest()
    return f"the last good checkpoint is {latest}" if latest else "there is no checkpoint yet"
