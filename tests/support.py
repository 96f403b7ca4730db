"""Test helpers: run the real entry points in fresh subprocesses with hard timeouts."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_module(module: str, *args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repo root; the child is killed at `timeout`."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO, env=env or subprocess_env(), capture_output=True, text=True, timeout=timeout,
    )


def run_main(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_module("trainer.main", *args, timeout=timeout, env=env)


def run_python(code: str, *, timeout: float = 240) -> dict:
    """Runs `code` in a fresh interpreter (so it can split the CPU into logical devices first).

    The code prints one JSON object as its last stdout line; that object is returned.
    """
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=subprocess_env(),
        capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


def refused_run(tmp_path, *args: str, timeout: float = 150) -> str:
    """Runs trainer.main on an empty `tmp_path/run` and returns the one `error:` line of its refusal,
    after checking it is one: exit 2, that line last on stderr and the only one, the directory still
    empty (refused before anything was written)."""
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    proc = run_main(*args, f"--model_dir={model_dir}", timeout=timeout)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1], proc.stderr[-3000:]
    assert tree_digest(str(model_dir)) == {}
    return errors[0]


def write_idx(path, magic: int, array: np.ndarray) -> None:
    """A gzipped idx file as Fashion-MNIST ships them (magic 2051 images, 2049 labels)."""
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())
