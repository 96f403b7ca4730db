"""The SLURM examples under a real SLURM controller: a one-node cluster on this machine.

experiments/cluster/slurm/local_slurm.py starts munged, slurmctld and slurmd in a private
network namespace once for the module; every job goes through sbatch, as on a cluster: the
2-task MultiWorkerMirrored job (experiments/cluster/slurm/mwms.sbatch) against a
`trainer.launch` run of the same gin, the same job preempted with SIGTERM after its first
checkpoint and requeued, and the ParameterServer job (ps.sbatch). After every job nothing of
it may still run in the cluster's namespace; after the module the cluster itself is stopped
and nothing of it is left. Runs where slurm-wlm and munge are installed, as root (slurmd runs
jobs as their user); skipped with the reason elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.listening import listening
from tests.support import REPO, launch_workers, read_jsonl, subprocess_env
from tests.test_resume import per_step_losses

SCRIPT = os.path.join(REPO, "experiments", "cluster", "slurm", "local_slurm.py")
_spec = importlib.util.spec_from_file_location("local_slurm", SCRIPT)
local_slurm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(local_slurm)


def _why_not() -> str | None:
    if sys.platform != "linux":
        return f"SLURM's daemons run on Linux (this is {sys.platform})"
    missing = [tool for tool in (*local_slurm.TOOLS, "sbatch", "scontrol") if shutil.which(tool) is None]
    if missing:
        return (
            f"slurm-wlm and munge are not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge"
        )
    if os.geteuid() != 0:
        return "the local SLURM cluster must be started as root"
    return None


# One worker runs this file: its tests share one SLURM cluster (a module-scoped fixture).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_why_not() is not None, reason=f"no local SLURM cluster: {_why_not()}"),
    pytest.mark.xdist_group("slurm"),
]

STEPS = 150
FIRST_CHECKPOINT = 25
# Logged every step, so that the preempted job's per-step losses can be compared with these.
MWMS_BINDINGS = [
    f"train.total_steps={STEPS}",
    f"train.checkpoint_every_steps={FIRST_CHECKPOINT}",
    f"train.eval_every_steps={STEPS}",
    "train.log_every_steps=1",
]
PS_STEPS = 60
PS_BINDINGS = [
    f"train.total_steps={PS_STEPS}",
    f"train.checkpoint_every_steps={PS_STEPS}",
    f"train.eval_every_steps={PS_STEPS}",
    "train.log_every_steps=20",
]
DONE_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
JOB_TIMEOUT_SECS = 400  # a loaded machine (other jobs on its 2 cores) takes twice the usual 100 s
EVENT_FILE_PID = re.compile(r"events\.out\.tfevents\.\d+\.localhost\.(\d+)\.")  # TensorFlow names them so
# A base port with `count` free ports above it, found in the cluster's own network namespace.
_FREE_PORTS = """
import portpicker, sys
count = int(sys.argv[1])
while True:
    base = portpicker.pick_unused_port()
    if base + count <= 60000 and all(portpicker.is_port_free(base + i) for i in range(count)):
        print(base)
        break
"""


def listening_ports(net_dir: str) -> set[int]:
    """Ports with a listening TCP socket in the network namespace that `net_dir` shows."""
    return {int(address.rpartition(":")[2], 16) for address in listening(net_dir).values()}


class Cluster:
    """The running `local_slurm.py up DIR` and what the tests ask of it."""

    def __init__(self, directory: str):
        self.directory = directory
        self.state = local_slurm.read_state(directory)
        self.jobs_dir = os.path.join(directory, "jobs")
        os.makedirs(self.jobs_dir)

    def run(self, *command: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        """`command` in the cluster's network namespace (sbatch, scontrol, ... reach slurmctld there)."""
        return subprocess.run(
            [sys.executable, SCRIPT, "run", self.directory, "--", *command],
            cwd=REPO,
            env=env or subprocess_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def free_port_base(self, count: int) -> int:
        proc = self.run(sys.executable, "-c", _FREE_PORTS, str(count))
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout)

    def submit(self, script: str, name: str, args: list[str], *, ports: int, sbatch: tuple = ()) -> "Job":
        """sbatch `script` from the repository root, its model_dir and temp dir under the job's own dir."""
        job_dir = os.path.join(self.jobs_dir, name)
        os.makedirs(os.path.join(job_dir, "tmp"))
        port_base = self.free_port_base(ports)
        env = subprocess_env(
            PYTHON=sys.executable,
            MODEL_DIR=os.path.join(job_dir, "model"),
            PORT_BASE=str(port_base),
            TMPDIR=os.path.join(job_dir, "tmp"),
        )
        proc = self.run(
            "sbatch",
            "--parsable",
            f"--chdir={REPO}",
            f"--output={job_dir}/%j.out",
            *sbatch,
            f"experiments/cluster/slurm/{script}",
            *args,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        return Job(self, proc.stdout.strip().split(";")[0], job_dir, range(port_base, port_base + ports))

    def leftovers(self, grace_secs: float = 15) -> list[str]:
        """What still runs in the cluster's namespace besides `up` and its daemons (job steps,
        servers) once `grace_secs` have passed: their command lines."""
        ours = {self.state["pid"], *self.state["daemons"].values()}
        deadline = time.monotonic() + grace_secs
        while (left := [p for p in local_slurm.processes_in(self.state["netns"]) if p not in ours]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.2)
        return [_command_line(pid) for pid in left]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except OSError:
        return None


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid}: (gone)"


