"""Every built-in extension, declared once, in the run's default order.

An entry names the class (its `name`, `setting` and `supports`), how a run's settings make it
(None: the user adds it; the function checks the feature's own options before anything is built)
and the gin names bound for it. The factory (`participants`), the registry's known names, the
capability table and gin's names (trainer/configurables.py) are all read from `BUILT_IN`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import keras

from trainer.distribution import modes
from trainer.errors import UserError
from trainer.extensions.best_checkpoints import BestCheckpoints
from trainer.extensions.checkpointing import PeriodicCheckpoints
from trainer.extensions.config_writer import ConfigWriter, HParamsWriter
from trainer.extensions.data_position import DataPosition
from trainer.extensions.early_stopping import EarlyStop, EarlyStoppingOptions
from trainer.extensions.ema import Ema
from trainer.extensions.evaluation import PeriodicEval
from trainer.extensions.export import Export
from trainer.extensions.keras_callbacks import KerasCallbacks
from trainer.extensions.loss_scaling import LossScalingCheck
from trainer.extensions.mlflow_tracking import MlflowTracking
from trainer.extensions.monitoring import monitored
from trainer.extensions.nonfinite import MODES, NonFiniteHandling
from trainer.extensions.preemption import Preemption
from trainer.extensions.profiler import Profiler
from trainer.extensions.progress import ProgressLogger
from trainer.extensions.protocol import Extension
from trainer.extensions.run_lock import ModelDirClaim
from trainer.extensions.time_budget import TimeBudget
from trainer.extensions.train_metrics import TrainMetrics
from trainer.extensions.unsaved_state import UnsavedState
from trainer.extensions.update_check import UpdateCheck
from trainer.extensions.update_path import UpdatePath
from trainer.extensions.warm_start import WarmStart
from trainer.extensions.worker_watch import WorkerWatch
from trainer.extensions.worker_watch import make as worker_watch
from trainer.validation import check_bool, check_int

if TYPE_CHECKING:
    from trainer.run.settings import Settings


@dataclasses.dataclass(frozen=True)
class BuiltIn:
    """One built-in extension (see the module docstring)."""

    cls: type[Extension]
    make: Callable[["Settings"], Extension | None] | None = None  # None: the user adds it to train.extensions
    gin: Mapping[str, Callable] = dataclasses.field(default_factory=dict)  # gin name -> what it binds
    last: bool = False  # after the user's own extensions (the checkpoint)
    shown_as: Callable[[], Sequence[Extension]] | None = None  # the capability table's rows, where not the class's

    @property
    def name(self) -> str:
        return self.cls.name


def _best_checkpoints(settings: "Settings") -> BestCheckpoints | None:
    check_int("train.keep_best", settings.keep_best, minimum=0)
    metric = monitored("train.best_", settings.best_metric, settings.best_mode, settings.eval_split_names)
    return BestCheckpoints(settings.keep_best, metric) if settings.keep_best else None


def _early_stop(settings: "Settings") -> EarlyStop | None:
    options = settings.early_stopping
    if options is not None and not isinstance(options, EarlyStoppingOptions):
        raise UserError(f"train.early_stopping must be @early_stopping() or None, got {options!r}")
    return EarlyStop.of(options, settings.eval_split_names) if options is not None else None


def _preemption(settings: "Settings") -> Preemption:
    """Ctrl-C saves in every run; SIGTERM where `train.preemption_checkpointing` asks (True: exit 42 for a
    restart), and by default (None) in a run of one process, as Ctrl-C does; False: SIGTERM as the system has it."""
    if settings.preemption_checkpointing is not None:
        check_bool("train.preemption_checkpointing", settings.preemption_checkpointing)
    return Preemption(on_sigterm=settings.preemption_checkpointing)


def _turned_on(setting: str, cls: type[Extension], **kwargs: Any) -> Callable[["Settings"], Extension | None]:
    """The extension `cls(**kwargs)` where the boolean `train.<setting>` is True."""

    def make(settings: "Settings") -> Extension | None:
        check_bool(f"train.{setting}", getattr(settings, setting))
        return cls(**kwargs) if getattr(settings, setting) else None

    return make


def _train_metrics(settings: "Settings") -> TrainMetrics | None:
    """Before the progress logger, which shows the metrics' results it adds at each log interval."""
    reset = settings.train_metrics_reset
    if reset is None and settings.train_metrics_fn is not None:
        raise UserError(
            "train.train_metrics_fn is set but train.train_metrics_reset is None; set it to 'log' or 'epoch'"
        )
    return TrainMetrics(reset, settings.log_every_steps, settings.train_metrics_fn) if reset is not None else None


