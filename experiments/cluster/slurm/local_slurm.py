"""A one-node SLURM cluster on this machine, closed to the network, for trying SLURM jobs.

    python experiments/cluster/slurm/local_slurm.py up DIR               (as root; Ctrl-C stops it)
    python experiments/cluster/slurm/local_slurm.py run DIR -- sbatch experiments/cluster/slurm/mwms.sbatch
    python experiments/cluster/slurm/local_slurm.py down DIR

A batch script's first real run should not be on a shared cluster. `up` writes a minimal
slurm.conf for this host (one node, `localhost`, with this machine's CPUs; one partition,
`debug`) and everything SLURM keeps (state, spool, logs, the MUNGE key and socket) into DIR,
then starts munged, slurmctld and slurmd in the foreground as its own children, waits until
`sinfo` shows the node idle, writes their PIDs to DIR/cluster.json and stays until SIGTERM or
SIGINT. Then it cancels every job, stops the daemons by PID (SIGTERM, SIGKILL after a grace
period), kills by PID whatever else still runs in the cluster's namespace (job steps), reaps
it all and exits. `down` sends that SIGTERM and waits for `up` to end.

Nothing it starts can be reached from the network: `up` moves itself into a network namespace
of its own (root needs no user namespace for that) whose only interface is `lo`, and a UTS
namespace whose host name is `localhost`, and every daemon, job step and TensorFlow server
inherits both. `run` executes a command in that network namespace (`nsenter`), so sbatch,
squeue, scancel and scontrol reach slurmctld; nothing outside it can, nor can anything in it
reach out. The daemons also bind to the loopback address only
(CommunicationParameters=NoCtldInAddrAny,NoInAddrAny), as they would without the namespace.

`lo` gets a second address, 127.0.0.2: SLURM resolves names with getaddrinfo(AF_INET,
AI_ADDRCONFIG), which glibc answers "Name or service not known" on a machine whose only IPv4
address is 127.0.0.1.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time

NODE = "localhost"
PARTITION = "debug"
DAEMONS = ("munged", "slurmctld", "slurmd")
TOOLS = (*DAEMONS, "sinfo", "squeue", "scancel", "nsenter")
READY = "local SLURM cluster ready"
STATE_FILE = "cluster.json"
START_TIMEOUT_SECS = 60.0
GRACE_SECS = 10.0

_CLONE_NEWUTS = 0x04000000
_CLONE_NEWNET = 0x40000000
_PR_SET_CHILD_SUBREAPER = 36
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _SIOCSIFADDR = 0x8913, 0x8914, 0x8916
_IFF_UP = 0x1

SLURM_CONF = """\
# Written by experiments/cluster/slurm/local_slurm.py: one node, one partition, no accounting.
ClusterName=trainer-local
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
SrunPortRange=60001-63000
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket={dir}/run/munge.socket,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Pending jobs (a requeued one, once cred_expire has passed) are tried every 2 s, not every 30-60 s.
SchedulerParameters=sched_interval=2,bf_interval=2
# On a loaded machine slurmd can take over 10 s (the default) to answer; a message that timed out
# is sent again later, and a retried signal for a requeued job would hit its next run.
MessageTimeout=60
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
NodeName={node} NodeHostname={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class ClusterError(Exception):
    """The cluster cannot start here, or failed while starting (the message says why)."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="action", required=True)
    up_parser = commands.add_parser("up", help="start the cluster and run until SIGTERM/SIGINT")
    up_parser.add_argument("dir", help="an empty or new directory for its config, state and logs")
    run_parser = commands.add_parser("run", help="run a command in the cluster's network namespace")
    run_parser.add_argument("dir")
    run_parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- sbatch ...")
    down_parser = commands.add_parser("down", help="stop the cluster that `up DIR` runs")
    down_parser.add_argument("dir")
    args = parser.parse_args(argv)
    directory = os.path.abspath(args.dir)
    try:
        if args.action == "up":
            return up(directory)
        if args.action == "run":
            run(directory, args.argv[1:] if args.argv[:1] == ["--"] else args.argv)
        return down(directory)
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2


def up(directory: str) -> int:
    """Starts the cluster, serves until SIGTERM or SIGINT, then stops everything it started."""
    _check_can_start(directory)
    stop = _StopOnSignal()
    _enter_private_namespaces()
    _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphaned job steps are ours to reap
    cluster = _Cluster(directory)
    try:
        cluster.start(stop)
        print(
            f"{READY}: node {NODE} ({os.cpu_count()} CPUs), partition {PARTITION}, "
            f"SLURM_CONF={cluster.conf}; pids {json.dumps(cluster.pids)}",
            flush=True,
        )
        while not stop.received:
            cluster.check_alive()
            cluster.reap_orphans()
            time.sleep(0.2)
        return 0
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        cluster.stop()


def run(directory: str, command: list[str]) -> None:
    """Replaces this process by `command` in the cluster's network and UTS namespaces, SLURM_CONF set."""
    if not command:
        raise ClusterError("run needs a command: local_slurm.py run DIR -- sinfo")
    state = read_state(directory)
    os.environ["SLURM_CONF"] = state["slurm_conf"]
    namespaces = [f"--{kind}=/proc/{state['pid']}/ns/{kind}" for kind in ("net", "uts")]
    os.execvp("nsenter", ["nsenter", *namespaces, "--", *command])


def down(directory: str) -> int:
    """SIGTERM to the `up` process of `directory`; returns once it has ended."""
    state = read_state(directory)
    os.kill(state["pid"], signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECS * 4
    while _running(state["pid"]):
        if time.monotonic() > deadline:
            raise ClusterError(f"the cluster's process {state['pid']} did not end after SIGTERM")
        time.sleep(0.1)
    return 0


def read_state(directory: str) -> dict:
    """DIR/cluster.json of a running `up`: its pid, namespace, daemon pids and SLURM_CONF."""
    path = os.path.join(directory, STATE_FILE)
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise ClusterError(
            f"no cluster runs in {directory} ({path} is missing); start one with local_slurm.py up {directory}"
        ) from None
    if not _running(state["pid"]) or _namespace(state["pid"]) != state["netns"]:
        raise ClusterError(f"the cluster of {directory} is not running; start it with local_slurm.py up {directory}")
    return state


def processes_in(netns: str) -> list[int]:
    """Every live process (not a zombie) in the network namespace `netns` ('net:[...]')."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _namespace(int(name)) == netns and _running(int(name)):
            found.append(int(name))
    return found


class _StopOnSignal:
    """Records SIGTERM/SIGINT; `up` stops the cluster at its next check."""

    def __init__(self) -> None:
        self.received: int | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame: object) -> None:
        self.received = signum


class _Cluster:
    """The daemons of one `up`, started in order and stopped in reverse."""

    def __init__(self, directory: str):
        self.directory = directory
        self.conf = os.path.join(directory, "slurm.conf")
        self.netns = _namespace(os.getpid())
        self._daemons: dict[str, subprocess.Popen] = {}
        self._helpers: dict[str, int] = {}  # slurmctld's own child, slurmscriptd

    @property
    def pids(self) -> dict[str, int]:
        return {**{name: daemon.pid for name, daemon in self._daemons.items()}, **self._helpers}

    def start(self, stop: _StopOnSignal) -> None:
        for sub in ("state", "spool", "log", "run"):
            os.makedirs(os.path.join(self.directory, sub), mode=0o700, exist_ok=True)
        key = os.path.join(self.directory, "run", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        with open(self.conf, "w") as f:
            f.write(SLURM_CONF.format(dir=self.directory, node=NODE, cpus=os.cpu_count(), partition=PARTITION))
        run_dir = os.path.join(self.directory, "run")
        self._start(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={run_dir}/munge.socket",
                f"--pid-file={run_dir}/munged.pid",
                f"--seed-file={run_dir}/munged.seed",
                f"--log-file={self.directory}/log/munged.log",
            ],
        )
        self._wait(lambda: os.path.exists(f"{run_dir}/munge.socket"), "munged's socket", stop)
        self._start("slurmctld", ["slurmctld", "-D", "-f", self.conf])
        self._start("slurmd", ["slurmd", "-D", "-f", self.conf, "-N", NODE])
        self._wait(self._node_idle, f"node {NODE} to be idle in sinfo", stop)
        daemon_pids = {daemon.pid for daemon in self._daemons.values()}
        for pid in processes_in(self.netns):
            fields = _stat_fields(pid)
            if fields is not None and int(fields[1]) in daemon_pids:
                self._helpers[_command_name(pid)] = pid
        state = {
            "pid": os.getpid(),
            "netns": self.netns,
            "slurm_conf": self.conf,
            "node": NODE,
            "partition": PARTITION,
            "daemons": self.pids,
        }
        path = os.path.join(self.directory, STATE_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)

    def check_alive(self) -> None:
        for name, daemon in self._daemons.items():
            if daemon.poll() is not None:
                raise ClusterError(f"{name} exited with code {daemon.returncode}: {self._log_tail(name)}")

    def reap_orphans(self) -> None:
        """Waits for the exited processes that were re-parented to us (job steps' slurmstepd)."""
        mine = set(self.pids.values())
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in mine and _zombie_child_of(int(name), os.getpid()):
                try:
                    os.waitpid(int(name), os.WNOHANG)
                except ChildProcessError:
                    pass

    def stop(self) -> None:
        """Jobs cancelled, daemons stopped in reverse order, then anything left in the namespace."""
        if os.path.exists(os.path.join(self.directory, STATE_FILE)):
            os.remove(os.path.join(self.directory, STATE_FILE))
        if all(d.poll() is None for d in self._daemons.values()) and len(self._daemons) == len(DAEMONS):
            self._cancel_jobs()
        for name in reversed(list(self._daemons)):
            self._end(self._daemons[name])
        for pid in processes_in(self.netns):
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # ended meanwhile
        deadline = time.monotonic() + GRACE_SECS
        while [p for p in processes_in(self.netns) if p != os.getpid()] and time.monotonic() < deadline:
            self.reap_orphans()
            time.sleep(0.1)
        self.reap_orphans()

    def _start(self, name: str, command: list[str]) -> None:
        log = open(os.path.join(self.directory, "log", f"{name}.out"), "wb")
        with log:
            self._daemons[name] = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "SLURM_CONF": self.conf},
                start_new_session=True,
            )

    def _wait(self, ready, what: str, stop: _StopOnSignal) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECS
        while not ready():
            self.check_alive()
            if stop.received:
                raise ClusterError(f"stopped by signal {stop.received} while waiting for {what}")
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"timed out after {START_TIMEOUT_SECS:.0f} s waiting for {what}; "
                    f"see the logs in {self.directory}/log"
                )
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        states = self._slurm(["sinfo", "--noheader", "--Node", "--format=%T"])
        return states is not None and states.split() == ["idle"]

    def _cancel_jobs(self) -> None:
        jobs = (self._slurm(["squeue", "--noheader", "--format=%i"]) or "").split()
        if jobs:
            self._slurm(["scancel", "--full", "--signal=KILL", *jobs])
            self._slurm(["scancel", *jobs])
        deadline = time.monotonic() + GRACE_SECS * 3
        while (self._slurm(["squeue", "--noheader", "--format=%i"]) or "").split():
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)

    def _slurm(self, command: list[str]) -> str | None:
        """A SLURM client command's stdout, or None if it failed."""
        proc = subprocess.run(
            command,
            env={**os.environ, "SLURM_CONF": self.conf},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return proc.stdout if proc.returncode == 0 else None

    def _end(self, daemon: subprocess.Popen) -> None:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=GRACE_SECS)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()

    def _log_tail(self, name: str) -> str:
        with open(os.path.join(self.directory, "log", f"{name}.out"), errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        return " | ".join(lines[-3:]) or "no output"


def _check_can_start(directory: str) -> None:
    if sys.platform != "linux":
        raise ClusterError(f"the local SLURM cluster needs Linux (this is {sys.platform})")
    if os.geteuid() != 0:
        raise ClusterError("the local SLURM cluster must be started as root (slurmd runs jobs as their user)")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise ClusterError(
            f"{', '.join(missing)} not found; install them with `apt-get install -y slurm-wlm munge` (Debian/Ubuntu)"
        )
    if os.path.isdir(directory) and os.listdir(directory):
        raise ClusterError(f"{directory} is not empty; give `up` a new or empty directory")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _enter_private_namespaces() -> None:
    """This process into a new network namespace (only `lo`, up, 127.0.0.1 and 127.0.0.2) and a
    new UTS namespace whose host name is NODE; its children inherit both."""
    libc = _libc()
    if libc.unshare(_CLONE_NEWNET | _CLONE_NEWUTS) != 0:
        raise ClusterError(f"unshare(CLONE_NEWNET|CLONE_NEWUTS) failed: {os.strerror(ctypes.get_errno())}")
    socket.sethostname(NODE)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))
        address = struct.pack("16sH2s4s8x", b"lo:1", socket.AF_INET, b"", socket.inet_aton("127.0.0.2"))
        fcntl.ioctl(sock, _SIOCSIFADDR, address)


def _namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, ...]; None once the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def _command_name(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def _running(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _zombie_child_of(pid: int, parent: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] == "Z" and int(fields[1]) == parent


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
