"""Local clusters are closed to the network (docs/design.md, rule 12), seen from the host.

A real embedded ParameterServer run and a real 2-worker `trainer.launch` run: while they
train, the listening TCP sockets of every process of the run are sampled from /proc. In the
host's network namespace (this test's) there must be none; in the run's own namespace the
servers do listen (so the samples were taken while the cluster was up). Each run has a
hard timeout, and every process it started is killed in a `finally`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.support import REPO, subprocess_env
from trainer.distribution import netns

_WHY_NOT = netns.can_enter()
needs_namespaces = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no private network namespace: {_WHY_NOT}")

TIMEOUT_SECS = 180
STEPS = 200
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
                inodes.add(int(target[len("socket:["):-1]))
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


def run_sampled(command: list[str]) -> tuple[subprocess.CompletedProcess, Sampler]:
    proc = subprocess.Popen(command, cwd=REPO, env=subprocess_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
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


def assert_closed(result: subprocess.CompletedProcess, sampler: Sampler, model_dir: Path) -> None:
    assert result.returncode == 0, result.stdout[-4000:]
    assert "Traceback" not in result.stdout and "warning:" not in result.stdout, result.stdout[-4000:]
    assert sampler.in_run_namespace, "no server of the run was seen listening"
    assert not sampler.on_host, f"listening in the host's network namespace: {sampler.on_host}"
    assert os.readlink("/proc/self/ns/net") not in sampler.listening_namespaces
    # The files keep the invoking user's ownership (the user namespace maps it onto itself).
    assert (model_dir / "metrics.jsonl").stat().st_uid == os.getuid()


@needs_namespaces
def test_embedded_ps_cluster_listens_only_in_its_own_namespace(tmp_path):
    model_dir = tmp_path / "ps"
    result, sampler = run_sampled([
        sys.executable, "-m", "trainer.main", "--gin_file=gin/ps.gin", f"--model_dir={model_dir}",
        f"--gin_bindings=train.total_steps={STEPS}",
    ])
    assert_closed(result, sampler, model_dir)
    assert "local cluster: ps 0 pid" in result.stdout
    assert f"step {STEPS}/{STEPS}" in result.stdout
    assert len(sampler.in_run_namespace) >= 4, sampler.in_run_namespace  # chief, ps, 2 workers


@needs_namespaces
def test_a_ps_run_its_flags_do_not_reveal_is_reexecuted_into_the_namespace(tmp_path):
    # trainer.main's first-line check reads --gin_file and --gin_bindings, not an absl
    # --flagfile: the process has loaded TensorFlow when it learns it coordinates an
    # embedded cluster, so it re-executes itself (same pid, same flags) into the namespace.
    flagfile = tmp_path / "ps.flags"
    flagfile.write_text(f"--gin_file=gin/ps.gin\n--gin_bindings=train.total_steps={STEPS // 2}\n")
    model_dir = tmp_path / "ps"
    result, sampler = run_sampled([
        sys.executable, "-m", "trainer.main", f"--flagfile={flagfile}", f"--model_dir={model_dir}",
    ])
    assert_closed(result, sampler, model_dir)
    assert result.stdout.count("local cluster: ps 0 pid") == 1


@needs_namespaces
def test_launched_workers_listen_only_in_their_own_namespace(tmp_path):
    model_dir = tmp_path / "mwms"
    result, sampler = run_sampled([
        sys.executable, "-m", "trainer.launch", "--num_workers=2", "--",
        "--gin_file=gin/mwms.gin", f"--model_dir={model_dir}", f"--gin_bindings=train.total_steps={STEPS}",
    ])
    assert_closed(result, sampler, model_dir)
    assert f"finished at step {STEPS}/{STEPS}" in result.stdout
    assert len(sampler.in_run_namespace) >= 2, sampler.in_run_namespace  # one server per worker


def test_a_process_that_cannot_enter_warns_once_and_goes_on():
    # A process that already runs a thread cannot enter a user namespace: the fallback path.
    code = textwrap.dedent("""
        import threading, time
        from trainer.distribution import netns
        threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
        print(netns.isolate("the test cluster"), netns.isolate("the test cluster"))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: the test cluster is reachable from the network"), lines
    assert "threads" in lines[0] and "firewall" in lines[0]
