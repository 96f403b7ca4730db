"""Run a whole cluster on this machine: one process per task, each with its own TF_CONFIG.

    python -m trainer.launch --num_workers=2 -- --gin_file=gin/mwms.gin
    python -m trainer.launch --num_workers=2 --num_ps=1 -- --gin_file=gin/ps.gin

A half-dead local cluster (a worker gone, its peers hanging in a collective) is the usual way a
local multi-worker run goes wrong, so the tasks are one group: one failing ends them all, a signal
reaches every task (Ctrl-C the training tasks first, which save, then the servers), each task's
process group is killed at the end, and the group can restart whole on fresh ports (exit 42). It
runs in a private network namespace with only loopback (trainer/distribution/netns.py), since
TensorFlow's servers listen on every address. Without ps: N `worker` tasks (worker 0 the chief);
with ps: one `chief` running the module, N `worker` and P `ps` tasks running `--server_module`. A config
with a 'local' tf.data service (`train.data_service = 'local'`, read from its gin text) adds a `dispatcher`
and `data_service.num_workers` `data_worker` tasks running `--server_module`, a cluster of their own whose
address the training tasks get in TRAINER_DATA_SERVICE.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, NoReturn

from absl import app, flags

from trainer.cli import fail, parse_flags
from trainer.distribution import early_isolation, netns
from trainer.distribution.local_cluster import (
    ADDRESS_ENV,
    build_cluster,
    build_service_cluster,
    free_ports,
    service_address,
    tf_config_for,
)
from trainer.errors import UserError

USER_ERROR_EXIT = 2
INTERRUPTED_EXIT = 128 + signal.SIGINT
_POLL_SECS = 0.05
_OUTPUT_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Options:
    """How to run each task and how to end the group."""

    module: str
    server_module: str
    grace_secs: float


def command_for(cluster: dict, task_type: str, args: Sequence[str], options: Options) -> list[str]:
    """In ps mode only the chief runs the module; ps and workers run the server module."""
    if "ps" in cluster and task_type != "chief":
        return [sys.executable, "-m", options.server_module]
    return [sys.executable, "-m", options.module, *args]


def launch(
    num_workers: int,
    num_ps: int,
    args: Sequence[str],
    *,
    module: str = "trainer.main",
    server_module: str = "trainer.server",
    max_restarts: int = 0,
    grace_secs: float = 10.0,
) -> int:
    """Runs the group (restarted on fresh ports) until it succeeds, fails past its restarts, or a signal
    stops it; returns 0, the failing task's code (128 + N if killed by signal N), or 128 + N for the
    launcher's own signal N. Main thread only (it handles SIGINT and SIGTERM)."""
    _check_options(num_workers, num_ps, max_restarts, grace_secs)
    options = Options(module=module, server_module=server_module, grace_secs=grace_secs)
    data_workers = early_isolation.local_data_workers(args)
    with _SignalCatcher() as signals:
        attempt = 0
        while True:
            cluster = build_cluster(num_workers, num_ps, free_ports)
            service = build_service_cluster(data_workers, free_ports) if data_workers else {}
            code = _run_group(cluster, service, args, options, signals)
            # A user mistake (exit 2) would fail the same way again, and a task stopped by Ctrl-C
            # (130) was asked to stop, so either ends the run.
            if code in (0, USER_ERROR_EXIT, INTERRUPTED_EXIT) or signals.received or attempt == max_restarts:
                return code
            attempt += 1
            _log(f"restarting group ({attempt}/{max_restarts})")


def _check_options(num_workers: int, num_ps: int, max_restarts: int, grace_secs: float) -> None:
    if num_workers < 1:
        raise UserError(f"--num_workers must be at least 1, got {num_workers}; pass --num_workers=N")
    if num_ps < 0:
        raise UserError(f"--num_ps must be 0 or more, got {num_ps}; pass --num_ps=0 for no ps")
    if max_restarts < 0:
        raise UserError(f"--max_restarts must be 0 or more, got {max_restarts}")
    if grace_secs < 0:
        raise UserError(f"--grace_secs must be 0 or more, got {grace_secs}")


