"""The runtime: devices -> cluster -> strategy -> precision, set up once per process.

Everything that trains, evaluates, benchmarks or checks parity needs the same four things in
the same order: devices split before TensorFlow's runtime starts, this process's place in the
cluster checked before TensorFlow reads TF_CONFIG, the strategy built on those devices and
that cluster, and the Keras dtype policy set before any layer exists. `make_runtime` does
exactly that, so `train`, the sidecar, `experiments.bench` and `trainer.parity` cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import tensorflow as tf

from trainer.distribution import cluster, devices, modes, strategies
from trainer.distribution.cluster import ClusterInfo
from trainer.errors import UserError
from trainer.task import precision

if TYPE_CHECKING:
    from trainer.run.settings import Settings


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The strategy and this process's place in the cluster, ready for `strategy.scope()`."""

    mode: modes.Mode
    strategy: tf.distribute.Strategy
    cluster: ClusterInfo
    policy: str

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def num_workers(self) -> int:
        """Processes that run steps (1 for a single process)."""
        return max(self.cluster.num_workers, 1)

    @property
    def is_chief(self) -> bool:
        return self.cluster.is_chief

    @property
    def spans_processes(self) -> bool:
        """Whether a loop call involves other processes (several synchronous workers, or remote ones)."""
        return self.num_workers > 1 or self.mode.coordinates_workers

    def check_batch_size(self, global_batch_size: int) -> None:
        """Refuses a global batch that the replicas cannot share evenly."""
        if global_batch_size % self.num_replicas:
            raise UserError(
                f"train.global_batch_size {global_batch_size} is not divisible by the {self.num_replicas} "
                f"replicas; use a multiple of {self.num_replicas}"
            )


def make_runtime(settings: "Settings", *, standalone: bool = False) -> Runtime:
    """Devices, then the cluster (checked field by field), then the strategy, then the policy, as
    `settings` (checked where they were made) say: `strategy`, `device_config`, `cluster_resolver`
    and its options, `collective_timeout_secs`, `parameter_server`'s partitioner, `mixed_precision`.

    `standalone`: a process that joins no cluster (the sidecar evaluator, whose TF_CONFIG
    describes the cluster it watches): the default strategy on this process's devices.
    The global Keras dtype policy stays set afterwards (layers read it when created); callers
    that must leave it as they found it wrap themselves in `precision.keeps_global_policy`.
    """
    devices.configure_devices(settings.device_config or devices.DeviceConfig())
    name = "default" if standalone else settings.strategy
    if standalone:
        info = ClusterInfo(cluster={}, task_type=None, task_id=0)
    else:
        info = cluster.resolve(name, settings.cluster_resolver, **(settings.cluster_resolver_options or {}))
        if name == "multi_worker_mirrored":  # its server starts with the strategy
            cluster.check_own_port_free(info)
    partitioner = settings.parameter_server.variable_partitioner if settings.parameter_server else None
    strategy = strategies.make_strategy(
        name,
        cluster_resolver=info.resolver,
        collective_timeout_secs=settings.collective_timeout_secs,
        variable_partitioner=None if standalone else partitioner,
    )
    policy = precision.set_global_policy(settings.mixed_precision)
    return Runtime(mode=modes.get(name), strategy=strategy, cluster=info, policy=policy)
