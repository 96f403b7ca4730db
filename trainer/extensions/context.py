"""`Context`: the one object every stage of every extension gets, from `attach` to `close`.

It copies nothing: `settings`, `runtime` and `task` are reached through it. While the run is built
extensions contribute through it (checkpoint items, the update path, named values); from `begin` on
it holds the loop, evaluators, saver and metrics log, and what changes while training, each with
one writer. docs/extensions.md lists the names an extension author needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from trainer.errors import UserError
from trainer.extensions.console import Console
from trainer.files.metrics_log import eval_line, nonfinite_warning

if TYPE_CHECKING:
    from trainer.distribution.runtime import Runtime
    from trainer.files.checkpoints import CheckpointSaver
    from trainer.files.metrics_log import MetricsLog
    from trainer.run.settings import Settings
    from trainer.task.task import Task

StepFn = Callable[..., Mapping[str, Any]]


@dataclasses.dataclass
class Clock:
    """`train_seconds`: time inside compiled train calls; `start_time`: when training started (the
    controller sets it, so the time to build and trace the run is in neither)."""

    train_seconds: float = 0.0
    start_time: float = dataclasses.field(default_factory=time.monotonic)


class Evaluations:
    """The latest eval results, by split, and the step they are of (written by the eval extension)."""

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
class Contributions:
    """What the extensions add to the run while it is built (collected by the registry, which
    sets `owner` to the extension whose `attach` or `restored` runs, and None after)."""

    step_wrappers: list[Callable[[StepFn], StepFn]] = dataclasses.field(default_factory=list)
    after_update: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    providers: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped_batches: tuple[int, ...] = ()
    owner: str | None = None

    def wrap(self, step_fn: StepFn) -> StepFn:
        for wrapper in self.step_wrappers:
            step_fn = wrapper(step_fn)
        return step_fn

    def after_update_action(self) -> Callable[[], None] | None:
        actions = list(self.after_update)
        if not actions:
            return None

        def run_all() -> None:
            for action in actions:
                action()

        return run_all


class Context:
    """What an extension sees of the run (see the module docstring and docs/extensions.md)."""

    def __init__(self, settings: "Settings", runtime: "Runtime", task: "Task", contributions: Contributions):
        self.settings, self.runtime, self.task = settings, runtime, task
        self.console = Console(settings.print_fn)
        self._contributions = contributions
        self.start_step = 0
        # Set once the loops are built (from `begin` on); the saver already in `restored`.
        self.loop: Any = None  # the compiled train loop (e.g. its `trace_count`)
        self.evaluators: Mapping[str, Any] = {}  # {split: evaluator}, in order
        self.saver: "CheckpointSaver | None" = None
        self.metrics_log: "MetricsLog | None" = None
        self.evaluations = Evaluations()
        self.clock = Clock()
        self.stop_requested = False

    def print(self, line: str) -> None:
        """Prints `line` (above the progress bar)."""
        self.console.print(line)

    @property
    def values(self) -> Mapping[str, Any]:
        """The named values extensions provided (declare `after` the provider to read one in `attach`)."""
        return self._contributions.values

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The strategy's scope: create variables in it (they then live where the weights do)."""
        with self.runtime.strategy.scope():
            yield

    def add_checkpoint_item(self, key: str, trackable: Any) -> None:
        """Saves `trackable` (a tf.Module, a variable, ...) in every checkpoint as `key`; a resumed
        run must have it too (restored strictly, as the model is). In `attach`."""
        owner = self._owner("add_checkpoint_item", "attach")
        items = self.task.checkpoint_items
        if key in items:
            raise UserError(f"checkpoint item {key!r} exists already; {owner} must pick another key")
        items[key] = trackable

    def wrap_step(self, wrapper: Callable[[StepFn], StepFn]) -> None:
        """The update path: the train step the loop runs becomes `wrapper(step)` (in `after` order)."""
        self._owner("wrap_step")
        self._contributions.step_wrappers.append(wrapper)

    def after_update(self, action: Callable[[], None]) -> None:
        """`action()` runs inside the compiled loop after every step's update, in cross-replica
        context (read the updated weights there; assign to variables made under `scope()`)."""
        self._owner("after_update")
        self._contributions.after_update.append(action)

    def skip_batches(self, batches: Sequence[int]) -> None:
        """The loop's train data leaves out these batches (indices in the stream without skips)."""
        self._owner("skip_batches")
        self._contributions.skipped_batches = tuple(batches)

    def provide(self, name: str, value: Any) -> None:
        """Offers `value` to other extensions under `name` (they read `values[name]`)."""
        owner, providers = self._owner("provide"), self._contributions.providers
        if name in providers:
            raise UserError(
                f"{providers[name]} and {owner} both provide {name!r} (one run can use only one); turn one of them off"
            )
        providers[name] = owner
        self._contributions.values[name] = value

    def _owner(self, method: str, stages: str = "attach or restored") -> str:
        """The extension taking part now; refuses a contribution the run can no longer take (the
        checkpoint is made after `attach`, the loops after `restored`)."""
        if self._contributions.owner is None or (stages == "attach" and self.saver is not None):
            raise UserError(f"context.{method} works in an extension's {stages} only, where the run is built")
        return self._contributions.owner

    def request_stop(self) -> None:
        """Ends the run after the current loop call, on every worker alike (a final checkpoint and eval follow)."""
        self.stop_requested = True

    def evaluate(self, step: int, *, suffix: str = "", label: str = "") -> dict[str, dict[str, float]]:
        """Every eval split once, each recorded as split `<split><suffix>` and printed (chief);
        returns the results by split, without `num_examples`. Every worker must call it alike."""
        by_split = {}
        for split, evaluator in self.evaluators.items():
            results = evaluator.evaluate()
            num_examples = results.pop("num_examples")
            by_split[split] = results
            self.metrics_log.record(step, f"{split}{suffix}", results)
            if self.runtime.is_chief:
                self.print(eval_line(split, step, results, num_examples, label))
                if warning := nonfinite_warning(split + suffix, step, results):
                    self.print(warning)
        return by_split