class _SignalCatcher:
    """Records SIGINT/SIGTERM for the supervision loop instead of raising mid-way."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.count = 0
        self._previous: dict = {}

    def __enter__(self) -> "_SignalCatcher":
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _record(self, signum: int, frame: object) -> None:
        self.received = self.received or signum
        self.count += 1


class _Task:
    """One task's process, in its own process group, with its output copied under a prefix."""

    def __init__(self, task_type: str, task_id: int, command: list[str], tf_config: str, env: dict[str, str]):
        self.task_type = task_type
        self.name = f"{task_type} {task_id}"
        env = {**os.environ, **env, "TF_CONFIG": tf_config, "PYTHONUNBUFFERED": "1"}
        pipes = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
        self.process = subprocess.Popen(command, env=env, start_new_session=True, **pipes)
        self._copier = threading.Thread(target=_copy_lines, args=(self.process.stdout, f"[{self.name}] "), daemon=True)
        self._copier.start()

    def poll(self) -> int | None:
        return self.process.poll()

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def reap(self) -> None:
        self.process.wait()
        self._copier.join(timeout=5)


def _run_group(cluster: dict, service: dict, args: Sequence[str], options: Options, signals: _SignalCatcher) -> int:
    """Runs the training `cluster` and, if any, a tf.data `service` cluster beside it."""
    count = sum(map(len, cluster.values())) + sum(map(len, service.values()))
    _log(f"starting {count} tasks: {json.dumps({**cluster, **service})}")
    env = {ADDRESS_ENV: service_address(service)} if service else {}
    tasks: list[_Task] = []
    try:
        for task_type, task_id in [(t, i) for t, addresses in service.items() for i in range(len(addresses))]:
            server = [sys.executable, "-m", options.server_module]
            tasks.append(_Task(task_type, task_id, server, tf_config_for(service, task_type, task_id), env))
        for task_type, addresses in cluster.items():
            for task_id in range(len(addresses)):
                command = command_for(cluster, task_type, args, options)
                tf_config = tf_config_for(cluster, task_type, task_id)
                tasks.append(_Task(task_type, task_id, command, tf_config, env))
        training = [task for task in tasks if task.task_type not in service]
        watched = [task for task in tasks if task.task_type == "chief"] or training
        return _supervise(tasks, watched, signals, options.grace_secs)
    finally:
        _kill(tasks)


def _supervise(tasks: list[_Task], watched: list[_Task], signals: _SignalCatcher, grace_secs: float) -> int:
    """Waits until the watched tasks all succeed, any task fails, or a signal arrives."""
    while True:
        if signals.received == signal.SIGINT:
            # Ctrl-C reaches the tasks that train (not the servers their variables live on), which
            # save, however long that takes, and the chief says so in one line (trainer.main), so
            # the launcher adds none; a second Ctrl-C ends them at once.
            _stop(watched, signal.SIGINT, None, signals)
            _stop(tasks, signal.SIGTERM, grace_secs)
            return 128 + signal.SIGINT
        if signals.received:
            _log(f"got {signal.Signals(signals.received).name}; stopping all tasks")
            _stop(tasks, signals.received, grace_secs, signals)
            return 128 + signals.received
        failed = next((task for task in tasks if task.poll() not in (None, 0)), None)
        # A server (ps mode) ends only when stopped (trainer.server exits 0 on SIGTERM): the chief would
        # wait on it for ever, or on fewer workers, so the group ends and restarts whole.
        stopped = next((task for task in tasks if task not in watched and task.poll() == 0), None)
        if stopped and not failed:
            _log(f"{stopped.name} stopped while the chief runs; stopping the other tasks")
            _stop(tasks, signal.SIGTERM, grace_secs)
            return 1
        if failed:
            code = failed.poll()
            _log(f"{failed.name} exited with code {code}; stopping the other tasks")
            _stop(tasks, signal.SIGTERM, grace_secs)
            return code if code > 0 else 128 - code  # -N: killed by signal N.
        if all(task.poll() == 0 for task in watched):
            if any(task.poll() is None for task in tasks):
                _log("chief done; stopping the servers")
            _stop(tasks, signal.SIGTERM, grace_secs)
            return 0
        time.sleep(_POLL_SECS)


