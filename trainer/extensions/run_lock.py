"""One training run per model_dir (trainer/files/run_lock.py): the chief claims it when the run is
built, before its first write, so a second run on a directory in use is refused in one line naming
the holder. Evaluate and predict build the same extensions and claim nothing: they read alongside a
training run, as the sidecar evaluator does. Under several workers only the chief writes model_dir, so only its claim counts; the
claim is released however the run ends (`train` is wrapped by `released_at_exit`)."""

from __future__ import annotations

from trainer.distribution import modes
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.files import run_lock


class ModelDirClaim(Extension):
    """Claims model_dir for the chief's run; every strategy (the chief's claim stands for all workers)."""

    name = "model_dir_claim"
    supports = modes.ALL

    def __init__(self) -> None:
        self._claim: run_lock.Claim | None = None

    def attach(self, context: Context) -> None:
        if context.runtime.is_chief and run_lock.in_a_claiming_call():  # training, not evaluate or predict
            self._claim = run_lock.claim(context.settings.model_dir, context.print)

    def close(self, context: Context) -> None:
        if self._claim is not None:
            self._claim.release()
