"""Models that build on their first call (a subclassed keras.Model, a Sequential without an Input)
train under one device, mirrored and 2 MultiWorkerMirrored workers, resume exactly after SIGKILL,
and pass trainer.parity against Keras fit under mirrored: the loop builds them by a call on a
batch of zeros of the train features before the optimizer and the checkpoint exist."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from tests.support import REPO, launch_workers, main_in_one_process, run_module, subprocess_env
from tests.test_resume import held_at, kill_group, per_step_losses, wait_for_step

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

IMPORT = "--gin_bindings=import tests.unbuilt_models"
SHORT = [
    f"--gin_bindings={b}"
    for b in (
        "train.total_steps=40",
        "train.eval_every_steps=20",
        "train.checkpoint_every_steps=20",
        "train.log_every_steps=1",
        "train.steps_per_loop=10",
    )
]
MODELS = ["residual_mlp", "sequential_without_input"]


def flags(gin_file: str, model: str) -> list[str]:
    return [f"--gin_file={gin_file}", IMPORT, f"--gin_bindings=train.model_fn=@{model}", *SHORT]


@pytest.fixture(scope="module")
def replica_runs(tmp_path_factory) -> tuple[str, dict]:
    """Both models on one device and mirrored, in one interpreter (main_in_one_process: one TensorFlow start
    instead of four). Mirrored first: TensorFlow splits the CPU before its first run; mirrored residual_mlp
    is also the killed run's reference, uninterrupted. (their folder, outcomes by "mode/model"); each run's
    model_dir is <folder>/<mode>/<model>."""
    root = str(tmp_path_factory.mktemp("unbuilt"))
    cases = {
        f"{mode}/{model}": (flags(f"gin/{mode}.gin", model), os.path.join(root, mode, model))
        for mode in ("mirrored", "single")
        for model in MODELS
    }
    return root, main_in_one_process(cases)


@pytest.mark.timeout(400)
@pytest.mark.xdist_group("unbuilt_replica_runs")
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["single", "mirrored"])
def test_unbuilt_models_train_on_one_and_two_replicas(replica_runs, model, mode):
    outcome = replica_runs[1][f"{mode}/{model}"]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    eval_line = [line for line in outcome["stdout"].splitlines() if line.startswith("eval at step 40")]
    assert eval_line and float(eval_line[0].split("accuracy ")[1].split()[0]) > 0.5, outcome["stdout"][-2000:]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model", MODELS)
def test_unbuilt_models_train_on_two_multiworker_mirrored_workers(tmp_path, model):
    proc = launch_workers(*flags("gin/mwms.gin", model), f"--model_dir={tmp_path / 'run'}", timeout=350)
    assert "[worker 0] eval at step 40" in proc.stdout


@pytest.mark.timeout(500)
@pytest.mark.xdist_group("unbuilt_replica_runs")
def test_a_killed_run_of_an_unbuilt_model_resumes_bit_for_bit(replica_runs, tmp_path):
    command = [sys.executable, "-m", "trainer.main", *flags("gin/mirrored.gin", "residual_mlp")]
    resumed = str(tmp_path / "resumed")
    kill_at = random.Random().randint(21, 36)
    first = subprocess.Popen(
        [*command, f"--model_dir={resumed}", *held_at(kill_at)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_step(resumed, kill_at, first)
    finally:
        kill_group(first)
    restart = subprocess.run(
        [*command, f"--model_dir={resumed}"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=250,
    )
    assert restart.returncode == 0 and "continuing from step 20" in restart.stdout, restart.stderr[-3000:]
    root, outcomes = replica_runs
    assert outcomes["mirrored/residual_mlp"]["code"] == 0, outcomes["mirrored/residual_mlp"]["stderr"][-3000:]
    expected, got = per_step_losses(os.path.join(root, "mirrored", "residual_mlp")), per_step_losses(resumed)
    assert [got[s] for s in range(21, 41)] == [expected[s] for s in range(21, 41)]  # bit for bit, dropout included


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", MODELS)
def test_unbuilt_models_match_keras_fit_under_mirrored(model):
    proc = run_module(
        "trainer.parity",
        "--gin_file=gin/mirrored.gin",
        IMPORT,
        f"--gin_bindings=train.model_fn=@{model}",
        "--steps=5",
        timeout=250,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout, proc.stdout[-2000:]
