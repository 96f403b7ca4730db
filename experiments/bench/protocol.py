"""The conversation between the parent and a worker: JSON lines with a prefix on the worker's
stdout (everything else it prints there, and its stderr, go to its log), commands as JSON lines on its stdin.

The parent asks "run until step N" (`{"until": N}`) or "finish" (`{"until": null}`); the worker
answers `ready` after its first call, `chunk` after each request (the chunk's wall and CPU seconds,
from the request's arrival to the answer, its page faults, the CPU the rest of the machine used
meanwhile, the work it did besides its steps and, where the worker can tell, the seconds inside its
compiled step calls), `finished`
(compile count, peak memory) or `error` (one line). Between its answer and the next request a
worker waits; the parent stops it there (SIGSTOP, SIGCONT before the request), so that none of its
threads (TensorFlow's pools, a checkpoint writer, Keras' callback thread) runs while another
variant is measured.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time

from experiments.bench import probes

PREFIX = "@bench "
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # `-m experiments.bench` runs here
PARENT_ENV = "TRAINER_BENCH_PARENT"  # the parent's pid, for a worker to die with it
PR_SET_PDEATHSIG = 1  # linux/prctl.h

# glibc's malloc returns freed memory to the kernel (it trims its heaps and unmaps large blocks), and
# TensorFlow frees and allocates the step's tensors every step, on many threads, each with its own
# heap: every step then faults its pages in again (on this VM 0.2-0.4 million page faults in a
# 9-s chunk of the mirrored CNN, a fifth of its time). How often that happens depends on which
# thread got which heap, so it differs from process to process: two processes of the same variant
# ran 5% apart. These settings keep freed memory in the process (no trimming; blocks up to 32 MiB,
# glibc's largest, from the heap rather than mmap), the same in every worker.
KEEP_FREED_MEMORY = (
    "glibc.malloc.trim_threshold=4294967295:glibc.malloc.mmap_threshold=33554432:glibc.malloc.top_pad=67108864"
)


def with_tunables(current: str, tunables: str) -> str:
    """`GLIBC_TUNABLES` with `tunables` added to `current` (the environment's); a tunable set in both
    keeps the environment's value."""
    present = {item.split("=", 1)[0] for item in current.split(":") if item}
    added = [item for item in tunables.split(":") if item and item.split("=", 1)[0] not in present]
    return ":".join([item for item in current.split(":") if item] + added)


def die_with_parent() -> None:
    """Has the kernel kill this worker (SIGKILL) when its parent dies, however it dies: a parent killed
    with SIGKILL runs no `finally`, and a worker stopped for its turn would otherwise wait forever. Linux
    only; elsewhere the parent's SIGTERM handling is all there is."""
    parent = os.environ.get(PARENT_ENV)
    if not sys.platform.startswith("linux") or not parent:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != int(parent):  # the parent died before the prctl: nobody will ask for anything
        raise SystemExit("bench: the parent went away")


class Channel:
    """A worker's side of the conversation; `done` counts the steps run so far."""

    def __init__(self):
        self.done = 0
        self._started = self._cpu_started = self._machine_started = self._steal_started = 0.0
        self._faults_started = 0

    @staticmethod
    def send(**message) -> None:
        sys.stdout.write(PREFIX + json.dumps(message) + "\n")
        sys.stdout.flush()

    @staticmethod
    def receive() -> dict:
        line = sys.stdin.readline()
        if not line:
            raise SystemExit("bench: the parent went away")
        return json.loads(line)

    def _next(self) -> int | None:
        """Waits for the next request; the chunk it asks for starts when it arrives."""
        until = self.receive().get("until")
        self._machine_started, self._steal_started = probes.machine_cpu_seconds()
        self._faults_started = probes.page_faults()
        self._started, self._cpu_started = time.monotonic(), time.process_time()
        return until

    def ready(self) -> int:
        """Reports the first call (and the machine) and returns the step to run to next."""
        self.send(event="ready", steps=self.done, machine=probes.machine())
        return self._next()

    def chunk_done(self, step_seconds: float | None = None, **work: int) -> int | None:
        """Reports the chunk since the last request (`step_seconds`: how long of it the worker spent in
        its compiled step calls, None where it cannot tell; `work`: what it did besides its steps, by
        kind, e.g. checkpoints=1); returns the step to run to next, or None when told to finish."""
        seconds, cpu = time.monotonic() - self._started, time.process_time() - self._cpu_started
        machine, steal = probes.machine_cpu_seconds()
        self.send(
            event="chunk",
            steps=self.done,
            seconds=seconds,
            cpu_seconds=cpu,
            work=work,
            step_seconds=step_seconds,
            page_faults=probes.page_faults() - self._faults_started,
            other_cpu_seconds=max(0.0, machine - self._machine_started - cpu),
            steal_seconds=steal - self._steal_started,
        )
        return self._next()

    def finished(self, compile_count: int | None) -> None:
        self.send(
            event="finished",
            compile_count=compile_count,
            peak_rss_mib=probes.peak_rss_mib(),
            peak_gpu_mib=probes.peak_gpu_mib(),
        )


class WorkerError(Exception):
    """A worker that failed, exited or did not answer in time (the message says which)."""


class Worker:
    """The parent's side: one `python -m experiments.bench --role=...` process, its stderr in `log_path`,
    `malloc_tunables` added to its GLIBC_TUNABLES (empty: the environment's as it is)."""

    def __init__(self, args: list[str], log_path: str, timeout: float, malloc_tunables: str = ""):
        self.log_path, self.timeout = log_path, timeout
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "experiments.bench", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            cwd=REPO,
            env=self.environment(malloc_tunables),
        )
        self.pending = b""
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.process.stdout, selectors.EVENT_READ)

    @staticmethod
    def environment(malloc_tunables: str) -> dict[str, str]:
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        if tunables := with_tunables(os.environ.get("GLIBC_TUNABLES", ""), malloc_tunables):
            env["GLIBC_TUNABLES"] = tunables
        return env

    def receive(self) -> dict:
        """The next message; other lines on the worker's stdout (Orbit prints its progress there) go to its log.
        Lines are split here from raw reads: a buffered readline could hold the message while select waits."""
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\n" not in self.pending:
                if not self.selector.select(timeout=max(0.0, deadline - time.monotonic())):
                    raise WorkerError(f"no answer within {self.timeout:.0f} s")
                data = os.read(self.process.stdout.fileno(), 1 << 16)
                if not data:
                    code = self.process.wait()
                    raise WorkerError(f"exited with code {code} ({self.log_tail()})")
                self.pending += data
            raw, self.pending = self.pending.split(b"\n", 1)
            line = raw.decode(errors="replace")
            if not line.startswith(PREFIX):
                self.log.write(line + "\n")
                continue
            message = json.loads(line[len(PREFIX) :])
            if message["event"] == "error":
                raise WorkerError(message["message"])
            return message

    def send(self, **command) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def pause(self) -> None:
        """Stops the whole process (every thread) until `resume`."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, signum: int) -> None:
        if self.process.poll() is None:
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:  # exited since poll
                pass

    def cpu_seconds(self) -> float:
        """The worker's CPU time so far, user and system, every thread (0 once it has exited)."""
        try:
            with open(f"/proc/{self.process.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def log_tail(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[-1] if lines else "no output"

    def close(self) -> None:
        self.resume()  # a stopped worker would never read the end of its input
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()
