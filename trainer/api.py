"""The Python surface: `trainer.train`, `trainer.evaluate`, `trainer.predict` and `trainer.configure_devices`,
for a notebook or a script that drives runs as `model.fit` is driven.

The keyword arguments are the `train.*` names of the gin files (`Settings`' fields, checked there); a
function-valued one takes a plain Python function. A call may start from gin files and bindings instead
(`gin_files=['gin/mwms.gin']`), its keyword arguments then winning over what the files bind, exactly as
`python -m trainer.main` runs them. A mistake is raised as `UserError` with the CLI's one line, before
anything is written, so a notebook kernel survives it. A call leaves no gin config behind and restores the
Keras dtype policy, so calls repeat in one process; what TensorFlow fixes once it runs (the devices) is
configured by `configure_devices` before the first run.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
from typing import Any, Callable, Mapping, Sequence

from trainer import quiet_start

_LEVEL_CHOSEN = "TF_CPP_MIN_LOG_LEVEL" in os.environ
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the CLI's quiet start, unless the user chose a level
quiet_start.import_tensorflow()

import gin  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainer import configurables  # noqa: E402
from trainer.cli import INTERRUPTED_EXIT_CODE  # noqa: E402
from trainer.distribution import devices  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.files.metrics_log import METRICS_FILE, read_history  # noqa: E402
from trainer.gin_flags import REPO_ROOT, gin_error_line, missing_arguments_line, parse_gin  # noqa: E402
from trainer.loops.sidecar import checkpoints_in  # noqa: E402
from trainer.run import evaluate as evaluate_lib  # noqa: E402
from trainer.run import predict as predict_lib  # noqa: E402
from trainer.run import train as train_lib  # noqa: E402
from trainer.run.settings import Settings, absolute_model_dir  # noqa: E402
from trainer.task import precision  # noqa: E402
from trainer.task.task import build_eval_models  # noqa: E402
from trainer.task.user_code import user_functions  # noqa: E402
from trainer.tools import gin_config  # noqa: E402

DeviceConfig = devices.DeviceConfig  # `device_config=trainer.DeviceConfig(logical_cpus=2)`

if not _LEVEL_CHOSEN:
    # In a notebook TensorFlow logs its INFO lines ("Using MirroredStrategy with devices ...", one per
    # collective) to stdout; the CLI keeps them out of the progress, and so does this.
    tf.get_logger().setLevel(max(tf.get_logger().getEffectiveLevel(), logging.WARNING))

# The strategies that replicate over this machine's devices: on a CPU, one replica unless it is split.
LOCAL_REPLICATING = ("mirrored", "central_storage")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What `trainer.train` returns: the run's directory, its final eval by split, its history, the newest
    checkpoint and (on first use) the trained model(s) restored from it."""

    model_dir: str  # absolute
    metrics: dict[str, dict[str, float]]  # the last eval of each split: {split: {name: value}}
    # metrics.jsonl as one history, a record per logged step and split: pandas.DataFrame(history) tabulates it
    history: list[dict] = dataclasses.field(repr=False)
    checkpoint: str | None  # the newest checkpoint's path (its prefix)
    step: int  # the step of that checkpoint (0 if none)
    settings: Settings = dataclasses.field(repr=False)  # what the run was given: `trainer.evaluate(result)` reuses it

    @functools.cached_property
    def model(self) -> Any:
        """The trained model, or dict of models as `model_fn` returns them, on this process's device, with
        the weights of the newest checkpoint (the chief's final state), callable at once."""
        if self.checkpoint is None:
            raise UserError(
                f"{self.model_dir} holds no checkpoint: the run saved none, so there is no model to restore"
            )
        return restored_models(self.settings, self.checkpoint)


@dataclasses.dataclass(frozen=True)
class Predictions:
    """What `trainer.predict` returns: the `.npz` it wrote and, read on first use, its arrays by key."""

    path: str | None  # None on a worker other than the chief
    num_examples: int

    @functools.cached_property
    def outputs(self) -> dict[str, np.ndarray]:
        """{key: array with one row per example}: the model's `output` (each model's key for a dict of them),
        or the keys the predict step returned."""
        with np.load(self.path) as arrays:
            return {key: arrays[key] for key in arrays.files}


