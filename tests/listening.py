"""Real runs watched from the host: what every process of a run listens on, sampled from /proc.

Also the two runs that several test files read (tests/conftest.py): an embedded ParameterServer
run with the sidecar evaluator beside it, and a 2-worker `trainer.launch` run, each started once
and sampled while it trains, so that the training checks and the network checks share one
cluster start.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from tests.support import REPO, subprocess_env

TIMEOUT_SECS = 180
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def listening(net_dir: str) -> dict[int, str]:
    """Socket inode -> 'address:port' of every listening TCP socket in that namespace."""
    found = {}
    for name in ("tcp", "tcp6"):
        path = Path(net_dir, name)
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == _LISTEN:
                found[int(fields[9])] = fields[1]
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    except OSError:  # the process (or the fd) went away meanwhile
        pass
    return inodes


def descendants(root: int) -> set[int]:
    """`root` and every process below it (tasks of trainer.launch have their own sessions)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


class Sampler:
    """Samples the run's listening sockets, on the host and in its own namespace."""

    def __init__(self, root: int):
        self.root = root
        self.seen_pids: set[int] = set()
        self.on_host: set[str] = set()
        self.in_run_namespace: set[str] = set()
        self.listening_namespaces: set[str] = set()  # of the processes seen listening

    def sample(self) -> None:
        host = listening("/proc/self/net")
        for pid in descendants(self.root):
            self.seen_pids.add(pid)
            inodes = socket_inodes(pid)
            try:
                namespace = os.readlink(f"/proc/{pid}/ns/net")
                own = listening(f"/proc/{pid}/net")
            except OSError:
                continue
            self.on_host |= {f"pid {pid} {host[i]}" for i in inodes if i in host}
            if own_listening := {f"pid {pid} {own[i]}" for i in inodes if i in own}:
                self.in_run_namespace |= own_listening
                self.listening_namespaces.add(namespace)


def run_sampled(command: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, Sampler]:
    """Runs `command` (its stderr into its stdout) in its own session, sampling what it listens on
    until it ends; whatever it started is killed afterwards."""
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=env or subprocess_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    sampler = Sampler(proc.pid)
    deadline = time.monotonic() + TIMEOUT_SECS
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, "run timed out:\n" + "".join(output)[-4000:]
            sampler.sample()
            time.sleep(0.1)
        reader.join(timeout=10)
        return subprocess.CompletedProcess(command, proc.returncode, "".join(output)), sampler
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the launcher ends its tasks on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for pid in sampler.seen_pids:  # also tasks in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


@dataclasses.dataclass
class SampledRun:
    """A finished run: its directory, its process (stdout holds stderr too) and what was sampled."""

    model_dir: Path
    result: subprocess.CompletedProcess
    sampler: Sampler
    seconds: float
    sidecar: object = None  # the sidecar evaluator that ran beside it, finished (tests/test_ps.py's Main)
    sidecar_code: int | None = None
    scratch: Path | None = None  # the run's TMPDIR


def sampled(command: list[str], model_dir: Path, env: dict | None = None, **extra) -> SampledRun:
    started = time.monotonic()
    result, sampler = run_sampled(command, env=env)
    return SampledRun(model_dir, result, sampler, time.monotonic() - started, **extra)
