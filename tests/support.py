"""Test helpers: run the real entry points in fresh subprocesses with hard timeouts."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Processes the tests start import TensorFlow without these (tests/lean_site/sitecustomize.py; tests/conftest.py).
LEAN_SITE = os.path.join(REPO, "tests", "lean_site")
HIDDEN_FROM_LAUNCHED = ("matplotlib", "IPython", "sklearn", "scipy")


def subprocess_env(*, full: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts; `full` gives it the test extra's packages that launched
    processes start without (HIDDEN_FROM_LAUNCHED: matplotlib for trainer.plot, scikit-learn for the
    examples on its data sets)."""
    env = dict(os.environ)
    if full:
        env.pop("TRAINER_TESTS_HIDDEN", None)
    env.pop("TF_CONFIG", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_module(module: str, *args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repo root; the child is killed at `timeout`."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env or subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_main(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_module("trainer.main", *args, timeout=timeout, env=env)


def launch_workers(
    *main_args: str, num_workers: int = 2, timeout: float = 280, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m trainer.launch --num_workers=N -- main_args` from the repo root, killed at `timeout` like
    run_module, and checked to have exited 0 after training on N worker processes."""
    proc = run_module("trainer.launch", f"--num_workers={num_workers}", "--", *main_args, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"on {num_workers} replica(s) ({num_workers} worker(s))" in proc.stdout, proc.stdout[-3000:]
    return proc


def run_python(code: str, *, timeout: float = 240) -> dict:
    """Runs `code` in a fresh interpreter (so it can split the CPU into logical devices first).

    The code prints one JSON object as its last stdout line; that object is returned.
    """
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_MAIN_IN_ONE_PROCESS = """
import contextlib, io, json, sys, time, traceback
sys.argv = ["trainer.main"]
import gin
import keras
from absl import flags
from trainer import main as main_lib
from tests.support import tree_digest
{prelude}
main_lib.define_flags()
results = {{}}
for name, (args, model_dir) in json.loads({cases!r}).items():
    gin.clear_config()
    # Layer names as a fresh process gives them (the run record holds them). No gc.collect() each
    # time: it took 0.15 s a case.
    keras.backend.clear_session(free_memory=False)
    flags.FLAGS.unparse_flags()
    before = tree_digest(model_dir)
    err, out = io.StringIO(), io.StringIO()
    code, started = 0, time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main_lib.run(main_lib.parse_flags(["trainer.main", *args, "--model_dir=" + model_dir]))
        except SystemExit as e:
            code = e.code
        except BaseException:
            code = "uncaught"
            traceback.print_exc(file=err)
    results[name] = {{"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()[-5000:],
                     "unchanged": tree_digest(model_dir) == before, "seconds": time.monotonic() - started}}
print(json.dumps(results))
"""


def main_in_one_process(
    cases: dict[str, tuple[list[str], str]], *, prelude: str = "", timeout: float = 600
) -> dict[str, dict]:
    """trainer.main's own flag parsing and `run` for each case (name -> (arguments, model_dir)) in turn, in
    one fresh interpreter: one TensorFlow start for many refusals. `prelude` is code run before the first.
    Each case's outcome: its exit code ("uncaught" for an exception that escaped `run`), stderr, the tail
    of stdout, whether model_dir's files are byte for byte unchanged, and its seconds."""
    return run_python(_MAIN_IN_ONE_PROCESS.format(prelude=prelude, cases=json.dumps(cases)), timeout=timeout)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tree_digest(root: str) -> dict[str, str]:
    """Path -> sha256 of every file under root, to prove a failed run changed nothing."""
    digest = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                digest[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return digest


def refused_run(tmp_path, *args: str, timeout: float = 150, before_cluster: bool = False) -> str:
    """Runs trainer.main on an empty `tmp_path/run` and returns the one `error:` line of its refusal,
    after checking it is one: exit 2, that line last on stderr and the only one, the directory still
    empty (refused before anything was written) and, with `before_cluster`, no embedded cluster
    started for it."""
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    proc = run_main(*args, f"--model_dir={model_dir}", timeout=timeout)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1], proc.stderr[-3000:]
    assert tree_digest(str(model_dir)) == {}
    if before_cluster:  # a mistake in the settings alone starts no embedded cluster
        assert "local cluster:" not in proc.stdout, proc.stdout[-3000:]
    return errors[0]


def refused_in_one_process(tmp_path, cases: dict[str, list[str]], *, timeout: float = 300) -> dict[str, str]:
    """refused_run's checks for each case (name -> arguments), each on an empty `tmp_path/name`, all in one
    interpreter (main_in_one_process): exit 2, one `error:` line, last on stderr, no traceback, the
    directory still empty. Returns each case's error line."""
    for name in cases:
        (tmp_path / name).mkdir()
    outcomes = main_in_one_process({n: (args, str(tmp_path / n)) for n, args in cases.items()}, timeout=timeout)
    lines = {}
    for name, outcome in outcomes.items():
        stderr = outcome["stderr"]
        assert outcome["code"] == 2 and "Traceback" not in stderr, (name, stderr[-3000:])
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1], (name, stderr[-3000:])
        assert tree_digest(str(tmp_path / name)) == {}, name
        lines[name] = errors[0]
    return lines


def write_idx(path, magic: int, array: np.ndarray) -> None:
    """A gzipped idx file as Fashion-MNIST ships them (magic 2051 images, 2049 labels)."""
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def as_from_a_terminal() -> None:
    """A child's Ctrl-C and SIGTERM as a terminal gives them: delivered, default action. A disposition
    set to ignore, or a mask that blocks them, is inherited through exec; TensorFlow code run earlier in
    the same pytest worker may leave either behind, and the child would then train through a Ctrl-C."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


class Main:
    """`python -m trainer.main args` in its own session, its output collected line by line."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.main", *args],
            cwd=REPO,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=as_from_a_terminal,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._changed = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._changed:
                lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first stdout line matching `pattern`; fails if the process ends or time runs out."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.out:
                    if match := regex.search(line):
                        return match
                assert self.proc.poll() is None, f"exited {self.proc.returncode} before {pattern!r}: {self.tail()}"
                assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s: {self.tail()}"
                self._changed.wait(0.2)

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def kill(self) -> None:
        """SIGKILLs the whole session (the process and any server it started) if still there."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    @property
    def stdout(self) -> str:
        return "\n".join(self.out)

    @property
    def stderr(self) -> str:
        return "\n".join(self.err)

    def tail(self) -> str:
        return "\n".join(self.out[-10:] + self.err[-10:])
