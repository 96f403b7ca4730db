"""Hooks: what runs eagerly between compiled loop calls (progress, metrics, checkpoints, eval).

A hook with `every_steps = N` gets `after_loop` at every multiple of N; the driver shortens a
loop call so that it ends exactly on the nearest boundary of any hook, so intervals need not
be multiples of `steps_per_loop`. Users add their own with `train.hooks = [@MyHook()]`.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
from typing import Any, Callable

import keras

from trainer.metrics_log import MetricsLog
from trainer.run_files import write_text_atomic

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
    evaluator: Any
    metrics_log: MetricsLog
    print_fn: Callable[[str], None] = print
    train_seconds: float = 0.0
    start_time: float = dataclasses.field(default_factory=time.monotonic)
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    loop: Any = None  # the compiled train loop (e.g. its `trace_count`)


class Hook:
    """Base class; override what you need. `every_steps = 0`: no boundaries of its own."""

    every_steps: int = 0

    def begin(self, run: RunContext) -> None:
        pass

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        pass

    def end(self, run: RunContext, step: int) -> None:
        pass

    def steps_to_boundary(self, step: int) -> int | None:
        if self.every_steps <= 0:
            return None
        return self.every_steps - step % self.every_steps

    def at_boundary(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0


def current_learning_rate(optimizer) -> float:
    """The rate the next step uses, for a float, a schedule or a distributed variable."""
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def format_duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


class ProgressLogger(Hook):
    """Every N steps: a progress line (step, loss, steps/s, ETA) and a train record in metrics."""

    def __init__(self, every_steps: int):
        self.every_steps = every_steps
        self._sums: dict[str, float] = {}
        self._count = 0
        self._last_step = 0
        self._last_train_seconds = 0.0

    def begin(self, run: RunContext) -> None:
        self._last_step = run.start_step
        self._last_train_seconds = run.train_seconds
        if not run.is_chief or run.start_step:
            run.print_fn(f"starting at step {run.start_step}/{run.total_steps}")

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        steps = step - self._last_step - self._count
        self._count += steps
        for k, v in metrics.items():
            self._sums[k] = self._sums.get(k, 0.0) + v * steps
        if self.at_boundary(step) or step >= run.total_steps:
            self._flush(run, step)

    def _flush(self, run: RunContext, step: int) -> None:
        if not self._count:
            return
        means = {k: v / self._count for k, v in self._sums.items()}
        seconds = max(run.train_seconds - self._last_train_seconds, 1e-9)
        steps_per_sec = self._count / seconds
        record = means | {
            "learning_rate": current_learning_rate(run.optimizer),
            "steps_per_sec": steps_per_sec,
            "examples_per_sec": steps_per_sec * run.global_batch_size,
        }
        run.metrics_log.record(step, "train", record)
        if run.is_chief:
            wall = time.monotonic() - run.start_time
            done = step - run.start_step
            eta = (run.total_steps - step) * wall / max(done, 1)
            shown = "  ".join(f"{k} {v:.4f}" for k, v in means.items())
            run.print_fn(
                f"step {step}/{run.total_steps}  {shown}  {steps_per_sec:.1f} steps/s  "
                f"{record['examples_per_sec']:.0f} ex/s  ETA {format_duration(eta)}"
            )
        self._sums, self._count = {}, 0
        self._last_step, self._last_train_seconds = step, run.train_seconds

    def end(self, run: RunContext, step: int) -> None:
        self._flush(run, step)
        if not run.is_chief:
            run.print_fn(f"finished at step {step}/{run.total_steps}")


class CheckpointHook(Hook):
    """Saves every N steps and at the end; every worker takes part (see checkpoints.py)."""

    def __init__(self, every_steps: int):
        self.every_steps = every_steps

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        if self.at_boundary(step) and step < run.total_steps:
            run.saver.save(step)

    def end(self, run: RunContext, step: int) -> None:
        if run.saver.last_saved_step != step:
            run.saver.save(step)


class EvalHook(Hook):
    """Evaluates over the whole eval set every N steps and at the end."""

    def __init__(self, every_steps: int):
        self.every_steps = every_steps
        self._last_step: int | None = None

    def after_loop(self, run: RunContext, step: int, metrics: dict[str, float]) -> None:
        if self.at_boundary(step):
            self._evaluate(run, step)

    def end(self, run: RunContext, step: int) -> None:
        if self._last_step != step:
            self._evaluate(run, step)

    def _evaluate(self, run: RunContext, step: int) -> None:
        results = run.evaluator.evaluate()
        num_examples = results.pop("num_examples")
        run.last_eval = results
        run.metrics_log.record(step, "eval", results)
        if run.is_chief:
            shown = "  ".join(f"{k} {v:.4f}" for k, v in results.items())
            run.print_fn(f"eval at step {step}: {shown}  ({int(num_examples)} examples)")
        self._last_step = step


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