def _stop(tasks: list[_Task], signum: int, grace_secs: float | None, signals: _SignalCatcher | None = None) -> None:
    """Sends `signum` to every running task, waits up to grace_secs (None: as long as they take)
    or until another signal reaches the launcher, then kills the rest."""
    for task in tasks:
        if task.poll() is None:
            task.signal_group(signum)
    seen = signals.count if signals else 0
    deadline = None if grace_secs is None else time.monotonic() + grace_secs
    while any(task.poll() is None for task in tasks):
        if signals and signals.count > seen:
            _log(f"got {signal.Signals(signals.received).name} again; killing all tasks without waiting")
            break
        if deadline is not None and time.monotonic() >= deadline:
            break
        time.sleep(_POLL_SECS)
    _kill(tasks)


def _kill(tasks: list[_Task]) -> None:
    """SIGKILLs every task's process group (also what a task left behind) and reaps it."""
    for task in tasks:
        task.signal_group(signal.SIGKILL)
    for task in tasks:
        task.reap()


def _copy_lines(stream: IO[bytes], prefix: str) -> None:
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with _OUTPUT_LOCK:
                print(prefix + line, flush=True)


def _log(message: str) -> None:
    with _OUTPUT_LOCK:
        print(f"[launch] {message}", file=sys.stderr, flush=True)


def _parse_flags(argv: list[str]) -> list[str]:
    """Parses the launcher's flags (before `--`); returns the module's flags (after it)."""
    split = argv.index("--") if "--" in argv else len(argv)
    own, passthrough = argv[:split], argv[split + 1 :]
    for arg in own[1:]:  # a module's flag before `--` (absl would only say "Unknown command line flag")
        name = arg.lstrip("-").split("=", 1)[0]
        if arg.startswith("-") and name not in flags.FLAGS and name.removeprefix("no") not in flags.FLAGS:
            _exit_user_error(
                f"{arg.split('=', 1)[0]} is not a flag of trainer.launch; the flags of the module it runs "
                f"(--module, default trainer.main: --gin_file, --gin_bindings, --model_dir, ...) go after `--`: "
                f"python -m trainer.launch --num_workers=N -- {arg}"
            )
    unparsed = parse_flags(own)
    if unparsed[1:]:
        _exit_user_error(f"unexpected argument(s) {unparsed[1:]}; put the module's flags after --")
    return passthrough


def _exit_user_error(message: str) -> NoReturn:
    """The `error:` line and exit 2 of every entry point's refusal, for the launcher's own mistakes."""
    fail(" ".join(message.split()), exit_code=USER_ERROR_EXIT)


def _define_flags() -> None:
    """Defined only when run as a program, so importing `launch` leaves absl's FLAGS alone."""
    flags.DEFINE_integer("num_workers", None, "Worker tasks (without ps, worker 0 is the chief).", required=True)
    flags.DEFINE_integer("num_ps", 0, "Parameter servers; > 0 adds a chief that runs --module.")
    flags.DEFINE_integer("max_restarts", 0, "Times the group is restarted after a task fails.")
    flags.DEFINE_string("module", "trainer.main", "Module run with the flags after `--`.")
    flags.DEFINE_string("server_module", "trainer.server", "Module of ps and workers in ps mode.")
    flags.DEFINE_float(
        "grace_secs",
        10.0,
        "Seconds tasks get after SIGTERM before SIGKILL (after Ctrl-C the "
        "training tasks get as long as their save takes; a second Ctrl-C kills them).",
    )


def main(passthrough: list[str]) -> int:
    values = flags.FLAGS
    # Before any task (and any thread) starts: the tasks, and the ports picked for them,
    # are then in a network namespace with only loopback (docs/design.md, rule 12).
    netns.isolate("the local cluster of trainer.launch")
    try:
        return launch(
            values.num_workers,
            values.num_ps,
            passthrough,
            module=values.module,
            server_module=values.server_module,
            max_restarts=values.max_restarts,
            grace_secs=values.grace_secs,
        )
    except UserError as error:
        _exit_user_error(str(error))


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=_parse_flags)
