"""Hooks: what runs eagerly between compiled loop calls (progress, metrics, checkpoints, eval).

A hook with `every_steps = N` gets `after_loop` at every multiple of N; the driver shortens a
loop call so that it ends exactly on the nearest boundary of any hook, so intervals need not
be multiples of `steps_per_loop`. Users add their own with `train.hooks = [@MyHook()]`.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from typing import IO, Any, Callable

import keras
import tensorflow as tf

from trainer.files.metrics_log import MetricsLog
from trainer.hooks.live_bar import LiveBar, is_terminal
from trainer.files.model_dir import write_text_atomic
from trainer.validation import check_bool, check_int, check_number

OPERATIVE_CONFIG_FILE = "operative_config.gin"


@dataclasses.dataclass
class RunContext:
    """What a hook can see of the run; `train_seconds` counts time inside compiled train calls."""

    model_dir: str
    is_chief: bool
    total_steps: int
    start_step: int
    global_batch_size: int
    strategy: Any
    model: Any
    optimizer: Any
    saver: Any
    evaluators: Any  # {split: evaluator}, in the order the splits are evaluated
    metrics_log: MetricsLog
    print_fn: Callable[[str], None] = print
    train_seconds: float = 0.0
    start_time: float = dataclasses.field(default_factory=time.monotonic)
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)  # of the first eval split
    loop: Any = None  # the compiled train loop (e.g. its `trace_count`)
    hparams: dict[str, Any] = dataclasses.field(default_factory=dict)  # train(hparams=...): flat gin bindings
    eval_results: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)  # {split: last results}
    last_eval_step: int | None = None  # the step `eval_results` are of
    stop_requested: bool = False  # set by a hook (early stopping): the driver ends the run after this loop call


class Hook:
    """Base class; override what you need. `every_steps = 0`: no boundaries of its own."""

    every_steps: int = 0

    def begin(self, run: RunContext) -> None:
        pass

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        pass

    def end(self, run: RunContext, step: int) -> None:
        pass

    def rewind(self, run: RunContext, step: int) -> None:
        """Training went back to `step` (a roll-back after a non-finite loss)."""

    def steps_to_boundary(self, step: int) -> int | None:
        if self.every_steps <= 0:
            return None
        return self.every_steps - step % self.every_steps

    def at_boundary(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0


def current_learning_rate(optimizer) -> float:
    """The rate the next step uses, for a float, a schedule or a distributed variable."""
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def learning_rates(optimizers) -> dict[str, float]:
    """`{"learning_rate": r}` of one optimizer, `{"learning_rate/<key>": r}` of a dict of them
    (optimizers without a `learning_rate` are left out)."""
    named = optimizers.items() if isinstance(optimizers, dict) else [(None, optimizers)]
    return {("learning_rate" if key is None else f"learning_rate/{key}"): current_learning_rate(o)
            for key, o in named if hasattr(o, "learning_rate")}


def format_duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


class ProgressLogger(Hook):
    """Progress on stdout, and every N steps a train record in metrics (loss, ..., steps/s).

    On a terminal (the chief's stdout is a tty) a live bar (step/total, loss, steps/s, ETA)
    redraws in place after loop calls, at most every `refresh_secs`; on a single worker the
    driver also ends loop calls about every `refresh_secs` so the bar moves. Lines printed by
    other hooks (eval) appear above it. Elsewhere (CI, log files) a plain line every N steps.
    Non-chief workers print only a finish line (train prints the start), unless `all_workers`.

    Args:
      every_steps: steps between train records and plain lines (train.log_every_steps).
      live: True/False forces the bar on/off; None (default): on when stdout is a terminal.
      refresh_secs: least time between two redraws of the bar (0: after every loop call).
      all_workers: non-chief workers print plain progress lines too.
      stream: where the bar is drawn (default: sys.stdout).
    """

    def __init__(self, every_steps: int, *, live: bool | None = None, refresh_secs: float = 0.5,
                 all_workers: bool = False, stream: IO[str] | None = None):
        check_bool("progress_logger.live", live, optional=True)
        check_number("progress_logger.refresh_secs", refresh_secs, strictly=False)
        check_bool("progress_logger.all_workers", all_workers)
        self.every_steps = every_steps
        self.live, self.refresh_secs, self.all_workers = live, refresh_secs, all_workers
        self._stream = stream
        self._sums: dict[str, float] = {}
        self._count = 0
        self._last_step = 0
        self._last_train_seconds = 0.0
        self._bar: LiveBar | None = None
        self._print: Callable[[str], None] = print
        self._split = False  # may the driver cut loop calls short for the bar?
        self._chunk: int | None = None  # loop-call length that takes about refresh_secs
        self._call_step, self._call_train_seconds = 0, 0.0
        self._rate: float | None = None  # recent steps/s, without the first call (tracing)
        self._paced_from: tuple[int, float] | None = None  # (step, time) after the first call
        self._drawn_at = 0.0

    def begin(self, run: RunContext) -> None:
        self._last_step = self._call_step = run.start_step
        self._last_train_seconds = self._call_train_seconds = run.train_seconds
        stream = self._stream or sys.stdout
        if run.is_chief and (is_terminal(stream) if self.live is None else self.live):
            self._bar = LiveBar(stream)
            self._print, run.print_fn = run.print_fn, self._print_above_bar
            # Loop calls must stay alike on every worker (collectives), and a PS call schedules
            # closures: cut them short only for one synchronous worker.
            self._split = self.refresh_secs > 0 and not _multi_worker(run.strategy)
        if run.is_chief and run.start_step:
            run.print_fn(f"starting at step {run.start_step}/{run.total_steps}")

    def steps_to_boundary(self, step: int) -> int | None:
        to_log = super().steps_to_boundary(step)
        if self._chunk is None:
            return to_log
        return self._chunk if to_log is None else min(to_log, self._chunk)

    def rewind(self, run: RunContext, step: int) -> None:
        self._sums, self._count = {}, 0
        self._last_step = self._call_step = step
        self._last_train_seconds = self._call_train_seconds = run.train_seconds

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        steps = step - self._last_step - self._count
        self._count += steps
        for k, v in metrics.items():
            self._sums[k] = self._sums.get(k, 0.0) + v * steps
        if self._bar is not None:
            self._update_bar(run, step)
        if self.at_boundary(step) or step >= run.total_steps:
            self._flush(run, step)

    def _update_bar(self, run: RunContext, step: int) -> None:
        now = time.monotonic()
        call_seconds = run.train_seconds - self._call_train_seconds
        steps = step - self._call_step  # not positive after a rewind
        rate = steps / call_seconds if steps > 0 and call_seconds > 0 else None
        if rate is not None and self._split:  # the first call's rate is low: safe for this
            self._chunk = max(1, int(rate * self.refresh_secs))
        if self._paced_from is None:  # the first call traced the step: no pace to show
            self._paced_from = (step, now)
        elif rate is not None:
            self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate
        self._call_step, self._call_train_seconds = step, run.train_seconds
        if now - self._drawn_at < self.refresh_secs and step < run.total_steps:
            return
        paced_step, paced_time = self._paced_from
        if step > paced_step:  # evals and checkpoints count, tracing does not
            eta = (run.total_steps - step) * (now - paced_time) / (step - paced_step)
        else:
            eta = _eta_secs(run, step)
        means = {k: v / self._count for k, v in self._sums.items()} if self._count else {}
        line = self._bar.render(step, run.total_steps, means, steps_per_sec=self._rate,
                                eta=format_duration(eta))
        self._bar.draw(line)
        self._drawn_at = now

    def _print_above_bar(self, line: str) -> None:
        self._bar.clear()
        self._print(line)
        self._bar.redraw()

    def _flush(self, run: RunContext, step: int) -> None:
        if not self._count:
            return
        means = {k: v / self._count for k, v in self._sums.items()}
        seconds = max(run.train_seconds - self._last_train_seconds, 1e-9)
        steps_per_sec = self._count / seconds
        record = means | learning_rates(run.optimizer) | {
            "steps_per_sec": steps_per_sec,
            "examples_per_sec": steps_per_sec * run.global_batch_size,
        }
        run.metrics_log.record(step, "train", record)
        if self._bar is None and (run.is_chief or self.all_workers):
            shown = "  ".join(f"{k} {v:.4f}" for k, v in means.items())
            run.print_fn(
                f"step {step}/{run.total_steps}  {shown}  {steps_per_sec:.1f} steps/s  "
                f"{record['examples_per_sec']:.0f} ex/s  ETA {format_duration(_eta_secs(run, step))}"
            )
        self._sums, self._count = {}, 0
        self._last_step, self._last_train_seconds = step, run.train_seconds

    def end(self, run: RunContext, step: int) -> None:
        self._flush(run, step)
        if self._bar is not None:
            self._bar.finish()
            run.print_fn, self._bar, self._chunk = self._print, None, None
        if not run.is_chief:
            run.print_fn(f"finished at step {step}/{run.total_steps}")


def _eta_secs(run: RunContext, step: int) -> float:
    """Wall time left at the run's average pace so far (evals and checkpoints included)."""
    done = step - run.start_step
    return (run.total_steps - step) * (time.monotonic() - run.start_time) / max(done, 1)


def _multi_worker(strategy) -> bool:
    """True for strategies whose loop calls involve other processes (MWMS with >1 worker, PS)."""
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return True
    extended = getattr(strategy, "extended", None)
    in_multi_worker_mode = getattr(extended, "_in_multi_worker_mode", None)
    return bool(in_multi_worker_mode()) if callable(in_multi_worker_mode) else False


class CheckpointHook(Hook):
    """Saves every N steps and at the end; every worker takes part (see checkpoints.py)."""

    def __init__(self, every_steps: int):
        check_int("checkpoint_hook.every_steps", every_steps)
        self.every_steps = every_steps

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        if self.at_boundary(step) and step < run.total_steps:
            run.saver.save(step)

    def end(self, run: RunContext, step: int) -> None:
        if run.saver.last_saved_step != step:
            run.saver.save(step)
        run.saver.wait()  # an asynchronous write is complete before the export and the run's last line


class EvalHook(Hook):
    """Evaluates every eval split over all of its examples every N steps and at the end."""

    def __init__(self, every_steps: int):
        check_int("eval_hook.every_steps", every_steps)
        self.every_steps = every_steps
        self._last_step: int | None = None

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        if self.at_boundary(step):
            self._evaluate(run, step)

    def end(self, run: RunContext, step: int) -> None:
        if self._last_step != step:
            self._evaluate(run, step)

    def _evaluate(self, run: RunContext, step: int) -> None:
        results = evaluate_splits(run, step)
        run.last_eval = next(iter(results.values()), {})
        run.eval_results.update(results)
        self._last_step = run.last_eval_step = step


def evaluate_splits(run: RunContext, step: int, *, suffix: str = "", label: str = "") -> dict[str, dict[str, float]]:
    """Every eval split once, each recorded as split `<split><suffix>` and printed (chief);
    returns the results by split, without `num_examples`."""
    by_split = {}
    for split, evaluator in run.evaluators.items():
        results = evaluator.evaluate()
        num_examples = results.pop("num_examples")
        by_split[split] = results
        run.metrics_log.record(step, f"{split}{suffix}", results)
        if run.is_chief:
            shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items())
            where = "" if split == "eval" else f" on {split}"
            run.print_fn(f"eval{where}{label} at step {step}: {shown}  ({int(num_examples)} examples)")
    return by_split


class ConfigWriter(Hook):
    """Writes the operative config (chief): at start, so a crashed run still has it, and
    again after the first loop call, once tracing has called the step and its parameters
    are known. Also a text summary, so TensorBoard shows the config beside the curves."""

    def __init__(self, describe_config: Callable[[], str]):
        self._describe_config = describe_config
        self._complete = False

    def begin(self, run: RunContext) -> None:
        self._write(run)

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        if not self._complete:
            self._write(run)
            run.metrics_log.text(step, "operative_config", "```\n" + self._describe_config() + "\n```")
            self._complete = True

    def _write(self, run: RunContext) -> None:
        if run.is_chief:
            write_text_atomic(os.path.join(run.model_dir, OPERATIVE_CONFIG_FILE), self._describe_config())


class HParamsWriter(Hook):
    """Writes the run's hyperparameters (e.g. its flattened gin bindings) at start as a
    TensorBoard hparams summary (chief), so sibling run directories compare in the HParams tab."""

    def __init__(self, hparams: dict[str, bool | int | float | str]):
        self._hparams = dict(hparams)

    def begin(self, run: RunContext) -> None:
        run.metrics_log.hparams(self._hparams, trial_id=os.path.basename(os.path.normpath(run.model_dir)))
