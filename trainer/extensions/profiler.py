"""Traces a window of steps with TensorFlow's profiler, for TensorBoard's Profile tab:
`train.extensions = [@profiler_hook()]`, `profiler_hook.steps = (10, 20)`. Loop calls end exactly
at both steps, so the trace holds steps 11..20 only; the chief writes it under
`<model_dir>/plugins/profile/` (needs `pip install -e '.[profile]'`).
"""

from __future__ import annotations

import glob
import os

import tensorflow as tf

from trainer.errors import UserError
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension

PROFILE_SUBDIR = os.path.join("plugins", "profile")


class Profiler(Extension):
    """Traces the steps after `steps[0]` up to `steps[1]` (or the run's end), chief only."""

    name = "profiler"
    setting = "profiler_hook"

    def __init__(self, steps: tuple[int, int] = (10, 20)):
        try:
            start, stop = (int(s) for s in steps)
        except (TypeError, ValueError):
            raise UserError(f"profiler_hook.steps must be two steps (start, stop), got {steps!r}") from None
        if not 0 <= start < stop:
            raise UserError(f"profiler_hook.steps must satisfy 0 <= start < stop, got {tuple(steps)!r}")
        self.start, self.stop = start, stop
        self._active = False

    def steps_to_boundary(self, step: int) -> int | None:
        # Every worker ends its loop calls here, so collectives stay in step across workers.
        if step < self.start:
            return self.start - step
        if step < self.stop:
            return self.stop - step
        return None

    def begin(self, context: Context) -> None:
        if context.start_step >= self.stop:
            if context.runtime.is_chief:
                context.print(
                    f"profiler: the run starts at step {context.start_step}, after steps "
                    f"{self.start}-{self.stop}; nothing to trace"
                )
        elif context.start_step >= self.start:
            self._start(context, context.start_step)

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if step == self.start:
            self._start(context, step)
        elif step == self.stop:
            self._stop(context, step)

    def end(self, context: Context, step: int) -> None:
        self._stop(context, step)

    def _start(self, context: Context, step: int) -> None:
        if not context.runtime.is_chief or self._active:
            return
        try:
            tf.profiler.experimental.start(context.settings.model_dir)
        except (tf.errors.AlreadyExistsError, tf.errors.UnavailableError) as e:
            context.print(f"profiler: not tracing, another profiler session is running ({e.message})")
            return
        self._active, self._from = True, step

    def _stop(self, context: Context, step: int) -> None:
        if not self._active:
            return
        tf.profiler.experimental.stop()
        self._active = False
        context.print(
            f"profiler: traced steps {self._from + 1}-{step} into "
            f"{os.path.join(context.settings.model_dir, PROFILE_SUBDIR)} (TensorBoard's Profile tab)"
        )


def trace_files(model_dir: str) -> list[str]:
    """The profile traces of a run, where TensorBoard's profile plugin reads them."""
    return sorted(glob.glob(os.path.join(model_dir, PROFILE_SUBDIR, "*", "*.xplane.pb")))