class Job:
    def __init__(self, cluster: Cluster, job_id: str, job_dir: str, ports: range):
        self.cluster, self.id, self.dir, self.ports = cluster, job_id, job_dir, ports
        self.model_dir = os.path.join(job_dir, "model")

    def info(self) -> dict[str, str]:
        """`scontrol show job -o`'s fields (JobState, Restarts, ExitCode, ...)."""
        proc = self.cluster.run("scontrol", "show", "job", "-o", self.id)
        assert proc.returncode == 0, proc.stderr
        return dict(field.split("=", 1) for field in proc.stdout.split() if "=" in field)

    def wait(self, timeout: float = JOB_TIMEOUT_SECS) -> dict[str, str]:
        """Waits until the job has ended for good (a requeued one runs again first)."""
        deadline = time.monotonic() + timeout
        while (info := self.info())["JobState"] not in DONE_STATES:
            assert time.monotonic() < deadline, f"job {self.id} still {info['JobState']} after {timeout:.0f} s"
            time.sleep(1)
        return info

    def task_pids(self, count: int, timeout: float = 120) -> dict[int, int]:
        """SLURM task id -> pid of step 0's tasks, once all `count` run (scontrol listpids, which
        also lists what a task has started, under the task's id: the task is the one whose parent
        is not listed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.cluster.run("scontrol", "listpids", f"{self.id}.0")
            rows = [line.split() for line in proc.stdout.splitlines()[1:]]
            listed = {int(row[0]): int(row[4]) for row in rows if len(row) == 5 and row[4].isdigit()}
            pids = {task: pid for pid, task in listed.items() if _parent(pid) not in listed}
            if len(pids) == count:
                return pids
            time.sleep(0.2)
        raise AssertionError(
            f"job {self.id}: {count} tasks not running after {timeout} s: {proc.stdout} "
            f"{self.info()['JobState']} {self.output()[-2000:]}"
        )

    def output(self) -> str:
        with open(os.path.join(self.dir, f"{self.id}.out"), errors="replace") as f:
            return f.read()

    def records(self, split: str) -> list[dict]:
        return [r for r in read_jsonl(os.path.join(self.model_dir, "metrics.jsonl")) if r["split"] == split]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One cluster for the module; stopped by PID at the end, and nothing of it may be left."""
    directory = str(tmp_path_factory.mktemp("slurm") / "cluster")
    process = subprocess.Popen(
        [sys.executable, SCRIPT, "up", directory],
        cwd=REPO,
        env=subprocess_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:
            output.append(line)
            if line.startswith(local_slurm.READY):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not ready.wait(0.2):
            assert process.poll() is None, "".join(output)
            assert time.monotonic() < deadline, "cluster not ready after 90 s:\n" + "".join(output)
        started = Cluster(directory)
        yield started
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=90)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            reader.join(timeout=5)
    assert process.returncode == 0, "".join(output)
    assert not local_slurm.processes_in(started.state["netns"]), "left running in the cluster's namespace"


@pytest.fixture(scope="module")
def mwms_job(cluster):
    """The 2-task MultiWorkerMirrored job, run to its end: (job, its task pids, its final info)."""
    job = cluster.submit("mwms.sbatch", "mwms", [f"--gin_bindings={b}" for b in MWMS_BINDINGS], ports=2)
    pids = job.task_pids(2)
    # The tasks' TensorFlow servers listen on all addresses, but only in the cluster's namespace.
    deadline = time.monotonic() + 120
    while not set(job.ports) <= (seen := listening_ports(f"/proc/{pids[0]}/net")):
        assert time.monotonic() < deadline, (
            f"no TensorFlow servers on {list(job.ports)} (listening: {seen}; "
            f"{job.info()['JobState']}) {job.output()[-2000:]}"
        )
        time.sleep(0.1)
    assert not set(job.ports) & listening_ports("/proc/self/net")
    info = job.wait()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, job.output()[-4000:])
    assert not cluster.leftovers()
    return job, pids, info


