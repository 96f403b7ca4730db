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
