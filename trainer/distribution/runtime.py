"""The runtime: devices -> cluster -> strategy -> precision, set up once per process.

Everything that trains, evaluates, benchmarks or checks parity needs the same four things in
the same order: devices split before TensorFlow's runtime starts, this process's place in the
cluster checked before TensorFlow reads TF_CONFIG, the strategy built on those devices and
that cluster, and the Keras dtype policy set before any layer exists. `make_runtime` does
exactly that, so `train`, the sidecar, `experiments.bench` and `trainer.parity` cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import tensorflow as tf

from trainer.distribution import cluster, devices, modes, strategies
from trainer.distribution.cluster import ClusterInfo
from trainer.errors import UserError
from trainer.task import precision
from trainer.validation import check_choice, check_number


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Where and how a run computes (gin: the `train.*` parameters of the same names).

    Attributes:
      strategy: one of `modes.STRATEGY_NAMES`.
      device_config: logical devices, memory growth, visible GPUs (None: the defaults).
      cluster_resolver: 'tf_config' or 'slurm', for the multi-worker strategies.
      cluster_resolver_options: keyword arguments of the Slurm resolver.
      collective_timeout_secs: MultiWorkerMirrored: a collective waiting longer fails.
      variable_partitioner: ParameterServer: shards tf.Module variables across ps tasks.
      mixed_precision: None/'float32', 'mixed_bfloat16' or 'mixed_float16'.
    """

    strategy: str = "default"
    device_config: devices.DeviceConfig | None = None
    cluster_resolver: str = "tf_config"
    cluster_resolver_options: Mapping[str, Any] | None = None
    collective_timeout_secs: float | None = None
    variable_partitioner: Callable | None = None
    mixed_precision: str | None = None

    def __post_init__(self) -> None:
        modes.get(self.strategy)  # an unknown name is one line
        check_choice("train.cluster_resolver", self.cluster_resolver, cluster.RESOLVER_KINDS)
        if self.device_config is not None and not isinstance(self.device_config, devices.DeviceConfig):
            raise UserError(f"train.device_config must be @devices(), got {self.device_config!r}")
        if self.cluster_resolver_options is not None and not isinstance(self.cluster_resolver_options, Mapping):
            raise UserError(f"train.cluster_resolver_options must be a dict, got {self.cluster_resolver_options!r}")
        check_number("train.collective_timeout_secs", self.collective_timeout_secs, optional=True)
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, str):
            raise UserError(f"train.mixed_precision must be a policy name or None, got {self.mixed_precision!r}")
        precision.check(self.mixed_precision)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The strategy and this process's place in the cluster, ready for `strategy.scope()`."""

    config: RuntimeConfig
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
    def mode(self) -> modes.Mode:
        return modes.get(self.config.strategy)

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


def make_runtime(config: RuntimeConfig, *, standalone: bool = False) -> Runtime:
    """Devices, then the cluster (checked field by field), then the strategy, then the policy.

    `standalone`: a process that joins no cluster (the sidecar evaluator, whose TF_CONFIG
    describes the cluster it watches): the default strategy on this process's devices.
    The global Keras dtype policy stays set afterwards (layers read it when created); callers
    that must leave it as they found it wrap themselves in `precision.keeps_global_policy`.
    """
    devices.configure_devices(config.device_config or devices.DeviceConfig())
    if standalone:
        config = dataclasses.replace(config, strategy="default", variable_partitioner=None)
        info = ClusterInfo(cluster={}, task_type=None, task_id=0)
    else:
        info = cluster.resolve(config.strategy, config.cluster_resolver, **(config.cluster_resolver_options or {}))
    strategy = strategies.make_strategy(
        config.strategy,
        cluster_resolver=info.resolver,
        collective_timeout_secs=config.collective_timeout_secs,
        variable_partitioner=config.variable_partitioner,
    )
    policy = precision.set_global_policy(config.mixed_precision)
    return Runtime(config=config, strategy=strategy, cluster=info, policy=policy)
