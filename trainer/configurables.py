"""Gin at the edge: every name a gin file may bind, registered here and nowhere else.

The library stays plain Python; this module gives its functions and classes gin names.
`python -m trainer.configurables` lists them with their parameters and one-line docs.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the listing: without TensorFlow's load-time notices on stderr
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from trainer import quiet_start

    quiet_start.import_tensorflow()

import gin  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainer import data  # noqa: E402
from trainer.data import service as data_service_lib  # noqa: E402
from trainer.distribution import devices  # noqa: E402
from trainer.distribution import local_cluster as local_cluster_lib  # noqa: E402
from trainer.extensions import built_in  # noqa: E402
from trainer.extensions.progress import ProgressLogger  # noqa: E402
from trainer.extensions.worker_watch import WorkerWatch  # noqa: E402
from trainer.loops import options as loop_options  # noqa: E402
from trainer.loops import sidecar  # noqa: E402
from trainer.run import evaluate as evaluate_lib  # noqa: E402
from trainer.run import predict as predict_lib  # noqa: E402
from trainer.run import settings as settings_lib  # noqa: E402
from trainer.run import train as train_lib  # noqa: E402
from trainer.task import contract, models, optimizers, steps  # noqa: E402
from trainer.tools import gin_config, gin_functions  # noqa: E402
from trainer.tools.parity import config as parity_config  # noqa: E402

# The train parameters that hold functions the loop calls, and the values the loop passes them itself
# (trainer/task/contract.py): a binding of one of those is refused. model_fn and optimizer_fn get
# what they declare of the loop's offers (input_shape, total_steps, ...); a binding wins over an offer.
FUNCTIONS = {
    "step_fn": contract.STEP,
    "eval_step_fn": contract.EVAL_STEP,
    "input_fn": contract.INPUT,
    "data_source": contract.INPUT,
    "model_fn": None,
    "optimizer_fn": None,
    "eval_metrics_fn": None,
}


def resolve_functions(arguments: dict) -> dict:
    """`train`'s arguments with each function bound as `train.<name> = @fn` replaced by the plain
    function with its own bindings applied once (trainer/tools/gin_functions.py)."""
    raw = gin.get_bindings("train", resolve_references=False)
    resolved = dict(arguments)
    for name, supplied in FUNCTIONS.items():
        reference = raw.get(name)
        if not isinstance(reference, gin.config.ConfigurableReference):
            continue
        if arguments.get(name) is reference.scoped_configurable_fn:
            names = supplied.names if supplied else ()
            plain = gin_functions.plain_function(reference, supplied=names, what=f"train.{name}")
            resolved[name] = plain or arguments[name]
    if isinstance(resolved.get("data_service"), str):  # an address, with `data_service.*` bound in gin
        resolved["data_service"] = data_service_config(resolved["data_service"])
    return resolved


def data_service_config(address: str) -> data_service_lib.DataServiceConfig:
    """`train.data_service = 'address'` with the `data_service.*` bindings."""
    return CONFIGURABLES["data_service"](address=address)


def local_data_workers() -> int:
    """How many data workers the parsed config's 'local' tf.data service has (0: none to start), for the
    entry point that starts it (trainer/distribution/local_cluster.py)."""
    value = gin.get_bindings("train").get("data_service")
    config = data_service_config(value) if isinstance(value, str) else value
    return config.num_workers if isinstance(config, data_service_lib.DataServiceConfig) and config.local else 0


def train_from_gin(**arguments):
    """Trains as `train` does, with gin's bindings resolved at the edge (see `resolve_functions`)."""
    return train_lib.train(**resolve_functions(arguments))


train_from_gin.__signature__ = settings_lib.signature()
train_from_gin.__doc__ = train_lib.train.__doc__


def settings_from_gin(**overrides) -> settings_lib.Settings:
    """The parsed config's `train.*` bindings as Settings (functions resolved as for a run), for
    the entry points that build what a run builds: the sidecar, experiments.bench, trainer.parity."""
    return settings_lib.Settings.of(resolve_functions(gin.get_bindings("train")) | overrides)


def check_settings(model_dir: str) -> None:
    """What a run of the parsed config refuses from its settings alone (`train.checked_registry`),
    for an entry point to call before it starts an embedded cluster. Raises UserError."""
    train_lib.checked_registry(settings_from_gin(model_dir=model_dir))


