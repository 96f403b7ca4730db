"""An embedded ParameterServer cluster: ps and worker servers as subprocesses of this process.

`python -m trainer.main --gin_file=gin/ps.gin` with no TF_CONFIG has nobody to coordinate,
so it starts its own cluster on localhost: `num_ps` ps and `num_workers` worker tasks,
each a `python -m trainer.server` subprocess on a free port (portpicker), and runs itself
as the coordinator (task `chief`) by setting TF_CONFIG for its own process.

Subprocesses, not in-process servers: TensorFlow's gRPC servers never shut down, so
in-process ones would outlive the run (docs/design.md, rule 8). The servers are ended in a
`finally` (SIGTERM, then SIGKILL after `grace_secs`), also on an error or a SIGTERM to
this process; if this process is killed outright, each server notices its parent is
gone and exits by itself (see trainer/server.py). So no process is left behind.

The whole cluster, this process included, runs in a private network namespace with
only loopback (see trainer/distribution/early_isolation.py), since TensorFlow's servers listen
on every address.

With a local tf.data service (`train.data_service = 'local'`, trainer/data/service.py) the same
machinery starts a dispatcher and its data workers, also `trainer.server` subprocesses, as a cluster of
their own (`service_cluster`): beside the parameter-server tasks, or alone for a run in one process.
The training processes find the dispatcher in ADDRESS_ENV.

A worker that dies is restarted on its port (up to `max_worker_restarts` times): the
coordinator works around it meanwhile and gives it work again once it is back. A ps
that dies is not restarted: its variables are gone, so the coordinator stops the run
and a rerun continues from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator

from trainer.cli import sigterm_unwinds
from trainer.distribution import modes, netns
from trainer.errors import RunFailure
from trainer.validation import check_int, check_number

WHAT = "the embedded ParameterServer cluster"  # as the network warning names it
SERVER_MODULE = "trainer.server"
READY_MESSAGE = "listening at"  # what trainer.server prints once it serves
SERVICE_TASK_TYPES = ("dispatcher", "data_worker")
DEFAULT_DATA_WORKERS = 2  # of a 'local' tf.data service (trainer/data/service.py)
# The dispatcher of the service a local cluster started, 'grpc://localhost:P', for the training processes.
ADDRESS_ENV = "TRAINER_DATA_SERVICE"
_POLL_SECS = 0.2


@dataclasses.dataclass(frozen=True)
class LocalClusterConfig:
    """The embedded cluster's shape (gin: `local_cluster.num_workers = 2`, ...).

    Attributes:
      num_workers: worker servers (>= 1).
      num_ps: parameter servers (>= 1).
      start_timeout_secs: how long the servers may take to start listening.
      grace_secs: time the servers get after SIGTERM before SIGKILL.
      max_worker_restarts: how often a dead worker is restarted (in total).
    """

    num_workers: int = 2
    num_ps: int = 1
    start_timeout_secs: float = 180.0
    grace_secs: float = 5.0
    max_worker_restarts: int = 3

    def validate(self) -> None:
        check_int("local_cluster.num_workers", self.num_workers)
        check_int("local_cluster.num_ps", self.num_ps)
        check_number("local_cluster.start_timeout_secs", self.start_timeout_secs)
        check_number("local_cluster.grace_secs", self.grace_secs, strictly=False)
        check_int("local_cluster.max_worker_restarts", self.max_worker_restarts, minimum=0)


class _Server:
    """One `trainer.server` subprocess; its output is copied to our stderr under a prefix."""

    def __init__(self, task_type: str, task_id: int, cluster: dict, module: str):
        self.task_type, self.task_id = task_type, task_id
        self.name = f"{task_type} {task_id}"
        self.address = cluster[task_type][task_id]
        self.ready = threading.Event()
        self.last_lines: list[str] = []
        env = {**os.environ, "TF_CONFIG": tf_config_for(cluster, task_type, task_id), "PYTHONUNBUFFERED": "1"}
        # A process group of its own: a terminal's Ctrl-C reaches the coordinator only, which
        # saves (the variables live on these servers) and then ends them.
        self.process = subprocess.Popen(
            [sys.executable, "-m", module],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
        self._copier = threading.Thread(target=self._copy_output, daemon=True)
        self._copier.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _copy_output(self) -> None:
        with self.process.stdout:
            for raw in iter(self.process.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                self.last_lines = (self.last_lines + [line])[-5:]
                if READY_MESSAGE in line:
                    self.ready.set()
                # One write per line: print writes the newline apart, and the servers' copying
                # threads then run two lines together.
                sys.stderr.write(f"[{self.name}] {line}\n")
                sys.stderr.flush()

    def poll(self) -> int | None:
        return self.process.poll()

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    def reap(self) -> None:
        self.process.wait()
        self._copier.join(timeout=5)


class LocalCluster:
    """Starts the servers, watches them, and ends them: use as a context manager."""

    def __init__(
        self,
        config: LocalClusterConfig | None = LocalClusterConfig(),
        *,
        data_workers: int = 0,
        print_fn: Callable[[str], None] = print,
        server_module: str = SERVER_MODULE,
    ):
        """`config` None: no parameter-server tasks, only the service of `data_workers` data workers."""
        if config is not None:
            config.validate()
        self.config = config or LocalClusterConfig()
        self._training = config is not None
        self._data_workers = data_workers
        self._print = print_fn
        self._module = server_module
        self.cluster: dict[str, list[str]] = {}
        self.service_cluster: dict[str, list[str]] = {}
        self._servers: list[_Server] = []
        self._retired: list[_Server] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._restarts = 0

    @property
    def pids(self) -> dict[str, int]:
        """'worker 0' -> pid of the task's current process."""
        with self._lock:
            return {server.name: server.pid for server in self._servers}

    def coordinator_tf_config(self) -> str:
        """TF_CONFIG of the coordinator: task `chief` 0 of this cluster."""
        return tf_config_for(self.cluster, "chief", 0)

    @property
    def service_address(self) -> str | None:
        """'grpc://localhost:P' of the service's dispatcher (None without a service)."""
        return service_address(self.service_cluster) if self.service_cluster else None

    def start(self) -> None:
        if self._training:
            self.cluster = build_cluster(self.config.num_workers, self.config.num_ps, free_ports)
        if self._data_workers:
            self.service_cluster = build_service_cluster(self._data_workers, free_ports)
        kinds = [(self.cluster, kind) for kind in ("ps", "worker") if kind in self.cluster]
        for cluster, task_type in kinds + [(self.service_cluster, kind) for kind in self.service_cluster]:
            for task_id in range(len(cluster[task_type])):
                self._servers.append(_Server(task_type, task_id, cluster, self._module))
        self._wait_until_ready()
        shown = ", ".join(f"{s.name} pid {s.pid} at {s.address}" for s in self._servers)
        role = "the coordinator (chief)" if self._training else "the trainer"
        self._print(f"local cluster: {shown}; this process is {role}")
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="local-cluster")
        self._watcher.start()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_secs
        for server in self._servers:
            while not server.ready.wait(_POLL_SECS):
                code = server.poll()
                if code is not None:
                    detail = " | ".join(server.last_lines[-2:]) or "no output"
                    raise RunFailure(f"local cluster: {server.name} exited with code {code} while starting ({detail})")
                if time.monotonic() > deadline:
                    raise RunFailure(
                        f"local cluster: {server.name} did not start listening within "
                        f"{self.config.start_timeout_secs:.0f} s"
                    )

    def _watch(self) -> None:
        """Restarts dead workers (on the same port); reports a dead ps (the coordinator fails)."""
        reported: set[int] = set()
        while not self._stopping.wait(_POLL_SECS):
            with self._lock:
                for index, server in enumerate(self._servers):
                    code = server.poll()
                    if code is None or server.pid in reported or self._stopping.is_set():
                        continue
                    reported.add(server.pid)
                    if server.task_type == "worker" and self._restarts < self.config.max_worker_restarts:
                        self._restarts += 1
                        self._retired.append(server)
                        self._servers[index] = _Server(server.task_type, server.task_id, self.cluster, self._module)
                        self._print(
                            f"local cluster: {server.name} exited with code {code}; restarted it as "
                            f"pid {self._servers[index].pid} ({self._restarts}/{self.config.max_worker_restarts})"
                        )
                    else:
                        self._print(f"local cluster: {server.name} exited with code {code}")

    def stop(self) -> None:
        """SIGTERM to every server, SIGKILL after the grace period, then reap them all."""
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        with self._lock:
            servers = self._servers + self._retired
        for server in servers:
            server.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_secs
        while any(s.poll() is None for s in servers) and time.monotonic() < deadline:
            time.sleep(0.05)
        for server in servers:
            server.signal(signal.SIGKILL)
        for server in servers:
            server.reap()

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def build_cluster(num_workers: int, num_ps: int, ports: Callable[[int], list[int]]) -> dict:
    """The cluster spec on localhost (with ps: a chief, the workers, the ps; without: the workers);
    `ports(n)` returns n distinct free ports."""
    counts = {"chief": 1, "worker": num_workers, "ps": num_ps} if num_ps else {"worker": num_workers}
    free = iter(ports(sum(counts.values())))
    return {kind: [f"localhost:{next(free)}" for _ in range(n)] for kind, n in counts.items()}


