"""What a run records about itself at start: the operative config (file and TensorBoard text) and
the hyperparameters (TensorBoard's HParams tab), written by the chief."""

from __future__ import annotations

import os
from typing import Callable

from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.files.atomic import write_text_atomic

OPERATIVE_CONFIG_FILE = "operative_config.gin"


class ConfigWriter(Extension):
    """Writes the operative config (chief) at start, so a crashed run has it, and after the first loop
    call, once tracing has called the step, also as TensorBoard text."""

    name = "config"

    def __init__(self, describe_config: Callable[[], str]):
        self._describe_config = describe_config
        self._complete = False

    def begin(self, context: Context) -> None:
        self._write(context)

    def after_loop(self, context: Context, step: int, metrics: dict[str, float]) -> None:
        if not self._complete:
            self._write(context)
            context.metrics_log.text(step, "operative_config", "```\n" + self._describe_config() + "\n```")
            self._complete = True

    def _write(self, context: Context) -> None:
        if context.runtime.is_chief:
            write_text_atomic(os.path.join(context.settings.model_dir, OPERATIVE_CONFIG_FILE), self._describe_config())


class HParamsWriter(Extension):
    """Writes the run's hyperparameters (e.g. its flattened gin bindings) at start as a
    TensorBoard hparams summary (chief), so sibling run directories compare in the HParams tab."""

    name = "hparams"

    def __init__(self, hparams: dict[str, bool | int | float | str]):
        self._hparams = dict(hparams)

    def begin(self, context: Context) -> None:
        context.metrics_log.hparams(
            self._hparams, trial_id=os.path.basename(os.path.normpath(context.settings.model_dir))
        )