@pytest.mark.timeout(900)
def test_mwms_job_trains_on_both_tasks_only_task_0_writes_and_matches_trainer_launch(mwms_job, tmp_path):
    job, pids, info = mwms_job
    output = job.output()
    for task in (0, 1):
        assert (
            f"{task}: training Sequential with strategy 'multi_worker_mirrored' on 2 replica(s) (2 worker(s))" in output
        )
    assert re.search(rf"^0: eval at step {STEPS}: ", output, re.M) and not re.search(r"^1: eval at", output, re.M)
    assert info["Restarts"] == "0"
    # Only task 0 (worker 0, the chief) wrote model_dir: every event file there carries its pid,
    # every step is logged once, and task 1's own saves went to temp dirs it removed again.
    events = [name for _, _, names in os.walk(job.model_dir) for name in names if name.startswith("events.out")]
    writers = {int(m.group(1)) for name in events if (m := EVENT_FILE_PID.match(name))}
    assert len(events) == 4 and writers == {pids[0]}, (events, pids)  # 4: workers, the worker watch's
    assert [r["step"] for r in job.records("train")] == list(range(1, STEPS + 1))
    assert os.path.exists(os.path.join(job.model_dir, f"ckpt-{STEPS}.index"))
    assert not os.listdir(os.path.join(job.dir, "tmp"))

    launched_dir = str(tmp_path / "launched")
    launch_workers(
        "--gin_file=gin/mwms.gin",
        f"--model_dir={launched_dir}",
        *(f"--gin_bindings={b}" for b in MWMS_BINDINGS),
        timeout=300,
    )
    expected = [r for r in read_jsonl(os.path.join(launched_dir, "metrics.jsonl")) if r["split"] == "eval"][-1]
    got = job.records("eval")[-1]
    assert got["step"] == expected["step"] == STEPS
    assert abs(got["accuracy"] - expected["accuracy"]) <= 0.01, (got, expected)


@pytest.mark.timeout(900)
def test_a_job_preempted_with_sigterm_is_requeued_and_continues_exactly(cluster, mwms_job):
    uninterrupted = per_step_losses(mwms_job[0].model_dir)
    job = cluster.submit("mwms.sbatch", "preempted", [f"--gin_bindings={b}" for b in MWMS_BINDINGS], ports=2)
    first_checkpoint = os.path.join(job.model_dir, f"ckpt-{FIRST_CHECKPOINT}.index")
    deadline = time.monotonic() + JOB_TIMEOUT_SECS
    while not os.path.exists(first_checkpoint):
        assert job.info()["JobState"] in ("PENDING", "RUNNING"), job.output()[-4000:]
        assert time.monotonic() < deadline, "no first checkpoint"
        time.sleep(0.05)
    cancel = cluster.run("scancel", "--signal=TERM", job.id)
    assert cancel.returncode == 0, cancel.stderr
    info = job.wait()
    output = job.output()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, output[-4000:])
    assert info["Restarts"] == "1"

    saved = re.findall(r"^([01]): preempted: saved ckpt-(\d+);", output, re.M)
    assert sorted(task for task, _ in saved) == ["0", "1"] and len({step for _, step in saved}) == 1, output[-4000:]
    saved_step = int(saved[0][1])
    assert FIRST_CHECKPOINT <= saved_step < STEPS
    assert f"preempted: requeueing job {job.id}" in output and f"job {job.id} (restart 1)" in output
    assert f"0: restored {job.model_dir}/ckpt-{saved_step}; continuing from step {saved_step}" in output
    # metrics.jsonl: the first run's steps up to the saved one, then the requeued run's, each once.
    assert [r["step"] for r in job.records("train")] == list(range(1, STEPS + 1))
    resumed = per_step_losses(job.model_dir)
    after = range(saved_step + 1, STEPS + 1)
    assert [resumed[step] for step in after] == [uninterrupted[step] for step in after]
    assert job.records("eval")[-1]["accuracy"] == mwms_job[0].records("eval")[-1]["accuracy"]
    assert not cluster.leftovers()


@pytest.mark.timeout(600)
def test_parameter_server_job_splits_its_tasks_by_the_resolvers_jobs_and_completes(cluster):
    job = cluster.submit(
        "ps.sbatch", "ps", [f"--gin_bindings={b}" for b in PS_BINDINGS], ports=4, sbatch=("--overcommit",)
    )  # 4 tasks on a node of 2 CPUs
    info = job.wait()
    output = job.output()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, output[-4000:])
    # The resolver orders its jobs by name: task 0 chief, 1 ps, 2-3 workers.
    for task, server in ((1, "ps 0"), (2, "worker 0"), (3, "worker 1")):
        assert re.search(rf"^{task}: server {server} \(pid \d+\) listening at localhost:\d+$", output, re.M), output
        assert f"{task}: server {server} stopped" in output
    assert "0: training Sequential with strategy 'parameter_server' on 1 replica(s) (2 worker(s))" in output
    assert f"0: eval at step {PS_STEPS}: " in output
    assert os.path.exists(os.path.join(job.model_dir, f"ckpt-{PS_STEPS}.index"))
    assert not cluster.leftovers()