def train(*, gin_files: Sequence[str] = (), gin_bindings: Sequence[str] = (), **settings: Any) -> TrainResult:
    """Trains as `python -m trainer.main` does (resuming from the newest checkpoint in `model_dir`) and returns
    a `TrainResult`. `settings`: the `train.*` names (docs/python.md); `model_dir` defaults to a fresh
    `runs/<time>-<pid>` as in the CLI. Raises UserError (one line) for a mistake, before anything is written."""
    arguments = dict(settings)
    arguments.setdefault("print_fn", _print)
    if not arguments.get("model_dir"):
        arguments["model_dir"] = _fresh_model_dir()
        arguments["print_fn"](f"model_dir: {arguments['model_dir']}")
    with _configured(gin_files, gin_bindings) as gin_used:
        run_settings = configurables.settings_from_gin(**arguments) if gin_used else Settings.of(arguments)
        _check_in_process(run_settings)
        _say_replicas(run_settings)
        _fresh_keras_names()
        try:
            if gin_used:
                configurables.train(
                    **arguments,
                    describe_config=gin.operative_config_str,
                    hparams=gin_config.hparams(list(gin_files), list(gin_bindings), [REPO_ROOT]),
                )
            else:
                train_lib.train(**arguments)
        except SystemExit as e:  # Ctrl-C, a kernel's interrupt: the run saved the step reached and exits 130
            if e.code != INTERRUPTED_EXIT_CODE:
                raise
            raise KeyboardInterrupt(
                f"training interrupted; the same trainer.train call continues from {run_settings.model_dir}'s "
                "newest checkpoint"
            ) from None
    return result_of(run_settings)


def evaluate(
    run: TrainResult | str,
    *,
    checkpoint: str | None = None,
    splits: Sequence[str] = (),
    weights: Sequence[str] = (),
    gin_files: Sequence[str] = (),
    gin_bindings: Sequence[str] = (),
    **settings: Any,
) -> dict[str, dict[str, float]]:
    """`--mode=evaluate` from Python: `run` (a `TrainResult`, whose settings are reused, or a model_dir with
    the run's own `settings` or gin files) evaluated again at `checkpoint` (`ckpt-N`, N or a path; default
    the newest) on `splits` (default the run's eval splits) with `weights` ('model', 'ema', 'swa'; default
    every one the run evaluates). Returns {split: results}, as appended to metrics.jsonl."""
    with _configured(gin_files, gin_bindings) as gin_used:
        run_settings = _run_settings(run, settings, gin_used)
        return evaluate_lib.evaluate(run_settings, checkpoint=checkpoint, splits=tuple(splits), weights=tuple(weights))


def predict(
    run: TrainResult | str,
    *,
    split: str | None = None,
    checkpoint: str | None = None,
    output: str | None = None,
    weights: Sequence[str] = (),
    input_fn: Callable | None = None,
    predict_step_fn: Callable | None = None,
    batch_size: int | None = None,
    gin_files: Sequence[str] = (),
    gin_bindings: Sequence[str] = (),
    **settings: Any,
) -> Predictions:
    """`--mode=predict` from Python: the outputs of `run`'s model over `split` (default the first eval split;
    with `input_fn(split)` of your own, default 'predict') at `checkpoint` with `weights` (one kind), written to
    `output` (default `model_dir/predictions/<split>-ckpt-N.npz`). Returns the file and its arrays."""
    with _configured(gin_files, gin_bindings) as gin_used:
        run_settings = _run_settings(run, settings, gin_used)
        path, count = predict_lib.predict(
            run_settings,
            split=split,
            input_fn=input_fn,
            predict_step_fn=predict_step_fn,
            batch_size=batch_size,
            checkpoint=checkpoint,
            output=output,
            weights=tuple(weights),
            print_fn=run_settings.print_fn,
        )
    return Predictions(path=path, num_examples=count)


def configure_devices(**options: Any) -> None:
    """Sets up this process's devices for every later run (the fields of `DeviceConfig`, e.g.
    `logical_cpus=2`: two replicas of `strategy='mirrored'` on a CPU). TensorFlow fixes its devices when it
    first runs an op, so call this before the first run (in a notebook, in its first cells)."""
    devices.configure_devices(devices.DeviceConfig(**options))


def result_of(settings: Settings) -> TrainResult:
    """The `TrainResult` of the run in `settings.model_dir`, read from what the chief wrote there."""
    model_dir = settings.model_dir
    history = read_history(model_dir) if os.path.isfile(os.path.join(model_dir, METRICS_FILE)) else []
    metrics: dict[str, dict[str, float]] = {}
    for record in history:
        if record["split"] in settings.eval_split_names:
            metrics[record["split"]] = {k: v for k, v in record.items() if k not in ("step", "split")}
    listed = checkpoints_in(model_dir) if os.path.isdir(model_dir) else []
    step, checkpoint = listed[-1] if listed else (0, None)
    return TrainResult(model_dir, metrics, history, checkpoint, step, settings)