def build_service_cluster(num_data_workers: int, ports: Callable[[int], list[int]]) -> dict:
    """A tf.data service on localhost: one dispatcher and `num_data_workers` data workers."""
    free = iter(ports(num_data_workers + 1))
    return {
        "dispatcher": [f"localhost:{next(free)}"],
        "data_worker": [f"localhost:{next(free)}" for _ in range(num_data_workers)],
    }


def service_address(service_cluster: dict) -> str:
    return f"grpc://{service_cluster['dispatcher'][0]}"


def tf_config_for(cluster: dict, task_type: str, task_id: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": task_id}})


def free_ports(count: int) -> list[int]:
    """`count` distinct ports nobody listens on now, for the tasks of a cluster on this machine."""
    import portpicker

    ports: set[int] = set()
    while len(ports) < count:
        ports.add(portpicker.pick_unused_port())
    return sorted(ports)


@contextlib.contextmanager
def _environ(values: dict[str, str | None]) -> Iterator[None]:
    """The environment with `values` set (None ones left alone), as it was afterwards."""
    values = {name: value for name, value in values.items() if value is not None}
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def needs_local_cluster(strategy: str, cluster_resolver: str = "tf_config") -> bool:
    """A ParameterServer run with no cluster given (no TF_CONFIG, not resolved from SLURM) gets
    an embedded one."""
    mode = modes.MODES.get(strategy)
    return (
        mode is not None
        and mode.coordinates_workers
        and cluster_resolver == "tf_config"
        and not os.environ.get("TF_CONFIG", "").strip()
    )


@contextlib.contextmanager
def embedded_cluster(
    config: LocalClusterConfig | None, *, data_workers: int = 0, print_fn: Callable[[str], None] = print
) -> Iterator[LocalCluster]:
    """Runs the body as the coordinator of a fresh local cluster (config None: beside a local tf.data
    service alone), ended whatever happens."""
    with sigterm_unwinds(), LocalCluster(config, data_workers=data_workers, print_fn=print_fn) as cluster:
        tf_config = cluster.coordinator_tf_config() if config is not None else None
        with _environ({"TF_CONFIG": tf_config, ADDRESS_ENV: cluster.service_address}):
            yield cluster


_coordinates_ps_cluster = False


def cluster_for(
    strategy: str,
    make_config: Callable[[], LocalClusterConfig],
    *,
    print_fn: Callable[[str], None] = print,
    model_dir: str | None = None,
    cluster_resolver: str = "tf_config",
    data_workers: int = 0,
) -> contextlib.AbstractContextManager:
    """What an entry point runs `train` in: an embedded cluster when `needs_local_cluster`, with
    `data_workers` > 0 (a 'local' tf.data service) a dispatcher and its data workers beside it, or
    alone where no cluster is given (no TF_CONFIG: under trainer.launch the launcher starts them).

    The embedded cluster, coordinator included, must not be reachable from the network
    (docs/design.md, rule 12). `early_isolation.isolate_early` has usually entered the private
    namespace; if not, before the servers start (and their ports are picked) this process re-executes
    itself into it (same pid and flags; `model_dir`, when given, is passed on so the new
    image uses the one already printed). Where that is impossible it warns once and goes on.
    """
    global _coordinates_ps_cluster
    _coordinates_ps_cluster = strategy in modes.MODES and modes.MODES[strategy].coordinates_workers
    training = needs_local_cluster(strategy, cluster_resolver)
    service_alone = data_workers > 0 and not os.environ.get("TF_CONFIG", "").strip() and cluster_resolver == "tf_config"
    if not training and not service_alone:
        return contextlib.nullcontext()
    netns.reexec_isolated(WHAT, [f"--model_dir={model_dir}"] if model_dir else [])
    return embedded_cluster(make_config() if training else None, data_workers=data_workers, print_fn=print_fn)


def coordinates_ps_cluster() -> bool:
    """Whether this process coordinates a ParameterServer cluster (set by `cluster_for`): such a
    process must leave without TensorFlow's exit handlers (trainer/cli.py, `exit_without_teardown`)."""
    return _coordinates_ps_cluster
