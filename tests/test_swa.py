"""The worked example of a user extension, experiments/swa (stochastic weight averaging), as a user
runs it: under one device, mirrored and 2 MultiWorkerMirrored workers; killed with SIGKILL at a
random step after its first checkpoint and restarted, its averaged weights end bit for bit as an
uninterrupted run's; refused in one line under parameter_server; exported when asked."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import numpy as np
import pytest

from tests.support import REPO, launch_workers, main_in_one_process, read_jsonl, refused_run, run_main, subprocess_env
from tests.test_multiworker import model_weights
from tests.test_resume import held_at, kill_group, wait_for_step

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

SWA = "--gin_file=experiments/swa/swa.gin"
SHORT = [
    f"--gin_bindings={b}"
    for b in (
        "train.total_steps=120",
        "train.eval_every_steps=40",
        "train.checkpoint_every_steps=40",
        "train.log_every_steps=1",
        "train.steps_per_loop=20",
        "swa.start_step=40",
        "swa.every_steps=10",
    )
]


def averages(model_dir: str) -> dict[str, np.ndarray]:
    """The SWA means in model_dir's newest checkpoint, by checkpoint key."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(model_dir))
    keys = [k for k in reader.get_variable_to_shape_map() if k.startswith("swa/means/")]
    assert keys, "no SWA means in the checkpoint"
    return {k: reader.get_tensor(k) for k in keys}


def swa_evals(model_dir: str) -> list[int]:
    return [r["step"] for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "eval_swa"]


def mirrored_args(model_dir: str) -> list[str]:
    return ["--gin_file=gin/mirrored.gin", SWA, f"--model_dir={model_dir}", *SHORT]


EXPORTED = ["--gin_bindings=swa.export=True", "--gin_bindings=train.export_saved_model=True"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, dict]:
    """The uninterrupted mirrored run (checked like the single-device one, and the killed run's reference:
    first, as a fresh process runs it), one device, and one device exporting, in one interpreter
    (main_in_one_process: one TensorFlow start instead of three). (their folder, outcomes by name);
    each run's model_dir is <folder>/<name>."""
    root = str(tmp_path_factory.mktemp("swa"))
    cases = {
        "mirrored": ["--gin_file=gin/mirrored.gin", SWA, *SHORT],
        "single": ["--gin_file=gin/single.gin", SWA, *SHORT],
        "exported": ["--gin_file=gin/single.gin", SWA, *SHORT, *EXPORTED],
    }
    return root, main_in_one_process({name: (args, os.path.join(root, name)) for name, args in cases.items()})


def ran(runs: tuple[str, dict], name: str) -> tuple[str, str]:
    """The model_dir and stdout of run `name`, checked to have exited 0."""
    root, outcomes = runs
    assert outcomes[name]["code"] == 0, outcomes[name]["stderr"][-3000:]
    return os.path.join(root, name), outcomes[name]["stdout"]


@pytest.mark.timeout(400)
@pytest.mark.xdist_group("swa_runs")
@pytest.mark.parametrize("mode", ["single", "mirrored"])
def test_swa_trains_and_evaluates_beside_the_raw_weights(runs, mode):
    model_dir, stdout = ran(runs, mode)
    assert swa_evals(model_dir) == [40, 80, 120]  # after every raw eval once it holds a snapshot
    assert "eval (SWA) at step 120" in stdout
    means, raw = averages(model_dir), model_weights(model_dir)
    assert len(means) == len(raw) and not any(np.array_equal(m, r) for m in means.values() for r in raw.values())


@pytest.mark.timeout(500)
def test_swa_under_two_multiworker_mirrored_workers(tmp_path):
    model_dir = str(tmp_path / "run")
    launch_workers("--gin_file=gin/mwms.gin", SWA, f"--model_dir={model_dir}", *SHORT, timeout=450)
    assert swa_evals(model_dir) == [40, 80, 120]
    assert averages(model_dir)


@pytest.mark.timeout(600)
@pytest.mark.xdist_group("swa_runs")
def test_killed_and_restarted_swa_averages_match_an_uninterrupted_run_bit_for_bit(runs, tmp_path):
    reference_dir, resumed_dir = ran(runs, "mirrored")[0], str(tmp_path / "resumed")
    kill_at = random.Random().randint(41, 110)  # after the first checkpoint (40), before the end
    first = subprocess.Popen(
        [sys.executable, "-m", "trainer.main", *mirrored_args(resumed_dir), *held_at(kill_at, "@swa()")],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_step(resumed_dir, kill_at, first)
    finally:
        kill_group(first)
    restart = run_main(*mirrored_args(resumed_dir), timeout=280)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert "continuing from step" in restart.stdout, (kill_at, restart.stdout[-2000:])
    expected, got = averages(reference_dir), averages(resumed_dir)
    assert sorted(expected) == sorted(got)
    for key in expected:
        assert np.array_equal(expected[key], got[key]), (kill_at, key)  # bit for bit


@pytest.mark.timeout(200)
def test_swa_is_refused_under_parameter_server_in_one_line(tmp_path):
    error = refused_run(tmp_path, "--gin_file=gin/ps.gin", SWA, *SHORT, before_cluster=True)
    assert error.startswith("error: swa (train.extensions) is not supported with parameter_server"), error


@pytest.mark.timeout(400)
@pytest.mark.xdist_group("swa_runs")
def test_swa_weights_are_exported_when_asked(runs):
    model_dir, stdout = ran(runs, "exported")
    assert "exported SavedModel (SWA weights)" in stdout
    assert os.path.exists(os.path.join(model_dir, "export", "120", "saved_model.pb"))
