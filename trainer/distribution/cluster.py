"""Who am I in the cluster, and am I the chief: decided once, before TensorFlow starts.

TensorFlow reports a malformed TF_CONFIG as a stack trace or a hang at the first collective; here it is
checked field by field first, one line naming the field and the fix. TensorFlow is imported only inside
the resolver functions, so the checks run before it loads.
"""

import dataclasses
import errno
import inspect
import json
import os
import shutil
import socket
from typing import Any

from trainer.distribution import modes
from trainer.errors import UserError

RESOLVER_KINDS = ("tf_config", "slurm")
_FIX_HINT = 'write it like {"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}'


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """This process's place in the cluster (empty: a single process); `resolver` where `resolve` built one."""

    cluster: dict[str, list[str]]
    task_type: str | None
    task_id: int
    resolver: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def num_workers(self) -> int:
        """Tasks that run the step: the chief and the workers (with parameter servers only the workers)."""
        workers = len(self.cluster.get("worker", []))
        return workers if self.cluster.get("ps") else workers + len(self.cluster.get("chief", []))

    @property
    def is_chief(self) -> bool:
        """Task `chief`, or `worker` 0 where there is no chief, or the only process."""
        first_worker = self.task_type == "worker" and self.task_id == 0 and "chief" not in self.cluster
        return not self.cluster or self.task_type == "chief" or first_worker

    @property
    def task_name(self) -> str:
        return f"{self.task_type}{self.task_id}" if self.task_type else "local"

    @property
    def is_distributed(self) -> bool:
        return bool(self.cluster)


SINGLE_PROCESS = ClusterInfo(cluster={}, task_type=None, task_id=0)


def parse_tf_config(text: str | None, *, allowed_task_types: set[str] | None = None) -> ClusterInfo:
    """The cluster a TF_CONFIG string describes, checked; None, '' or `{}` mean a single process.
    `allowed_task_types` are the task types the chosen strategy can use (None: any)."""
    if text is None or not text.strip():
        return SINGLE_PROCESS
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(
            f"TF_CONFIG: not valid JSON ({error.msg} at line {error.lineno} column {error.colno}); {_FIX_HINT}"
        ) from None
    return SINGLE_PROCESS if config == {} else _validated(config, allowed_task_types, source="TF_CONFIG")


def cluster_from_env(allowed_task_types: set[str] | None = None) -> ClusterInfo:
    return parse_tf_config(os.environ.get("TF_CONFIG"), allowed_task_types=allowed_task_types)


def allowed_task_types_for(strategy_name: str) -> set[str] | None:
    """Task types a strategy can use; None for an unknown name (the strategy builder rejects it)."""
    mode = modes.MODES.get(strategy_name)
    return set(mode.task_types) if mode is not None else None


def check_single_machine(info: ClusterInfo, strategy_name: str) -> None:
    mode = modes.MODES.get(strategy_name)
    if mode is not None and not mode.multi_worker and info.num_workers > 1:
        raise UserError(
            f"strategy '{strategy_name}' runs on one machine but TF_CONFIG describes "
            f"{info.num_workers} workers; use gin/mwms.gin or unset TF_CONFIG"
        )


def check_own_port_free(info: ClusterInfo) -> None:
    """Refuses this task's address where its port is taken on this host: TensorFlow's server listens on
    0.0.0.0:<port> (docs/design.md rule 12) and would fail with a traceback, 'Could not start gRPC server'.
    Bound as gRPC binds (SO_REUSEADDR), so only a listener refuses it, not a connection closing."""
    if not info.cluster or info.task_type is None:
        return
    address = info.cluster[info.task_type][info.task_id]
    port = address.rsplit(":", 1)[-1]
    if not port.isdigit():
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", int(port)))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return  # not ours to judge (no permission for a low port: TensorFlow says so)
            raise UserError(
                f"task {info.task_type} {info.task_id} of the cluster is at {address}, but something already listens "
                f"on port {port} of this host; give the task a free port in TF_CONFIG, or stop what listens there "
                "(another run's task?)"
            ) from None


def resolve(strategy_name: str, resolver_kind: str = "tf_config", **slurm_kwargs: Any) -> ClusterInfo:
    allowed = allowed_task_types_for(strategy_name)
    if resolver_kind == "tf_config":
        cluster_from_env(allowed)  # One-line errors before TensorFlow reads TF_CONFIG.
    resolver = make_cluster_resolver(resolver_kind, **slurm_kwargs)
    info = cluster_info_from_resolver(resolver, allowed_task_types=allowed)
    check_single_machine(info, strategy_name)
    return dataclasses.replace(info, resolver=resolver)