def _train_metrics_row() -> list[Extension]:
    """Its row in the capability table: refused under parameter_server where the model holds metrics."""
    row = TrainMetrics("log", 1)
    row.supports = modes.SYNCHRONOUS
    return [row]


BUILT_IN: tuple[BuiltIn, ...] = (
    BuiltIn(ModelDirClaim, lambda s: ModelDirClaim()),  # first: the claim comes before every other write
    BuiltIn(DataPosition, lambda s: DataPosition()),  # then its restart guarantee, among the run's first lines
    BuiltIn(TrainMetrics, _train_metrics, shown_as=_train_metrics_row),
    BuiltIn(ProgressLogger, lambda s: ProgressLogger(s.log_every_steps)),
    BuiltIn(PeriodicEval, lambda s: PeriodicEval(s.eval_every_steps)),
    BuiltIn(ConfigWriter, lambda s: ConfigWriter(s.describe_config) if s.describe_config is not None else None),
    BuiltIn(HParamsWriter, lambda s: HParamsWriter(dict(s.hparams)) if s.hparams else None),
    BuiltIn(
        NonFiniteHandling,
        lambda s: NonFiniteHandling(s.nonfinite, s.max_rollbacks, s.loss_upper_bound),
        shown_as=lambda: [*(NonFiniteHandling(mode) for mode in MODES), NonFiniteHandling(loss_upper_bound=1.0)],
    ),
    BuiltIn(UpdatePath, lambda s: UpdatePath(s.grad_accum_steps, s.clip_global_norm)),
    BuiltIn(UpdateCheck, lambda s: UpdateCheck()),
    BuiltIn(WarmStart, lambda s: WarmStart(s.warm_start) if s.warm_start is not None else None),
    BuiltIn(Ema, lambda s: Ema(s.ema_decay) if s.ema_decay is not None else None),
    BuiltIn(BestCheckpoints, _best_checkpoints),
    BuiltIn(EarlyStop, _early_stop, gin={"early_stopping": EarlyStoppingOptions}),
    BuiltIn(
        KerasCallbacks,
        # Anything but none (a list is a tuple by now) is made, and the extension checks it, once.
        lambda s: KerasCallbacks(s.keras_callbacks, s.eval_every_steps) if s.keras_callbacks != () else None,
        gin={  # under their Keras names
            f"keras.callbacks.{c.__name__}": c
            for c in (
                keras.callbacks.EarlyStopping,
                keras.callbacks.ReduceLROnPlateau,
                keras.callbacks.CSVLogger,
                keras.callbacks.TerminateOnNaN,
            )
        },
    ),
    BuiltIn(LossScalingCheck, _turned_on("check_loss_scaling", LossScalingCheck)),
    BuiltIn(Preemption, _preemption),
    BuiltIn(TimeBudget, lambda s: TimeBudget.of(s.max_time_secs)),
    BuiltIn(Export, _turned_on("export_saved_model", Export)),
    BuiltIn(MlflowTracking, gin={"mlflow_hook": MlflowTracking}),
    BuiltIn(Profiler, gin={"profiler_hook": Profiler}),
    BuiltIn(WorkerWatch, worker_watch),
    BuiltIn(
        UnsavedState, lambda s: UnsavedState()
    ),  # at the first loop call: written state no checkpoint holds  # on under the multi-worker strategies; gin: trainer/configurables.py
    BuiltIn(PeriodicCheckpoints, lambda s: PeriodicCheckpoints(s.checkpoint_every_steps), last=True),
)

NAMES = frozenset(entry.name for entry in BUILT_IN)
GIN_NAMES: dict[str, Callable] = {name: target for entry in BUILT_IN for name, target in entry.gin.items()}


def participants(settings: "Settings") -> list[Extension]:
    """Every extension a run of `settings` has, in the default order the registry starts from: the
    built-ins in the table's order, the user's `train.extensions` before the checkpoint."""
    made = {False: [], True: []}
    for entry in BUILT_IN:
        if entry.make is not None and (participant := entry.make(settings)) is not None:
            made[entry.last].append(participant)
    return [*made[False], *settings.extensions, *made[True]]
