"""Fixtures shared across test files."""
from __future__ import annotations

import pytest

from tests.support import run_main


@pytest.fixture(scope="session")
def trained_single_dir(tmp_path_factory) -> str:
    """One short real run of gin/single.gin, shared by the tests that only read its output."""
    model_dir = str(tmp_path_factory.mktemp("single"))
    proc = run_main(
        "--gin_file=gin/single.gin", f"--model_dir={model_dir}",
        "--gin_bindings=train.total_steps=60", "--gin_bindings=train.checkpoint_every_steps=30",
        "--gin_bindings=train.eval_every_steps=30", "--gin_bindings=train.log_every_steps=20",
        "--gin_bindings=train.steps_per_loop=25",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model_dir


@pytest.fixture(scope="session")
def profiled_run(tmp_path_factory):
    """One short run with the profiler hook on steps 7-13 and stdout to a pipe (not a
    terminal): shared by the progress, profiler, TensorBoard and plot tests.
    Returns (model_dir, the finished process)."""
    model_dir = str(tmp_path_factory.mktemp("observed") / "lr_0.002")
    proc = run_main(
        "--gin_file=gin/single.gin", f"--model_dir={model_dir}",
        "--gin_bindings=train.total_steps=40", "--gin_bindings=train.steps_per_loop=25",
        "--gin_bindings=train.log_every_steps=10", "--gin_bindings=train.eval_every_steps=20",
        "--gin_bindings=train.checkpoint_every_steps=40",
        "--gin_bindings=train.hooks=[@profiler_hook()]", "--gin_bindings=profiler_hook.steps=(7, 13)",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model_dir, proc
