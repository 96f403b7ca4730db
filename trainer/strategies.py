"""Build a `tf.distribute.Strategy` by name, so a gin file picks the mode with one string."""
from __future__ import annotations

import tensorflow as tf

from trainer import devices
from trainer.errors import UserError

STRATEGY_NAMES = (
    "default",
    "one_device",
    "mirrored",
    "central_storage",
    "multi_worker_mirrored",
    "parameter_server",
    "tpu",
)
MULTI_WORKER = ("multi_worker_mirrored", "parameter_server")


def make_strategy(
    name: str,
    *,
    cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None,
    collective_timeout_secs: float | None = None,
    variable_partitioner=None,
    tpu: str = "",
) -> tf.distribute.Strategy:
    """Returns the strategy called `name`, on the devices set up by `trainer.devices`.

    Args:
      name: one of STRATEGY_NAMES.
      cluster_resolver: where the cluster comes from for the multi-worker strategies
        (TF_CONFIG when None).
      collective_timeout_secs: MultiWorkerMirrored only: a collective that waits longer
        fails, so a dead peer becomes an error instead of a hang.
      variable_partitioner: ParameterServer only: shards variables across ps tasks.
      tpu: TPU name or address for `TPUClusterResolver` ('' = the local/default TPU).
    """
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy(devices.compute_devices()[0])
    if name == "mirrored":
        return tf.distribute.MirroredStrategy(devices.compute_devices())
    if name == "central_storage":
        return tf.distribute.experimental.CentralStorageStrategy(devices.compute_devices())
    if name == "multi_worker_mirrored":
        options = tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=collective_timeout_secs
        )
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=cluster_resolver, communication_options=options
        )
    if name == "parameter_server":
        if cluster_resolver is None:
            cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        return tf.distribute.ParameterServerStrategy(
            cluster_resolver, variable_partitioner=variable_partitioner
        )
    if name == "tpu":
        return _tpu_strategy(tpu)
    raise UserError(
        f"unknown strategy {name!r}; set train.strategy to one of: {', '.join(STRATEGY_NAMES)}"
    )


def _tpu_strategy(tpu: str) -> tf.distribute.Strategy:
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, tf.errors.OpError, RuntimeError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"strategy 'tpu' found no TPU ({first_line}); run on a TPU VM or pick another "
            "train.strategy such as 'mirrored'"
        ) from e
    return tf.distribute.TPUStrategy(resolver)
