"""`python -m trainer.server`: one worker or ps task of a ParameterServer cluster, from TF_CONFIG or SLURM
(`--cluster_resolver=slurm --cluster_resolver_options="{'jobs': {...}}"`, as the chief's gin options); or,
from TF_CONFIG, one `dispatcher` or `data_worker` task of a tf.data service cluster
(`{'dispatcher': [address], 'data_worker': [...]}`, trainer/data/service.py), whatever the strategy.

Only the coordinator (task `chief`) runs the training program; workers and ps are plain TensorFlow servers.
This one checks the cluster (one line, exit 2 on a mistake), sets `GRPC_FAIL_FAST=use_caller` before
TensorFlow loads (a dead peer is an error, not a hang), gives the server `inter_op_parallelism_threads >=
workers + 1` (fewer deadlock at the first `join`, docs/design.md, rule 8), prints one line once it listens,
and ends with `os._exit` (gRPC servers cannot shut down) on SIGTERM, SIGINT or its parent's death.
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
from trainer.distribution.local_cluster import READY_MESSAGE, SERVICE_TASK_TYPES  # noqa: E402  (no TensorFlow)
from trainer.errors import UserError  # noqa: E402

SERVER_TASK_TYPES = ("worker", "ps")
_PARENT_POLL_SECS = 1.0
_SERVING: list = []  # the tf.data service server, held until the process ends


def check_server_task(info: cluster.ClusterInfo) -> None:
    if info.task_type in SERVICE_TASK_TYPES:
        if len(info.cluster.get("dispatcher", [])) != 1:
            raise UserError(
                "TF_CONFIG: a tf.data service cluster needs exactly one 'dispatcher' task, got "
                f"{len(info.cluster.get('dispatcher', []))}"
            )
        return
    if not info.is_distributed:
        raise UserError(
            "trainer.server needs TF_CONFIG describing a worker or ps task; without a "
            "cluster, run `python -m trainer.main --gin_file=gin/ps.gin`, which starts its own"
        )
    if info.task_type not in SERVER_TASK_TYPES:
        raise UserError(
            f"TF_CONFIG: task.type is {info.task_type!r} but trainer.server runs 'worker' or 'ps' "
            "tasks (or a tf.data service's 'dispatcher' or 'data_worker'); run the chief with "
            "`python -m trainer.main --gin_file=gin/ps.gin`"
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
        "--cluster_resolver", choices=cluster.RESOLVER_KINDS, default="tf_config", help="as the chief's"
    )
    parser.add_argument("--cluster_resolver_options", default="{}", help="a Python dict, as the chief's")
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
    if resolver_kind == "tf_config" and not options:
        info = cluster.cluster_from_env()
        if info.task_type not in SERVICE_TASK_TYPES:
            info = cluster.cluster_from_env(cluster.allowed_task_types_for("parameter_server"))
    else:
        from trainer import quiet_start

        quiet_start.import_tensorflow()  # the resolvers need it; without its load-time notices
        info = cluster.resolve("parameter_server", resolver_kind, **options)
    check_server_task(info)
    return info


def inter_op_threads(info: cluster.ClusterInfo) -> int:
    return max(os.cpu_count() or 1, len(info.cluster.get("worker", [])) + 1)


def serve(info: cluster.ClusterInfo, stop: threading.Event) -> None:
    from trainer import quiet_start

    quiet_start.import_tensorflow()  # without its load-time C++ notices
    import tensorflow as tf

    if info.task_type in SERVICE_TASK_TYPES:
        from trainer.data import service

        _SERVING.append(service.serve(info.task_type, info.cluster, info.task_id))  # stops if collected
    else:
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=inter_op_threads(info))
        spec = tf.train.ClusterSpec(info.cluster)
        tf.distribute.Server(spec, job_name=info.task_type, task_index=info.task_id, protocol="grpc", config=config)
    address = info.cluster[info.task_type][info.task_id]
    say(f"server {info.task_type} {info.task_id} (pid {os.getpid()}) {READY_MESSAGE} {address}")
    parent = os.getppid()
    while not stop.wait(_PARENT_POLL_SECS):
        if os.getppid() != parent:
            say(f"server {info.task_type} {info.task_id}: parent process gone; exiting")
            return


def say(line: str) -> None:
    # A reader that has gone (its parent killed) must not stop the exit.
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
