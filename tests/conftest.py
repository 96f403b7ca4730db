"""Fixtures shared across test files."""

from __future__ import annotations

import os
import sys

import pytest

from tests.listening import SampledRun, sampled
from tests.support import HIDDEN_FROM_LAUNCHED, LEAN_SITE, Main, run_main, subprocess_env


@pytest.fixture(scope="session", autouse=True)
def launched_processes_start_lean():
    """Every process a test starts imports TensorFlow without the test extra's matplotlib, IPython and
    scikit-learn, which Keras imports when present (tests/lean_site/sitecustomize.py says why). Set in the
    processes that run tests (a session fixture never runs in xdist's controller), so the test processes
    themselves keep them."""
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "TRAINER_TESTS_HIDDEN")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (LEAN_SITE, saved["PYTHONPATH"]) if p)
    os.environ["TRAINER_TESTS_HIDDEN"] = ",".join(HIDDEN_FROM_LAUNCHED)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def trained_single_dir(tmp_path_factory) -> str:
    """One short real run of gin/single.gin, shared by the tests that only read its output. They carry the
    xdist_group "single_runs" (with profiled_run's), so it runs once, not once per pytest-xdist worker."""
    model_dir = str(tmp_path_factory.mktemp("single"))
    proc = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.total_steps=60",
        "--gin_bindings=train.checkpoint_every_steps=30",
        "--gin_bindings=train.eval_every_steps=30",
        "--gin_bindings=train.log_every_steps=20",
        "--gin_bindings=train.steps_per_loop=25",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model_dir


@pytest.fixture(scope="session")
def profiled_run(tmp_path_factory):
    """One short run with the profiler hook on steps 7-13 and stdout to a pipe (not a
    terminal): shared by the progress, profiler, TensorBoard and plot tests, which carry the xdist_group
    "single_runs" (with trained_single_dir's), so it runs once. Returns (model_dir, the finished process)."""
    model_dir = str(tmp_path_factory.mktemp("observed") / "lr_0.002")
    proc = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.total_steps=40",
        "--gin_bindings=train.steps_per_loop=25",
        "--gin_bindings=train.log_every_steps=10",
        "--gin_bindings=train.eval_every_steps=20",
        "--gin_bindings=train.checkpoint_every_steps=40",
        "--gin_bindings=train.extensions=[@profiler_hook()]",
        "--gin_bindings=profiler_hook.steps=(7, 13)",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model_dir, proc


@pytest.fixture(scope="session")
def embedded_ps_run(tmp_path_factory) -> SampledRun:
    """One `trainer.main --gin_file=gin/ps.gin` run (no TF_CONFIG: an embedded 1 ps + 2 workers,
    600 steps) with the sidecar evaluator beside it, sampled for listening sockets while it trains:
    read by tests/test_ps.py (training, sidecar, servers stopped) and tests/test_network.py (closed
    to the network). Its tests carry the xdist_group "embedded_ps_run", so it runs once."""
    model_dir = tmp_path_factory.mktemp("embedded_ps") / "run"
    sidecar = Main(
        "--gin_file=gin/ps.gin",
        "--mode=eval_continuous",
        f"--model_dir={model_dir}",
        "--gin_bindings=eval_continuous.timeout_secs=200",
    )
    try:
        run = sampled(
            [sys.executable, "-m", "trainer.main", "--gin_file=gin/ps.gin", f"--model_dir={model_dir}"],
            model_dir,
            sidecar=sidecar,
        )
        run.sidecar_code = sidecar.finish(timeout=90)
    finally:
        sidecar.kill()
    return run


@pytest.fixture(scope="session")
def launched_mwms_run(tmp_path_factory) -> SampledRun:
    """One `trainer.launch --num_workers=2 -- --gin_file=gin/mwms.gin` run of 400 steps, with its own
    TMPDIR, sampled for listening sockets while it trains: read by tests/test_multiworker.py (only the
    chief writes, nothing left behind) and tests/test_network.py (closed to the network). Its tests
    carry the xdist_group "launched_mwms_run", so it runs once."""
    root = tmp_path_factory.mktemp("launched_mwms")
    scratch = root / "tmp"
    scratch.mkdir()
    model_dir = root / "run"
    return sampled(
        [
            sys.executable,
            "-m",
            "trainer.launch",
            "--num_workers=2",
            "--",
            "--gin_file=gin/mwms.gin",
            f"--model_dir={model_dir}",
            "--gin_bindings=train.total_steps=400",
        ],
        model_dir,
        env=subprocess_env(TMPDIR=str(scratch)),
        scratch=scratch,
    )
