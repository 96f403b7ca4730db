"""Build a `tf.distribute.Strategy` by name, so a gin file picks the mode with one string."""

from __future__ import annotations

import itertools
import os
from typing import Any

import tensorflow as tf

from trainer.distribution import devices, modes
from trainer.errors import UserError, error_line


def make_strategy(
    name: str,
    *,
    cluster_resolver: tf.distribute.cluster_resolver.ClusterResolver | None = None,
    collective_timeout_secs: float | None = None,
    variable_partitioner=None,
    tpu: str = "",
) -> tf.distribute.Strategy:
    """The strategy called `name` on the configured devices. `collective_timeout_secs` (MWMS) makes a dead
    peer an error instead of a hang; `tpu` is a TPU name or address ('' = the local one)."""
    mode = modes.get(name)
    if variable_partitioner is not None and not mode.coordinates_workers:
        raise UserError(
            f"a variable_partitioner shards variables across ps tasks and only works with strategy "
            f"'parameter_server', not {name!r}; remove it or use gin/ps.gin"
        )
    builders = {
        "default": tf.distribute.get_strategy,
        "one_device": lambda: tf.distribute.OneDeviceStrategy(devices.compute_devices()[0]),
        "mirrored": lambda: with_own_collective_keys(tf.distribute.MirroredStrategy, devices.compute_devices()),
        "central_storage": lambda: tf.distribute.experimental.CentralStorageStrategy(devices.compute_devices()),
        "multi_worker_mirrored": lambda: with_own_collective_keys(
            tf.distribute.MultiWorkerMirroredStrategy,
            cluster_resolver=cluster_resolver,
            communication_options=tf.distribute.experimental.CommunicationOptions(
                timeout_seconds=collective_timeout_secs
            ),
        ),
        "parameter_server": lambda: _parameter_server_strategy(cluster_resolver, variable_partitioner),
        "tpu": lambda: _tpu_strategy(tpu),
    }
    return builders[mode.name]()


# TensorFlow remembers every collective a process ran by its group and instance keys, and each
# MirroredStrategy or MultiWorkerMirroredStrategy numbers its collectives from the same base: a second one
# in the process (the next run in a notebook) reran the first one's keys for other collectives and failed
# ("Collective instance 100 expected type 0 ... but got type 2"). Each gets a range of group keys of its
# own; the first of a process keeps base 0, so every worker of a cluster numbers its collectives alike.
COLLECTIVE_KEY_SPACING = 100_000
_collective_strategies_made = itertools.count()


def with_own_collective_keys(cls: type, *args: Any, **kwargs: Any) -> tf.distribute.Strategy:
    """`cls(*args, **kwargs)`, numbering its collectives from a base no earlier strategy of this process used."""
    strategy = cls.__new__(cls)
    strategy._collective_key_base = next(_collective_strategies_made) * COLLECTIVE_KEY_SPACING
    strategy.__init__(*args, **kwargs)
    return strategy


def _parameter_server_strategy(resolver, variable_partitioner) -> tf.distribute.Strategy:
    """ParameterServerStrategy for the coordinator (task `chief`), checked before TF connects."""
    if resolver is None:
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    jobs = resolver.cluster_spec().as_dict()
    if not jobs:
        raise UserError(
            "strategy 'parameter_server' needs a cluster with ps and worker tasks: run "
            "`python -m trainer.main --gin_file=gin/ps.gin` without TF_CONFIG (it starts a local "
            "one), use `python -m trainer.launch --num_ps=1 ...`, or set TF_CONFIG"
        )
    if resolver.task_type in ("worker", "ps"):
        raise UserError(
            f"this process is task {resolver.task_type} {resolver.task_id} of a ParameterServer "
            "cluster; workers and ps tasks run `python -m trainer.server`, only the chief runs "
            "trainer.main"
        )
    for needed in ("worker", "ps"):
        if not jobs.get(needed):
            raise UserError(
                f"strategy 'parameter_server' needs at least one {needed!r} task in the cluster, "
                f"which has {', '.join(sorted(jobs))}; add one to TF_CONFIG"
            )
    if resolver.task_type != "chief":
        raise UserError(
            f"strategy 'parameter_server' runs the training program on task 'chief' (the "
            f"coordinator), but this process is {resolver.task_type!r}; add a chief to TF_CONFIG "
            "and run trainer.main there"
        )
    # A dead worker or ps must be an error the coordinator can act on, not a hang (rule 8).
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    return tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=variable_partitioner)


def _tpu_strategy(tpu: str) -> tf.distribute.Strategy:
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, tf.errors.OpError, RuntimeError) as e:
        raise UserError(
            f"strategy 'tpu' found no TPU ({error_line(e)}); run on a TPU VM or pick another "
            "train.strategy such as 'mirrored'"
        ) from e
    return tf.distribute.TPUStrategy(resolver)