@precision.keeps_global_policy
def restored_models(settings: Settings, checkpoint: str) -> Any:
    """The run's model(s), built as the sidecar builds them (no strategy, the run's dtype policy) and
    restored from `checkpoint`."""
    precision.set_global_policy(settings.mixed_precision)
    keras.utils.set_random_seed(settings.seed)
    with user_functions({"train.model_fn": settings.model_fn}):
        models, _, restorer = build_eval_models(settings.make_input(), settings.model_fn)
    predict_lib.restore(restorer, checkpoint)
    return models


class _configured:
    """The gin config of one call: `gin_files` then `gin_bindings` parsed into an empty config (nothing of an
    earlier call's), cleared again when the call ends; a call without either leaves gin as it is. Gin's
    mistakes, and a configurable gin calls without its arguments, become the CLI's one UserError line."""

    def __init__(self, gin_files: Sequence[str], gin_bindings: Sequence[str]):
        if isinstance(gin_files, str) or isinstance(gin_bindings, str):
            raise UserError("gin_files and gin_bindings are lists of strings, e.g. gin_files=['gin/mwms.gin']")
        self.files, self.bindings = list(gin_files), list(gin_bindings)
        self.used = bool(self.files or self.bindings)

    def __enter__(self) -> bool:
        if self.used:
            gin.clear_config()
            if self.files:
                parse_gin(self.files, self.bindings)
            else:
                try:
                    gin.parse_config(self.bindings)
                except Exception as e:  # noqa: BLE001  (gin raises whatever its parser raised)
                    raise UserError(gin_error_line(e, "gin_bindings")) from e
        return self.used

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: Any) -> None:
        if self.used:
            gin.clear_config()
        if isinstance(error, TypeError) and (line := missing_arguments_line(error)):
            raise UserError(line) from None


def _run_settings(run: TrainResult | str, settings: Mapping[str, Any], gin_used: bool) -> Settings:
    """The settings of the run that `run` names: a TrainResult's own (with `settings` replacing some), or
    for a model_dir the gin config's `train.*` bindings and `settings`, or `settings` alone."""
    if isinstance(run, TrainResult):
        return dataclasses.replace(run.settings, **settings) if settings else run.settings
    if not isinstance(run, str) or not run:
        raise UserError(f"the run to read is a TrainResult or a model_dir path, got {run!r}")
    arguments = {"print_fn": _print, **settings, "model_dir": absolute_model_dir(run)}
    return configurables.settings_from_gin(**arguments) if gin_used else Settings.of(arguments)


def _check_in_process(settings: Settings) -> None:
    """Refuses a run that would need processes of its own: an embedded parameter-server cluster is started
    by `python -m trainer.main` (in a private network namespace), not inside a caller's process."""
    needs_cluster = settings.mode.coordinates_workers and settings.cluster_resolver == "tf_config"
    if needs_cluster and not os.environ.get("TF_CONFIG", "").strip():
        raise UserError(
            f"strategy '{settings.strategy}' from Python needs a running cluster (TF_CONFIG); for the embedded "
            "local cluster run `python -m trainer.main --gin_file=gin/ps.gin` (or trainer.launch) instead"
        )


def _say_replicas(settings: Settings) -> None:
    """One line where a local replicating strategy would get a single replica on an unsplit CPU, saying
    how to get the two of the docs' mirrored runs."""
    if settings.strategy not in LOCAL_REPLICATING or tf.config.list_physical_devices("GPU"):
        return
    config = settings.device_config or devices.DeviceConfig()
    if max(config.logical_cpus, config.logical_cpus_without_gpu) > 1:
        return
    split = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("CPU")[0])
    if split is None or len(split) <= 1:
        settings.print_fn(
            f"note: strategy '{settings.strategy}' runs 1 replica on this unsplit CPU; for 2, call "
            "trainer.configure_devices(logical_cpus=2) before the first run"
        )


def _fresh_keras_names() -> None:
    """Keras' layer names counted from the start, as in a fresh process: the run record holds them, so a run
    resumed in a process that built other models first (`conv2d_10` for `conv2d`) was refused as another
    run. The global dtype policy, which the same reset clears, is kept."""
    policy = keras.mixed_precision.global_policy()
    keras.backend.clear_session(free_memory=False)
    keras.mixed_precision.set_global_policy(policy)


def _fresh_model_dir() -> str:
    """`runs/<time>-<pid>` in the working directory, as the CLI makes by default, with `-2`, `-3`, ... where
    a run of this process started in the same second already took it."""
    from trainer.main import default_model_dir

    base = absolute_model_dir(default_model_dir())
    return next(path for n in itertools.count(1) if not os.path.exists(path := base + (f"-{n}" if n > 1 else "")))


def _print(line: str) -> None:
    print(line, flush=True)
