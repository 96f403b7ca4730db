"""Experiment tracking in MLflow: `train.extensions = [@mlflow_hook()]` (optional extra `trainer[mlflow]`).

The chief logs the run's hparams as params, every metrics.jsonl record as `<split>/<name>` by step
(subscribed to the run's MetricsLog: nothing recomputed), and the config files as artifacts. The
run id kept in `model_dir/mlflow_run_id` makes a resumed run log into the same MLflow run (params
it holds are not logged again: MLflow refuses to change one). MLflow 3 refuses a file store
unless MLFLOW_ALLOW_FILE_STORE is true, so for a `file:` URI it is set unless the user set it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from trainer.errors import UserError
from trainer.extensions.config_writer import OPERATIVE_CONFIG_FILE
from trainer.extensions.context import Context
from trainer.extensions.protocol import Extension
from trainer.files.atomic import write_text_atomic
from trainer.files.run_record import RECORD_FILE

RUN_ID_FILE = "mlflow_run_id"
_PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch


def _check_name(name: str, value: Any, *, optional: bool) -> None:
    if (value is None and optional) or (isinstance(value, str) and value.strip()):
        return
    raise UserError(f"mlflow_hook.{name} must be a non-empty string{' or None' if optional else ''}, got {value!r}")


def tracking_uri_for(model_dir: str, tracking_uri: str | None) -> str:
    """The store to log to: the binding, MLFLOW_TRACKING_URI, or `file:<model_dir>/mlruns`."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"file:{os.path.abspath(model_dir)}/mlruns"
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


class MlflowTracking(Extension):
    """Logs params, metrics by step and the run's config files to MLflow (chief only); `run_name`
    None: the model_dir's base name; the experiment is created if the store lacks it."""

    name = "mlflow"
    setting = "mlflow_hook"

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "trainer", run_name: str | None = None):
        _check_name("tracking_uri", tracking_uri, optional=True)
        _check_name("experiment_name", experiment_name, optional=False)
        _check_name("run_name", run_name, optional=True)
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise UserError(
                "mlflow_hook needs MLflow, which is not installed: pip install -e '.[mlflow]' "
                "(or pip install mlflow-skinny)"
            ) from None
        self.tracking_uri, self.experiment_name, self.run_name = tracking_uri, experiment_name, run_name
        self._client = None
        self.run_id: str | None = None

    def begin(self, context: Context) -> None:
        if not context.runtime.is_chief:
            return
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri_for(context.settings.model_dir, self.tracking_uri))
        self.run_id = self._resumed_run(context.settings.model_dir) or self._new_run(context.settings.model_dir)
        self._log_params(context)
        context.metrics_log.subscribe(self._log_record)
        self._log_artifacts(context)

    def end(self, context: Context, step: int) -> None:
        if self._client is None:
            return
        self._log_artifacts(context)
        self._client.set_terminated(self.run_id, status="FINISHED")

    def _resumed_run(self, model_dir: str) -> str | None:
        """The run id kept in model_dir, if this store still has that run (then marked running again)."""
        from mlflow.exceptions import MlflowException

        path = os.path.join(model_dir, RUN_ID_FILE)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            run_id = f.read().strip()
        try:
            self._client.get_run(run_id)
        except MlflowException:  # another store, or the run was deleted: start a new one
            return None
        self._client.update_run(run_id, status="RUNNING")
        return run_id

    def _new_run(self, model_dir: str) -> str:
        experiment = self._client.get_experiment_by_name(self.experiment_name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(self.experiment_name)
        name = self.run_name or os.path.basename(os.path.normpath(model_dir))
        run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
        write_text_atomic(os.path.join(model_dir, RUN_ID_FILE), run_id + "\n")
        return run_id

    def _log_params(self, context: Context) -> None:
        from mlflow.entities import Param

        logged, hparams = self._client.get_run(self.run_id).data.params, context.settings.hparams or {}
        changed = sorted(k for k, v in hparams.items() if k in logged and logged[k] != str(v))
        if changed:
            context.print(f"mlflow: params {', '.join(changed)} differ from the resumed run's; it keeps the old values")
        params = [Param(k, str(v)) for k, v in sorted(hparams.items()) if k not in logged]
        for i in range(0, len(params), _PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[i : i + _PARAMS_PER_BATCH])

    def _log_record(self, step: int, split: str, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(
            self.run_id,
            metrics=[Metric(f"{split}/{name}", float(value), now, int(step)) for name, value in metrics.items()],
        )

    def _log_artifacts(self, context: Context) -> None:
        for name in (OPERATIVE_CONFIG_FILE, RECORD_FILE):
            path = os.path.join(context.settings.model_dir, name)
            if os.path.exists(path):
                self._client.log_artifact(self.run_id, path)
