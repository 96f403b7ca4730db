"""The extension protocol: one way in for every optional feature, built in or a researcher's own.

An extension is a hook (it gets `begin`, `after_loop`, `end`, `rewind`, `rollback_to` between
loop calls, and may set `every_steps`) with powers over the run's setup. It declares

  name        how messages and other extensions' `after` name it ('ema', 'swa');
  setting     how the user turned it on, for messages (e.g. 'train.ema_decay'; default: `name`);
  supports    the strategies it works under (`modes.ALL`, `modes.SYNCHRONOUS`, or
              `modes.support([...], "...")`), checked for every extension in one place
              (trainer/extensions/registry.py) before anything is built, with one wording;
  after       the names of extensions or hooks it must run after, in every stage below.

and may implement, in the order a run calls them:

  check(settings)         refuse settings it cannot work with (UserError), before any TensorFlow
                          op or write;
  attach(setup)           the runtime and the task are built, nothing restored yet: add
                          checkpoint items, wrap the update path, add an action after each
                          update, skip batches of the train data, provide named values to
                          other extensions (see `Setup`);
  restored(setup, path)   the newest checkpoint was restored (`path`; None for a fresh run);
  verify(outputs)         the loops are traced: check the step's and eval's output names;
  state_dict()            JSON-able state of its own, saved in every checkpoint of the run and
  load_state_dict(state)  given back on restore, so a resumed run decides as an uninterrupted one.

The built-in features (EMA, export, warm start, best checkpoints, early stopping, Keras
callbacks, MLflow, the profiler, preemption checkpointing, non-finite handling, gradient
accumulation and clipping, the loss-scaling check) are extensions of exactly this kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.hooks.base import Hook, name_of

if TYPE_CHECKING:
    from trainer.distribution.runtime import Runtime
    from trainer.run.settings import Settings
    from trainer.task.task import Task

StepFn = Callable[..., Mapping[str, Any]]


class Extension(Hook):
    """Base class of every extension; override what you need (see the module docstring)."""

    supports: modes.Support = modes.ALL
    setting: str = ""
    unsupported_reason: str = ""  # why not under the other strategies, said in the refusal
    unsupported_fix: str = ""  # what to do instead (default: unset it)

    def check(self, settings: "Settings") -> None:
        """Refuse settings this extension cannot work with (a UserError line); no TensorFlow here."""

    def attach(self, setup: "Setup") -> None:
        """Take part in the built run (see `Setup`); called under no strategy scope."""

    def restored(self, setup: "Setup", path: str | None) -> None:
        """After the restore: `path` is the checkpoint restored, None for a fresh run."""

    def verify(self, outputs: "Outputs") -> None:
        """After the loops are traced and before anything is written: check output names."""

    def state_dict(self) -> dict[str, Any] | None:
        """This extension's own state, JSON-able, saved in every checkpoint (None: it keeps none)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The state `state_dict` returned, read back from the checkpoint being restored."""


PROTOCOL_METHODS = frozenset(
    name for name in dir(Extension) if not name.startswith("_") and callable(getattr(Extension, name))
)
# What a near miss is: difflib's ratio at least this (`atach` 0.91, `restore` 0.93), of a method
# name of at least 4 letters (`send` is no typo of `end`).
NEAR_MISS_RATIO = 0.85
_MISSABLE = sorted(name for name in PROTOCOL_METHODS if len(name) >= 4)


def check_method_names(participants: Sequence[Hook]) -> None:
    """Refuses a hook or extension with a public method whose name is a near miss of a protocol
    method it does not define (`atach` for `attach`): the run would never call it, and the
    feature would fail later, far from the typo (an AttributeError after model_dir was written)."""
    for participant in participants:
        cls = type(participant)
        own = {name for klass in cls.__mro__ if klass not in (Extension, Hook, object) for name in vars(klass)}
        for name in sorted(own):
            if name.startswith("_") or name in PROTOCOL_METHODS or not callable(getattr(cls, name, None)):
                continue
            close = [m for m in difflib.get_close_matches(name, _MISSABLE, n=3, cutoff=NEAR_MISS_RATIO) if m not in own]
            if close:
                raise UserError(
                    f"{cls.__name__}.{name} is not a method of the hook and extension protocol, and "
                    f"the run never calls it; did you mean {close[0]}? (rename it; a helper of its own "
                    "starts with _)"
                )


def setting_of(extension: Extension) -> str:
    """How the user turned `extension` on, for messages."""
    return extension.setting or f"{name_of(extension)} (train.extensions)"


@dataclasses.dataclass(frozen=True)
class Outputs:
    """The names a traced run produces: the train step's outputs and, by eval split, the eval
    results (the eval step's per-example means and the eval metrics' results)."""

    train: tuple[str, ...]
    eval: Mapping[str, tuple[str, ...]]


class Setup:
    """What `attach` and `restored` get: the built runtime and task, and the ways to take part.

    One per extension, so that the registry knows who provided what.
    """

    def __init__(
        self,
        extension: Extension,
        settings: "Settings",
        runtime: "Runtime",
        task: "Task",
        contributions: "Contributions",
        print_fn: Callable[[str], None],
    ):
        self._extension = extension
        self.settings, self.runtime, self.task = settings, runtime, task
        self._contributions = contributions
        self.print = print_fn

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The strategy's scope: create variables in it (they then live where the weights do)."""
        with self.runtime.strategy.scope():
            yield

    def add_checkpoint_item(self, key: str, trackable: Any) -> None:
        """Saves `trackable` (a tf.Module, a variable, ...) in every checkpoint as `key`; a resumed
        run must have it too (restored strictly, as the model is)."""
        items = self.task.checkpoint_items
        if key in items:
            raise ValueError(
                f"checkpoint item {key!r} exists already; {name_of(self._extension)} must pick another key"
            )
        items[key] = trackable

    def wrap_step(self, wrapper: Callable[[StepFn], StepFn]) -> None:
        """The update path: the train step the loop runs becomes `wrapper(step)` (in `after` order)."""
        self._contributions.step_wrappers.append(wrapper)

    def after_update(self, action: Callable[[], None]) -> None:
        """`action()` runs inside the compiled loop after every step's update, in cross-replica
        context (read the updated weights there; assign to variables made under `scope()`)."""
        self._contributions.after_update.append(action)

    def skip_batches(self, batches: Sequence[int]) -> None:
        """The loop's train data leaves out these batches (indices in the stream without skips)."""
        self._contributions.skipped_batches = tuple(batches)

    def provide(self, name: str, value: Any) -> None:
        """Offers `value` to other extensions and hooks under `name` (`Setup.value`, `run.values`)."""
        owners = self._contributions.providers
        if name in owners:
            raise UserError(
                f"{owners[name]} and {name_of(self._extension)} both provide {name!r} (one run can use "
                f"only one); turn one of them off"
            )
        owners[name] = name_of(self._extension)
        self._contributions.values[name] = value

    def value(self, name: str, default: Any = None) -> Any:
        """A value another extension provided (declare `after` it), or `default`."""
        return self._contributions.values.get(name, default)


@dataclasses.dataclass
class Contributions:
    """What the extensions added to the run while attaching (collected by the registry)."""

    step_wrappers: list[Callable[[StepFn], StepFn]] = dataclasses.field(default_factory=list)
    after_update: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    providers: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped_batches: tuple[int, ...] = ()

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
