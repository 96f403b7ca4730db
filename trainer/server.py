"""`python -m trainer.server`: one worker or ps task of a ParameterServer cluster, from TF_CONFIG or SLURM.

In ParameterServer training only the coordinator (task `chief`) runs the training
program; workers and parameter servers are plain TensorFlow servers that execute
what the coordinator sends them. This module is that server:

    TF_CONFIG='{"cluster": {"chief": [...], "worker": [...], "ps": [...]},
                "task": {"type": "worker", "index": 0}}' python -m trainer.server

or, as a task of an srun step, with the cluster resolved from SLURM by the same resolver
and options as the chief's `train.cluster_resolver` and `train.cluster_resolver_options`:

    python -m trainer.server --cluster_resolver=slurm \
        --cluster_resolver_options="{'jobs': {'chief': 1, 'ps': 1, 'worker': 2}}"

It checks TF_CONFIG with `trainer.cluster` (one line and exit 2 on a mistake),
sets `GRPC_FAIL_FAST=use_caller` before TensorFlow loads (so a dead peer is an
error the coordinator can act on, not a hang), gives the server
`inter_op_parallelism_threads >= workers + 1` (fewer deadlock at the first
`join`, docs/design.md, rule 8), prints one line once it listens, and blocks until
SIGTERM or SIGINT, after which it exits 0. TensorFlow's gRPC server cannot be
shut down, so the process ends with `os._exit`. A server whose parent process
dies (the launcher or an embedded cluster killed with SIGKILL) exits too, so
no server outlives what started it.
"""

import argparse
import ast
import os
import signal
import sys
import threading
from typing import Any

os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from trainer.cli import flush_and_exit  # noqa: E402
from trainer.distribution import cluster  # noqa: E402  (no TensorFlow import)
from trainer.distribution.local_cluster import READY_MESSAGE  # noqa: E402  (no TensorFlow import)
from trainer.errors import UserError  # noqa: E402

SERVER_TASK_TYPES = ("worker", "ps")
_PARENT_POLL_SECS = 1.0


def check_server_task(info: cluster.ClusterInfo) -> None:
    """Raises UserError unless `info` is a worker or ps task of a cluster with both."""
    if not info.is_distributed:
        raise UserError(
            "trainer.server needs TF_CONFIG describing a worker or ps task; without a "
            "cluster, run `python -m trainer.main --gin_file=gin/ps.gin`, which starts its own"
        )
    if info.task_type not in SERVER_TASK_TYPES:
        raise UserError(
            f"TF_CONFIG: task.type is {info.task_type!r} but trainer.server runs 'worker' or 'ps' "
            "tasks; run the chief with `python -m trainer.main --gin_file=gin/ps.gin`"
        )
    for needed in SERVER_TASK_TYPES:
        if not info.cluster.get(needed):
            raise UserError(
                f"TF_CONFIG: cluster has no {needed!r} tasks; a ParameterServer cluster needs "
                "at least one worker and one ps"
            )


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one `error:` line, not usage + message
        raise UserError(f"trainer.server: {message}; see --help")


def parse_args(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """The resolver kind and its options, spelled like the chief's gin parameters."""
    parser = _ArgumentParser(prog="python -m trainer.server", description="A worker or ps task.")
    parser.add_argument(
        "--cluster_resolver",
        choices=cluster.RESOLVER_KINDS,
        default="tf_config",
        help="where the cluster comes from, as train.cluster_resolver",
    )
    parser.add_argument(
        "--cluster_resolver_options",
        default="{}",
        help="the resolver's options as a Python dict, as train.cluster_resolver_options",
    )
    args = parser.parse_args(argv)
    try:
        options = ast.literal_eval(args.cluster_resolver_options)
    except (SyntaxError, ValueError):
        options = None
    if not isinstance(options, dict):
        raise UserError(
            f"trainer.server: --cluster_resolver_options={args.cluster_resolver_options!r} is not a "
            "Python dict; write it like \"{'jobs': {'chief': 1, 'ps': 1, 'worker': 2}}\""
        )
    return args.cluster_resolver, options


def server_task(resolver_kind: str, options: dict[str, Any]) -> cluster.ClusterInfo:
    """This task from TF_CONFIG (TensorFlow not loaded) or from SLURM, checked as a server task."""
    if resolver_kind == "tf_config" and not options:
        info = cluster.cluster_from_env(cluster.allowed_task_types_for("parameter_server"))
    else:
        from trainer import quiet_start

        quiet_start.import_tensorflow()  # the resolvers need it; without its load-time notices
        info = cluster.resolve("parameter_server", resolver_kind, **options)
    check_server_task(info)
    return info


def inter_op_threads(info: cluster.ClusterInfo) -> int:
    """At least one thread per worker plus one: fewer deadlocks the first `join` (rule 8)."""
    return max(os.cpu_count() or 1, len(info.cluster.get("worker", [])) + 1)


def serve(info: cluster.ClusterInfo, stop: threading.Event) -> None:
    """Starts the server and returns once `stop` is set or the parent process has gone."""
    from trainer import quiet_start

    quiet_start.import_tensorflow()  # without its load-time C++ notices
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=inter_op_threads(info))
    tf.distribute.Server(
        tf.train.ClusterSpec(info.cluster),
        job_name=info.task_type,
        task_index=info.task_id,
        protocol="grpc",
        config=config,
        start=True,
    )
    address = info.cluster[info.task_type][info.task_id]
    say(f"server {info.task_type} {info.task_id} (pid {os.getpid()}) {READY_MESSAGE} {address}")
    parent = os.getppid()
    while not stop.wait(_PARENT_POLL_SECS):
        if os.getppid() != parent:
            say(f"server {info.task_type} {info.task_id}: parent process gone; exiting")
            return


def say(line: str) -> None:
    """Prints a line; a reader that has gone (its parent killed) must not stop the exit."""
    try:
        print(line, flush=True)
    except (BrokenPipeError, OSError):
        pass


def main(argv: list[str]) -> int:
    try:
        info = server_task(*parse_args(argv))
    except UserError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    serve(info, stop)
    say(f"server {info.task_type} {info.task_id} stopped")
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = main(sys.argv[1:])
    finally:
        # The gRPC server has no shutdown and a normal exit can hang in its threads, so the
        # process always ends here, whatever happened.
        flush_and_exit(code)
