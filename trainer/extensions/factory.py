"""The one factory: the flat `train.*` settings turned into the run's extensions.

Gin files keep their flat bindings (`train.ema_decay = 0.999`, `train.keep_best = 2`, ...);
here each becomes the extension that implements it, and `train.extensions` adds the user's own.
The list is in the default order the registry starts from: the core extensions that produce
what others read (progress, eval, the config), the other built-in ones, the user's, and the
checkpoint (the registry moves what runs after it).
"""

from __future__ import annotations

from trainer.errors import UserError
from trainer.extensions.best_checkpoints import BestCheckpoints
from trainer.extensions.checkpointing import CheckpointHook
from trainer.extensions.config_writer import ConfigWriter, HParamsWriter
from trainer.extensions.early_stopping import EarlyStop, EarlyStopping
from trainer.extensions.ema import Ema
from trainer.extensions.evaluation import EvalHook
from trainer.extensions.export import Export
from trainer.extensions.keras_callbacks import KerasCallbacks, check_callbacks
from trainer.extensions.loss_scaling import LossScalingCheck
from trainer.extensions.monitoring import monitored
from trainer.extensions.nonfinite import NonFiniteHandling
from trainer.extensions.preemption import Preemption
from trainer.extensions.progress import ProgressLogger
from trainer.extensions.protocol import Extension
from trainer.extensions.update_path import UpdatePath
from trainer.extensions.warm_start import WarmStart
from trainer.validation import check_bool, check_int


def participants(settings) -> list[Extension]:
    """Every extension a run of `settings` has, in the default order."""
    core = [ProgressLogger(settings.log_every_steps), EvalHook(settings.eval_every_steps)]
    if settings.describe_config is not None:
        core.append(ConfigWriter(settings.describe_config))
    if settings.hparams:
        core.append(HParamsWriter(dict(settings.hparams)))
    return [
        *core,
        *built_in(settings),
        *settings.extensions,
        CheckpointHook(settings.checkpoint_every_steps),
    ]


def built_in(settings) -> list[Extension]:
    """The built-in extensions the flat settings turn on, each checking its own options."""
    found: list[Extension] = [
        NonFiniteHandling(settings.nonfinite, settings.max_rollbacks),
        UpdatePath(settings.grad_accum_steps, settings.clip_global_norm),
    ]
    if settings.warm_start is not None:
        found.append(WarmStart(settings.warm_start))
    if settings.ema_decay is not None:
        found.append(Ema(settings.ema_decay))
    check_int("train.keep_best", settings.keep_best, minimum=0)
    best_metric = monitored("train.best_", settings.best_metric, settings.best_mode, settings.eval_split_names)
    if settings.keep_best:
        found.append(BestCheckpoints(settings.keep_best, best_metric))
    if settings.early_stopping is not None:
        if not isinstance(settings.early_stopping, EarlyStopping):
            raise UserError(f"train.early_stopping must be @early_stopping() or None, got {settings.early_stopping!r}")
        found.append(EarlyStop.of(settings.early_stopping, settings.eval_split_names))
    if check_callbacks(settings.keras_callbacks):
        found.append(KerasCallbacks(settings.keras_callbacks, settings.eval_every_steps))
    if settings.check_loss_scaling:
        found.append(LossScalingCheck())
    found.append(Preemption(on_sigterm=settings.preemption_checkpointing))  # Ctrl-C saves in every run
    check_bool("train.export_saved_model", settings.export_saved_model)
    if settings.export_saved_model:
        found.append(Export())
    return found
