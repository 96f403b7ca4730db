"""The user's steps are converted by AutoGraph (the framework's own compiled code is not): a step and
an eval step with Python `for`/`while`/`if` on tensors train and evaluate, under one device and under
MirroredStrategy on 2 logical CPUs (its loss-scaling probe runs the step too)."""

from __future__ import annotations

import os

import pytest

from tests.support import read_jsonl, run_main

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long


@pytest.mark.parametrize("mode", ["single", "mirrored"])
def test_steps_that_branch_and_loop_on_tensors_train_and_evaluate(mode, tmp_path):
    gin_file = tmp_path / "branching.gin"
    gin_file.write_text(
        f"import tests.branching_steps\ninclude 'gin/{mode}.gin'\n"
        "train.step_fn = @branching_step\ntrain.eval_step_fn = @branching_eval_step\n"
    )
    model_dir = str(tmp_path / "run")
    proc = run_main(
        f"--gin_file={gin_file}",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.total_steps=6",
        "--gin_bindings=train.steps_per_loop=3",
        "--gin_bindings=train.log_every_steps=3",
        "--gin_bindings=train.eval_every_steps=6",
        "--gin_bindings=train.global_batch_size=32",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in train] == [3, 6] and [r["step"] for r in evals] == [6]
    for record in train + evals:  # the loop's count, from real label values, is the vectorised one
        assert 0 < record["high"] < 1 and record["high"] == pytest.approx(record["high_vectorised"], abs=1e-6)
