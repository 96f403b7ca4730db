"""Gin at the edge: every name a gin file may bind, registered here and nowhere else.

The library stays plain Python; this module gives its functions and classes gin names.
`python -m trainer.configurables` lists them with their parameters and one-line docs.
"""
from __future__ import annotations

import sys

import gin
import keras
import tensorflow as tf

from trainer import data
from trainer.extensions import early_stopping
from trainer.hooks import base as hooks
from trainer.task import models
from trainer.task import optimizers
from trainer.task import steps
from trainer.run import train as train_lib
from trainer.distribution import devices
from trainer.distribution import local_cluster as local_cluster_lib
from trainer.tools import gin_config
from trainer.tools.parity import config as parity_config
from trainer.extensions import mlflow_tracking as mlflow_hook
from trainer.extensions import profiler
from trainer.loops import ps as ps_loop
from trainer.loops import sidecar

REGISTERED = {
    "train": train_lib.train,
    "cnn": models.cnn,
    "mlp": models.mlp,
    "classification_step": steps.classification_step,
    "classification_eval_step": steps.classification_eval_step,
    "make_optimizer": optimizers.make_optimizer,
    "digits": data.Digits,
    "fashion_mnist": data.FashionMnist,
    "tfrecord_files": data.TFRecordFiles,
    "synthetic": data.Synthetic,
    "feature": data.Feature,
    "float_feature": data.float_feature,
    "int64_feature": data.int64_feature,
    "bytes_feature": data.bytes_feature,
    "png_feature": data.png_feature,
    "jpeg_feature": data.jpeg_feature,
    "int64_sequence_feature": data.int64_sequence_feature,
    "devices": devices.DeviceConfig,
    "checkpoint_hook": hooks.CheckpointHook,
    "eval_hook": hooks.EvalHook,
    "early_stopping": early_stopping.EarlyStopping,
    # Keras callbacks for train.keras_callbacks, under their Keras names
    **{f"keras.callbacks.{c.__name__}": c for c in (keras.callbacks.EarlyStopping, keras.callbacks.ReduceLROnPlateau,
                                                    keras.callbacks.CSVLogger, keras.callbacks.TerminateOnNaN)},
    "profiler_hook": profiler.ProfilerHook,
    "mlflow_hook": mlflow_hook.MlflowHook,
    "parameter_server": ps_loop.ParameterServerConfig,
    "local_cluster": local_cluster_lib.LocalClusterConfig,
    "min_size_partitioner": tf.distribute.experimental.partitioners.MinSizePartitioner,
    "max_size_partitioner": tf.distribute.experimental.partitioners.MaxSizePartitioner,
    "fixed_shards_partitioner": tf.distribute.experimental.partitioners.FixedShardsPartitioner,
    "eval_continuous": sidecar.evaluate_continuously,
    "parity": parity_config.ParityConfig,  # read by trainer.parity only; other entry points accept it
}
"""Gin name -> library object. Models are bound as `train.model_fn = @cnn` (called with the
arguments it declares among input_shape, num_classes and element_spec), input functions
(`train.input_fn`, or its older name `train.data_source`) and devices as instances (`@digits()`),
TFRecord features as `@png_feature()` etc. inside `tfrecord_files.features = {...}`."""

CONFIGURABLES = {name: gin.external_configurable(target, name) for name, target in REGISTERED.items()}
# `train` builds its progress logger itself, so that class is registered in place: the class
# reads its own bindings (`progress_logger.live = False`); every_steps is train.log_every_steps.
CONFIGURABLES["progress_logger"] = gin.configurable(
    "progress_logger", denylist=["every_steps", "stream"])(hooks.ProgressLogger)
train = CONFIGURABLES["train"]
local_cluster = CONFIGURABLES["local_cluster"]


def evaluate_continuously(*, model_dir: str, print_fn=print) -> dict[str, float]:
    """--mode=eval_continuous: the sidecar evaluator, set up by the run's own `train.*` bindings
    (`eval_continuous.timeout_secs` and `.poll_secs` are its own)."""
    settings = sidecar.train_settings(train_lib.defaults_with(gin.get_bindings("train")))
    return CONFIGURABLES["eval_continuous"](model_dir=model_dir, print_fn=print_fn, **settings)


def main() -> None:
    """Lists what gin knows, not a hand list, so every registered name shows up."""
    for configurable in gin_config.registered_configurables():
        print(gin_config.describe(configurable))


if __name__ == "__main__":
    sys.exit(main())