def make_cluster_resolver(kind: str = "tf_config", **slurm_kwargs: Any) -> Any:
    """A TensorFlow cluster resolver: 'tf_config' or 'slurm' (`slurm_kwargs` go to SlurmClusterResolver)."""
    if kind == "tf_config":
        if slurm_kwargs:
            raise UserError(
                f"cluster resolver 'tf_config' takes no arguments, got {sorted(slurm_kwargs)}; "
                "remove them or use cluster_resolver='slurm'"
            )
        cluster_from_env()  # One-line errors before TensorFlow reads TF_CONFIG.
        import tensorflow as tf

        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if kind == "slurm":
        return _slurm_resolver(slurm_kwargs)
    kinds = ", ".join(map(repr, RESOLVER_KINDS))
    raise UserError(f"unknown cluster_resolver {kind!r}; use one of {kinds}")


def cluster_info_from_resolver(resolver: Any, *, allowed_task_types: set[str] | None = None) -> ClusterInfo:
    """The ClusterInfo of any resolver, checked like TF_CONFIG (the resolver is not attached)."""
    cluster = resolver.cluster_spec().as_dict()  # Slurm sets task_type only once this has run.
    if not cluster:
        return SINGLE_PROCESS
    task = {"type": resolver.task_type, "index": resolver.task_id}
    source = type(resolver).__name__
    return _validated({"cluster": cluster, "task": task}, allowed_task_types, source=source)


def _validated(config: Any, allowed: set[str] | None, *, source: str) -> ClusterInfo:
    if not isinstance(config, dict):
        raise UserError(f"{source}: top level must be a JSON object, got {type(config).__name__}; {_FIX_HINT}")
    cluster = _checked_cluster(config.get("cluster"), source)
    task_type, task_id = _checked_task(config.get("task"), cluster, source)
    _check_allowed(cluster, task_type, allowed, source)
    return ClusterInfo(cluster=cluster, task_type=task_type, task_id=task_id)


def _checked_cluster(raw: Any, source: str) -> dict[str, list[str]]:
    if raw is None:
        raise UserError(f"{source}: 'cluster' is missing; {_FIX_HINT}")
    if not isinstance(raw, dict) or not raw:
        raise UserError(
            f'{source}: cluster must map each task type to a list of "host:port" strings, got {raw!r}; {_FIX_HINT}'
        )
    seen: dict[str, str] = {}
    for task_type, addresses in raw.items():
        if not isinstance(addresses, list) or not addresses:
            raise UserError(
                f'{source}: cluster.{task_type} must be a non-empty list of "host:port" strings, got {addresses!r}'
            )
        for index, address in enumerate(addresses):
            field = f"cluster.{task_type}[{index}]"
            _check_address(address, field, source)
            if address in seen:
                raise UserError(
                    f"{source}: {field} repeats address {address!r} of {seen[address]}; "
                    "give every task its own host:port"
                )
            seen[address] = field
    if len(raw.get("chief", [])) > 1:
        raise UserError(
            f"{source}: cluster.chief has {len(raw['chief'])} tasks but a cluster has at most "
            "one chief; move the others to cluster.worker"
        )
    return {task_type: list(addresses) for task_type, addresses in raw.items()}


def _check_address(address: Any, field: str, source: str) -> None:
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{source}: {field} is {address!r}, not host:port; write it like 'localhost:12345'")


def _checked_task(raw: Any, cluster: dict[str, list[str]], source: str) -> tuple[str, int]:
    types = ", ".join(cluster)
    if raw is None:
        raise UserError(f'{source}: \'task\' is missing; add "task": {{"type": <one of {types}>, "index": 0}}')
    if not isinstance(raw, dict):
        raise UserError(f'{source}: task must be an object like {{"type": "worker", "index": 0}}, got {raw!r}')
    task_type = raw.get("type")
    if not isinstance(task_type, str):
        raise UserError(f"{source}: task.type is {task_type!r}; set it to one of {types}")
    if task_type not in cluster and task_type != "evaluator":
        raise UserError(f"{source}: task.type {task_type!r} is not in cluster (it has {types}); set it to one of those")
    return task_type, _checked_index(raw.get("index"), task_type, cluster, source)


