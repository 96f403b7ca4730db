"""Traces a window of steps with TensorFlow's profiler, for TensorBoard's Profile tab:
`train.extensions = [@profiler_hook()]`, `profiler_hook.steps = (10, 20)`. Loop calls end exactly
at both steps, so the trace holds steps 11..20 only; the chief writes it under
`<model_dir>/plugins/profile/` (needs `pip install -e '.[profile]'`). With `profiler_hook.all_workers =
True` every worker traces the same window, each under `<model_dir>/profile/<task>/plugins/profile/`
(`worker1`: a TensorBoard run each): a MultiWorkerMirrored worker traces itself; parameter-server
workers are plain TensorFlow servers, whose gRPC server answers the profiler's remote trace, so the
chief traces each of them from the window's first step for the time the window should take at the
run's measured rate (their steps are asynchronous: a step window is a time window there).
"""

from __future__ import annotations

import glob
import os
import threading
import time

import tensorflow as tf

from trainer.errors import UserError, error_line
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.validation import check_bool

PROFILE_SUBDIR = os.path.join("plugins", "profile")
WORKERS_SUBDIR = "profile"  # with all_workers: <model_dir>/profile/<task> (worker0, worker1, ...)


class Profiler(Extension):
    """Traces the steps after `steps[0]` up to `steps[1]` (or the run's end): on the chief, or with
    `all_workers` on every worker."""

    name = "profiler"
    setting = "profiler_hook"

    def __init__(self, steps: tuple[int, int] = (10, 20), all_workers: bool = False):
        check_bool("profiler_hook.all_workers", all_workers)
        try:
            start, stop = (int(s) for s in steps)
        except (TypeError, ValueError):
            raise UserError(f"profiler_hook.steps must be two steps (start, stop), got {steps!r}") from None
        if not 0 <= start < stop:
            raise UserError(f"profiler_hook.steps must satisfy 0 <= start < stop, got {tuple(steps)!r}")
        self.start, self.stop, self.all_workers = start, stop, all_workers
        self._active = False
        self._remote: list[threading.Thread] = []  # traces of parameter-server workers, one thread each

    def steps_to_boundary(self, step: int) -> int | None:
        # Every worker ends its loop calls here, so collectives stay in step across workers.
        if step < self.start:
            return self.start - step
        if step < self.stop:
            return self.stop - step
        return None

    def begin(self, context: Context) -> None:
        self._began = time.monotonic()
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

    def _logdir(self, context: Context) -> str | None:
        """Where this process writes its trace (None: it traces nothing)."""
        if self.all_workers:
            return os.path.join(context.settings.model_dir, WORKERS_SUBDIR, context.runtime.cluster.task_name)
        return context.settings.model_dir if context.runtime.is_chief else None

    def _start(self, context: Context, step: int) -> None:
        if (logdir := self._logdir(context)) is None or self._active:
            return
        try:
            tf.profiler.experimental.start(logdir)
        except (tf.errors.AlreadyExistsError, tf.errors.UnavailableError) as e:
            context.print(f"profiler: not tracing, another profiler session is running ({e.message})")
            return
        self._active, self._from = True, step
        if self.all_workers and context.settings.mode.coordinates_workers:
            self._trace_workers(context, step)

    def _trace_workers(self, context: Context, step: int) -> None:
        """Each parameter-server worker traced remotely for the window's expected length (the seconds per
        step so far, from the start of the run: tracing included, so rather longer than shorter)."""
        done = step - context.start_step
        seconds = (time.monotonic() - self._began) / done * (self.stop - step) if done else 2.0
        milliseconds = max(1000, int(seconds * 1000))
        root = os.path.join(context.settings.model_dir, WORKERS_SUBDIR)

        def trace(index: int, address: str) -> None:
            logdir = os.path.join(root, f"worker{index}")
            try:
                tf.profiler.experimental.client.trace(f"grpc://{address}", logdir, milliseconds)
                context.print(
                    f"profiler: traced worker {index} for {milliseconds} ms from step {step} into "
                    f"{os.path.join(logdir, PROFILE_SUBDIR)}"
                )
            except (tf.errors.OpError, ValueError) as e:
                context.print(f"profiler: could not trace worker {index} at {address} ({error_line(e)})")

        addresses = context.runtime.cluster.cluster.get("worker", [])
        self._remote = [threading.Thread(target=trace, args=item, daemon=True) for item in enumerate(addresses)]
        for thread in self._remote:
            thread.start()

    def _stop(self, context: Context, step: int) -> None:
        if not self._active:
            return
        tf.profiler.experimental.stop()
        self._active = False
        for thread in self._remote:  # their traces end on their own clock
            thread.join()
        self._remote = []
        context.print(
            f"profiler: traced steps {self._from + 1}-{step} into "
            f"{os.path.join(self._logdir(context), PROFILE_SUBDIR)} (TensorBoard's Profile tab)"
        )


def trace_files(model_dir: str, task: str | None = None) -> list[str]:
    """The profile traces of a run (of one task's, `worker1`, traced with `all_workers`), where
    TensorBoard's profile plugin reads them."""
    if task is not None:
        model_dir = os.path.join(model_dir, WORKERS_SUBDIR, task)
    return sorted(glob.glob(os.path.join(model_dir, PROFILE_SUBDIR, "*", "*.xplane.pb")))
