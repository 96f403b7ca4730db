"""Hooks and the run they see: what runs eagerly between compiled loop calls.

A hook with `every_steps = N` gets `after_loop` at every multiple of N; the controller shortens
a loop call so that it ends exactly on the nearest boundary of any hook, so intervals need not
be multiples of `steps_per_loop`. Users add their own with `train.hooks = [@MyHook()]`.

`Run` is what a hook sees: facts fixed for the run, the run's collaborators (loop, evaluators,
saver, metrics log), and three small objects for what changes while it trains, each with one
writer: the eval results (written by the eval hook, read through `evaluations.at(step)`), the
stop request (`request_stop`), and the clock. Lines go through `console`, under which the
progress bar keeps its place.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping

from trainer.distribution import modes
from trainer.files.metrics_log import eval_line


class Hook:
    """Base class of everything the controller calls between loop calls; override what you need.

    `every_steps = 0`: no boundaries of its own. `name` (empty: the class name, see `name_of`)
    identifies it in ordering constraints; `after` names the hooks or extensions that must run
    before it (at begin, after each loop call and at the end alike).
    """

    every_steps: int = 0
    name: str = ""
    after: tuple[str, ...] = ()

    def begin(self, run: "Run") -> None:
        """Before the first loop call (also on a resumed run, at `run.start_step`)."""

    def rollback_to(self, run: "Run", step: int, num_steps: int, metrics: Mapping[str, float]) -> int | None:
        """After the call of `num_steps` steps from `step`, before any `after_loop`: the step to
        roll back to if the call's results must be thrown away (None: keep them)."""
        return None

    def after_loop(self, run: "Run", step: int, metrics: dict[str, float]) -> None:
        """After each loop call that ended at `step`; `metrics`: the step outputs' means over it."""

    def end(self, run: "Run", step: int) -> None:
        """After the last loop call (also when a hook asked to stop early)."""

    def rewind(self, run: "Run", step: int) -> None:
        """Training went back to `step` (a roll-back after a non-finite loss)."""

    def close(self, run: "Run") -> None:
        """After the run however it ended (an error, an exit, after `end`): give back what `begin`
        took from the process (signal handlers), so a caller of `train` gets it back."""

    def steps_to_boundary(self, step: int) -> int | None:
        if self.every_steps <= 0:
            return None
        return self.every_steps - step % self.every_steps

    def at_boundary(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0


def name_of(hook: Hook) -> str:
    """The name a hook is known by: its `name`, else its class name."""
    return getattr(hook, "name", "") or type(hook).__name__


class Console:
    """Where the run's lines go. A live line (the progress bar) registered with `show_live` is
    cleared before each line and drawn again after it, so lines appear above it."""

    def __init__(self, print_fn: Callable[[str], None] = print):
        self._print_fn = print_fn
        self._live: Any = None  # has clear() and redraw()

    def print(self, line: str) -> None:
        if self._live is None:
            self._print_fn(line)
            return
        self._live.clear()
        self._print_fn(line)
        self._live.redraw()

    def show_live(self, live: Any) -> None:
        self._live = live

    def hide_live(self) -> None:
        self._live = None

    def close_live(self) -> None:
        """Blanks the live line for good: a run that ends early (Ctrl-C) ends on its last line."""
        if self._live is not None:
            self._live.clear()
            self._live = None


@dataclasses.dataclass
class Clock:
    """`train_seconds`: time inside compiled train calls; `start_time`: when the run started."""

    train_seconds: float = 0.0
    start_time: float = dataclasses.field(default_factory=time.monotonic)


class Evaluations:
    """The latest eval results, by split, and the step they are of (written by the eval hook)."""

    def __init__(self) -> None:
        self.latest: dict[str, dict[str, float]] = {}
        self.latest_step: int | None = None

    def record(self, step: int, results: Mapping[str, Mapping[str, float]]) -> None:
        self.latest.update({split: dict(values) for split, values in results.items()})
        self.latest_step = step

    def at(self, step: int) -> dict[str, dict[str, float]] | None:
        """The results by split if an eval ran at `step` (the latest one), else None."""
        return self.latest if self.latest_step == step else None

    @property
    def first_split(self) -> dict[str, float]:
        """The latest results of the first eval split (what `train` returns)."""
        return next(iter(self.latest.values()), {})


@dataclasses.dataclass
class StopRequest:
    """Set by a hook (early stopping, a Keras callback): the run ends after this loop call, on every worker."""

    requested: bool = False
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Run:
    """What a hook sees of the run (see the module docstring)."""

    model_dir: str
    is_chief: bool
    total_steps: int
    start_step: int
    global_batch_size: int
    model: Any
    optimizer: Any
    console: Console
    metrics_log: Any  # trainer.files.metrics_log.MetricsLog
    saver: Any = None  # trainer.files.checkpoints.CheckpointSaver
    strategy: Any = None
    mode: modes.Mode = modes.MODES["default"]
    spans_processes: bool = False  # loop calls involve other processes (several workers, or ps)
    task_name: str = "local"
    evaluators: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # {split: evaluator}, in order
    loop: Any = None  # the compiled train loop (e.g. its `trace_count`)
    hparams: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # flat gin bindings
    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # named values extensions provide
    clock: Clock = dataclasses.field(default_factory=Clock)
    evaluations: Evaluations = dataclasses.field(default_factory=Evaluations)
    stop: StopRequest = dataclasses.field(default_factory=StopRequest)

    @property
    def print_fn(self) -> Callable[[str], None]:
        return self.console.print

    @property
    def train_seconds(self) -> float:
        return self.clock.train_seconds

    @property
    def stop_requested(self) -> bool:
        return self.stop.requested

    def request_stop(self, reason: str) -> None:
        """Ends the run after the current loop call (a final checkpoint and eval follow)."""
        self.stop.requested, self.stop.reason = True, reason

    def evaluate(self, step: int, *, suffix: str = "", label: str = "") -> dict[str, dict[str, float]]:
        """Every eval split once, each recorded as split `<split><suffix>` and printed (chief);
        returns the results by split, without `num_examples`. Every worker must call it alike."""
        by_split = {}
        for split, evaluator in self.evaluators.items():
            results = evaluator.evaluate()
            num_examples = results.pop("num_examples")
            by_split[split] = results
            self.metrics_log.record(step, f"{split}{suffix}", results)
            if self.is_chief:
                self.console.print(eval_line(split, step, results, num_examples, label))
        return by_split
