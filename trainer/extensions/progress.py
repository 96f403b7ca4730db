"""Progress: a live bar on a terminal, plain lines elsewhere, and a train record every N steps
(the outputs' means over the interval, learning rate, steps/s, examples/s) in the metrics log.
"""

from __future__ import annotations

import datetime
import sys
import time
from typing import IO

import keras

from trainer.extensions.console import LiveBar, is_terminal
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.extensions.train_metrics import LATEST
from trainer.task import combine
from trainer.validation import check_bool, check_number


def learning_rates(optimizers) -> dict[str, float]:
    """The rate the next step uses: `{"learning_rate": r}` of one optimizer, `{"learning_rate/<key>": r}`
    of a dict of them (a float, a schedule or a distributed variable; optimizers without one left out)."""
    named = optimizers.items() if isinstance(optimizers, dict) else [(None, optimizers)]
    return {
        ("learning_rate" if key is None else f"learning_rate/{key}"): float(keras.ops.convert_to_numpy(o.learning_rate))
        for key, o in named
        if hasattr(o, "learning_rate")
    }


def format_duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


class ProgressLogger(Extension):
    """Progress on stdout, and every `every_steps` steps a train record in the metrics log. On a terminal
    (or with `live`) the chief's bar redraws at most every `refresh_secs`, and on one process loop calls end
    about that often so it moves; elsewhere a plain line every N steps. Non-chief workers print only a
    finish line, unless `all_workers`."""

    name = "progress"

    def __init__(
        self,
        every_steps: int,
        *,
        live: bool | None = None,
        refresh_secs: float = 0.5,
        all_workers: bool = False,
        stream: IO[str] | None = None,
    ):
        check_bool("progress_logger.live", live, optional=True)
        check_number("progress_logger.refresh_secs", refresh_secs, strictly=False)
        check_bool("progress_logger.all_workers", all_workers)
        self.every_steps = every_steps
        self.live, self.refresh_secs, self.all_workers = live, refresh_secs, all_workers
        self._stream = stream
        self._sums: dict[str, float] = {}  # step-weighted sums; declared max/min outputs: their max/min
        self._extremes: set[str] = set()
        self._count = 0
        self._last_step = 0
        self._last_train_seconds = 0.0
        self._bar: LiveBar | None = None
        self._split = False  # may the driver cut loop calls short for the bar?
        self._chunk: int | None = None  # loop-call length that takes about refresh_secs
        self._call_step, self._call_train_seconds = 0, 0.0
        self._rate: float | None = None  # recent steps/s, without the first call (tracing)
        self._paced_from: tuple[int, float] | None = None  # (step, time) after the first call
        self._drawn_at = 0.0

    def begin(self, context: Context) -> None:
        self._last_step = self._call_step = context.start_step
        self._last_train_seconds = self._call_train_seconds = context.clock.train_seconds
        stream = self._stream or sys.stdout
        if context.runtime.is_chief and (is_terminal(stream) if self.live is None else self.live):
            self._bar = LiveBar(stream)
            context.console.show_live(self._bar)  # other lines print above the bar
            # Loop calls must stay alike on every worker (collectives), and a PS call schedules
            # closures: cut them short only for one synchronous worker.
            self._split = self.refresh_secs > 0 and not context.runtime.spans_processes
        if context.runtime.is_chief and context.start_step:
            context.print(f"starting at step {context.start_step}/{context.settings.total_steps}")

    def steps_to_boundary(self, step: int) -> int | None:
        to_log = super().steps_to_boundary(step)
        if self._chunk is None:
            return to_log
        return self._chunk if to_log is None else min(to_log, self._chunk)

    def rewind(self, context: Context, step: int) -> None:
        self._sums, self._count = {}, 0
        self._last_step = self._call_step = step
        self._last_train_seconds = self._call_train_seconds = context.clock.train_seconds

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        steps = step - self._last_step - self._count
        self._count += steps
        extremes = {
            k: kind for k, kind in getattr(context.loop, "rule", {}).items() if kind in (combine.MAX, combine.MIN)
        }
        latest = context.values.get(LATEST, frozenset())  # a train metric's result(): shown as it is at the boundary
        for k, v in metrics.items():
            if k in latest:
                self._sums[k] = v
            elif k in extremes:  # declared max/min: over the whole interval (trainer/task/combine.py)
                pick = max if extremes[k] == combine.MAX else min
                self._sums[k] = pick(self._sums[k], v) if k in self._sums else v
            else:
                self._sums[k] = self._sums.get(k, 0.0) + v * steps
        self._extremes = set(extremes) | set(latest)
        if self._bar is not None:
            self._update_bar(context, step)
        if self.at_boundary(step) or step >= context.settings.total_steps:
            self._flush(context, step)

    def _means(self) -> dict[str, float]:
        return {k: v if k in self._extremes else v / self._count for k, v in self._sums.items()}

    def _update_bar(self, context: Context, step: int) -> None:
        now = time.monotonic()
        call_seconds = context.clock.train_seconds - self._call_train_seconds
        steps = step - self._call_step  # not positive after a rewind
        rate = steps / call_seconds if steps > 0 and call_seconds > 0 else None
        if rate is not None and self._split:  # the first call's rate is low: safe for this
            self._chunk = max(1, int(rate * self.refresh_secs))
        if self._paced_from is None:  # the first call traced the step: no pace to show
            self._paced_from = (step, now)
        elif rate is not None:
            self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate
        self._call_step, self._call_train_seconds = step, context.clock.train_seconds
        if now - self._drawn_at < self.refresh_secs and step < context.settings.total_steps:
            return
        paced_step, paced_time = self._paced_from
        if step > paced_step:  # evals and checkpoints count, tracing does not
            eta = (context.settings.total_steps - step) * (now - paced_time) / (step - paced_step)
        else:
            eta = _eta_secs(context, step)
        means = self._means() if self._count else {}
        line = self._bar.render(
            step, context.settings.total_steps, means, steps_per_sec=self._rate, eta=format_duration(eta)
        )
        self._bar.draw(line)
        self._drawn_at = now

    def _flush(self, context: Context, step: int) -> None:
        if not self._count:
            return
        means = self._means()
        seconds = max(context.clock.train_seconds - self._last_train_seconds, 1e-9)
        steps_per_sec = self._count / seconds
        record = (
            means
            | learning_rates(context.task.optimizers)
            | {"steps_per_sec": steps_per_sec, "examples_per_sec": steps_per_sec * context.settings.global_batch_size}
        )
        context.metrics_log.record(step, "train", record)
        if self._bar is None and (context.runtime.is_chief or self.all_workers):
            shown = "  ".join(f"{k} {v:.4f}" for k, v in means.items())
            context.print(
                f"step {step}/{context.settings.total_steps}  {shown}  {steps_per_sec:.1f} steps/s  "
                f"{record['examples_per_sec']:.0f} ex/s  ETA {format_duration(_eta_secs(context, step))}"
            )
        self._sums, self._count = {}, 0
        self._last_step, self._last_train_seconds = step, context.clock.train_seconds

    def end(self, context: Context, step: int) -> None:
        self._flush(context, step)
        if self._bar is not None:
            self._bar.finish()
            context.console.hide_live()
            self._bar, self._chunk = None, None
        if not context.runtime.is_chief:
            context.print(f"finished at step {step}/{context.settings.total_steps}")


def _eta_secs(context: Context, step: int) -> float:
    """Wall time left at the run's average pace so far (evals and checkpoints included)."""
    done = step - context.start_step
    return (context.settings.total_steps - step) * (time.monotonic() - context.clock.start_time) / max(done, 1)