REGISTERED = {
    "train": train_from_gin,
    "cnn": models.cnn,
    "mlp": models.mlp,
    "classification_step": steps.classification_step,
    "classification_eval_step": steps.classification_eval_step,
    "make_optimizer": optimizers.make_optimizer,
    "digits": data.Digits,
    "fashion_mnist": data.FashionMnist,
    "tfrecord_files": data.TFRecordFiles,
    "synthetic": data.Synthetic,
    "image_augmentation": data.ImageAugmentation,
    "feature": data.Feature,
    "float_feature": data.float_feature,
    "int64_feature": data.int64_feature,
    "bytes_feature": data.bytes_feature,
    "png_feature": data.png_feature,
    "jpeg_feature": data.jpeg_feature,
    "int64_sequence_feature": data.int64_sequence_feature,
    "devices": devices.DeviceConfig,
    **built_in.GIN_NAMES,  # the built-in extensions' own (trainer/extensions/built_in.py)
    "parameter_server": loop_options.ParameterServerConfig,
    "data_service": data_service_lib.DataServiceConfig,
    "sequences": data.SequenceBatching,
    "local_cluster": local_cluster_lib.LocalClusterConfig,
    "min_size_partitioner": tf.distribute.experimental.partitioners.MinSizePartitioner,
    "max_size_partitioner": tf.distribute.experimental.partitioners.MaxSizePartitioner,
    "fixed_shards_partitioner": tf.distribute.experimental.partitioners.FixedShardsPartitioner,
    "parity": parity_config.ParityConfig,  # read by trainer.parity only; other entry points accept it
}
"""Gin name -> library object: models bound as `train.model_fn = @cnn`, input functions and devices as
instances (`@digits()`), TFRecord features (`@png_feature()`) inside `tfrecord_files.features`."""

CONFIGURABLES = {name: gin.external_configurable(target, name) for name, target in REGISTERED.items()}
# The sidecar's own options; the rest of its setup is the run's (`settings_from_gin`).
CONFIGURABLES["eval_continuous"] = gin.external_configurable(
    sidecar.evaluate_continuously, "eval_continuous", denylist=["settings", "print_fn"]
)
# --mode=predict's own options; the model, checkpoint and strategy are the run's.
CONFIGURABLES["predict"] = gin.external_configurable(
    predict_lib.predict, "predict", denylist=["settings", "checkpoint", "output", "weights", "print_fn"]
)
# `train` builds its progress logger itself, so that class is registered in place: the class
# reads its own bindings (`progress_logger.live = False`); every_steps is train.log_every_steps.
CONFIGURABLES["progress_logger"] = gin.configurable("progress_logger", denylist=["every_steps", "stream"])(
    ProgressLogger
)
# Made by the run under the multi-worker strategies, so registered in place too (`worker_watch.enabled`).
CONFIGURABLES["worker_watch"] = gin.configurable("worker_watch", denylist=["every_steps"])(WorkerWatch)
train = CONFIGURABLES["train"]
local_cluster = CONFIGURABLES["local_cluster"]


def evaluate_continuously(*, model_dir: str, print_fn=print) -> dict[str, float]:
    """--mode=eval_continuous: the sidecar evaluator, set up by the run's own `train.*` bindings
    (`eval_continuous.timeout_secs` and `.poll_secs` are its own)."""
    return CONFIGURABLES["eval_continuous"](settings_from_gin(model_dir=model_dir), print_fn=print_fn)


def check_evaluation(*, model_dir: str, **choices) -> None:
    """What --mode=evaluate refuses before anything runs (`trainer.run.evaluate.plan`), for main to
    call before it starts an embedded cluster. Raises UserError."""
    evaluate_lib.plan(settings_from_gin(model_dir=model_dir), **choices)


def evaluate_checkpoint(*, model_dir: str, print_fn=print, **choices) -> dict[str, dict[str, float]]:
    """--mode=evaluate: one checkpoint evaluated again with the run's own `train.*` bindings;
    `choices`: checkpoint, splits, weights (trainer/run/evaluate.py)."""
    return evaluate_lib.evaluate(settings_from_gin(model_dir=model_dir, print_fn=print_fn), **choices)


def predict(
    *,
    model_dir: str | None,
    checkpoint: str | None,
    output: str | None,
    weights: tuple[str, ...] | list[str] = (),
    print_fn=print,
) -> tuple[str | None, int]:
    """--mode=predict, set up by the run's own `train.*` bindings and `predict.*` (its functions
    resolved as the run's are, `resolve_functions`)."""
    raw = gin.get_bindings("predict", resolve_references=False)
    functions = {
        name: plain
        for name, supplied in (("predict_step_fn", predict_lib.PREDICT_STEP.names), ("input_fn", contract.INPUT.names))
        if (plain := gin_functions.plain_function(raw.get(name), supplied=supplied, what=f"predict.{name}"))
    }
    settings = settings_from_gin(model_dir=model_dir)
    return CONFIGURABLES["predict"](
        settings, checkpoint=checkpoint, output=output, weights=weights, print_fn=print_fn, **functions
    )


def main() -> None:
    """Lists what gin knows, not a hand list, so every registered name shows up."""
    for configurable in gin_config.registered_configurables():
        print(gin_config.describe(configurable))


if __name__ == "__main__":
    sys.exit(main())