def _checked_index(index: Any, task_type: str, cluster: dict[str, list[str]], source: str) -> int:
    # An evaluator runs beside the cluster and is usually not listed in it (TF's convention).
    count = len(cluster[task_type]) if task_type in cluster else 1
    if index is None:
        raise UserError(f"{source}: task.index is missing; set it to 0..{count - 1}")
    if not isinstance(index, int) or isinstance(index, bool):
        raise UserError(f"{source}: task.index must be an integer, got {index!r}; set it to 0..{count - 1}")
    if not 0 <= index < count:
        raise UserError(
            f"{source}: task.index {index} is outside cluster.{task_type} ({count} tasks); "
            f"set task.index to 0..{count - 1}"
        )
    return index


def _check_allowed(cluster: dict[str, list[str]], task_type: str, allowed: set[str] | None, source: str) -> None:
    if allowed is None:
        return
    for used in [*cluster, task_type]:
        if used not in allowed:
            raise UserError(
                f"{source}: task type {used!r} cannot be used by this strategy (it uses "
                f"{', '.join(sorted(allowed))}); remove it or choose a strategy that uses it"
            )


def _slurm_resolver(kwargs: dict[str, Any]) -> Any:
    import tensorflow as tf

    slurm_class = tf.distribute.cluster_resolver.SlurmClusterResolver
    parameters = inspect.signature(slurm_class).parameters
    if unknown := sorted(set(kwargs) - set(parameters)):
        raise UserError(f"slurm resolver: unknown argument(s) {unknown}; use some of {', '.join(parameters)}")
    _check_slurm_env(kwargs)
    gpus_per_node = kwargs.get("gpus_per_node")
    cpu_only = gpus_per_node == 0 or (gpus_per_node is None and not _gpus_visible())
    try:
        resolver = _cpu_slurm_resolver(slurm_class, kwargs) if cpu_only else slurm_class(**kwargs)
    except (RuntimeError, ValueError) as error:
        raise UserError(
            f"slurm resolver: {str(error).splitlines()[0].rstrip('.')}; "
            "make jobs/tasks_per_node/gpus_* match the srun allocation"
        ) from None
    _check_own_node(resolver)
    return resolver


def _check_own_node(resolver: Any) -> None:
    """Refuses an address on another node than this task's (SLURMD_NODENAME): TensorFlow numbers the tasks
    through the nodes in sorted name order, SLURM in its own; where they differ the cluster never forms."""
    node = os.environ.get("SLURMD_NODENAME")  # set by slurmd in every task
    address = resolver.cluster_spec().task_address(resolver.task_type, resolver.task_id)
    host = address.rpartition(":")[0]
    if node and host != node:
        raise UserError(
            f"slurm resolver: task {os.environ['SLURM_PROCID']} runs on {node} but TensorFlow's "
            f"SlurmClusterResolver gives it {address} (it numbers the tasks through the nodes in "
            "sorted name order, SLURM in its node order); run on nodes whose names sort in SLURM's "
            "order (node[10-19], not node[9-10]) or give each task a TF_CONFIG and use "
            "cluster_resolver='tf_config'"
        )


def _check_slurm_env(kwargs: dict[str, Any]) -> None:
    needed = ["SLURM_PROCID"]
    if kwargs.get("jobs") is None:
        needed.append("SLURM_STEP_NUM_TASKS")
    if not isinstance(kwargs.get("tasks_per_node"), dict):
        needed.append("SLURM_STEP_NODELIST")
    if kwargs.get("tasks_per_node") is None:
        needed.append("SLURM_STEP_TASKS_PER_NODE")
    if missing := [name for name in needed if name not in os.environ]:
        raise UserError(
            f"slurm resolver chosen but {', '.join(missing)} not set: "
            "run inside an sbatch/srun job or use cluster_resolver='tf_config'"
        )


def _gpus_visible() -> bool:
    return bool(os.environ.get("CUDA_VISIBLE_DEVICES")) or shutil.which("nvidia-smi") is not None


def _cpu_slurm_resolver(slurm_class: Any, kwargs: dict[str, Any]) -> Any:
    """The Slurm cluster resolved with one pretend GPU slot per task (TF's resolver gives a port only with a
    GPU slot), frozen into a resolver that reports no accelerators, so strategies use the CPU."""
    import tensorflow as tf

    jobs = kwargs.get("jobs")
    num_tasks = sum(jobs.values()) if jobs else int(os.environ["SLURM_STEP_NUM_TASKS"])
    slots = {"gpus_per_node": num_tasks, "gpus_per_task": 1, "auto_set_gpu": False}
    resolver = slurm_class(**{**kwargs, **slots})
    spec = resolver.cluster_spec()
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        spec,
        master=spec.task_address(resolver.task_type, resolver.task_id),
        task_type=resolver.task_type,
        task_id=resolver.task_id,
        num_accelerators={},
        rpc_layer=resolver.rpc_layer,
    )
