"""The worked examples of other tasks (experiments/regression, two_inputs, text) train to their
quality under every kind of strategy, from their own gin files, and the dict-input model resumes
exactly after a SIGKILL.

One device runs in this process (gin parsed here, cleared after); the others need fresh processes
(logical CPUs are split before TensorFlow starts; workers and ps tasks are processes of their own).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import gin
import pytest

from tests.support import REPO, read_jsonl, subprocess_env
from tests.test_ps import assert_all_gone, server_pids
from tests.test_resume import held_at, kill_group, per_step_losses, wait_for_step

# The module-scoped fixture below is shared by this file's tests: one worker runs them all.
pytestmark = pytest.mark.xdist_group("examples_a")

EXAMPLES = ("regression", "two_inputs", "text")
STEPS = 100
SHORT = [
    f"train.total_steps={STEPS}",
    f"train.eval_every_steps={STEPS}",
    f"train.checkpoint_every_steps={STEPS}",
    "train.log_every_steps=50",
]
# The dict-input mirrored run logs every step, so that it is also the reference for the resume test.
PER_STEP = [
    f"train.total_steps={STEPS}",
    f"train.eval_every_steps={STEPS}",
    "train.checkpoint_every_steps=20",
    "train.log_every_steps=1",
]


def gin_files(mode: str, example: str) -> list[str]:
    return [f"gin/{mode}.gin", f"experiments/{example}/{example}.gin"]


def final_eval(model_dir: str) -> dict:
    evals = [r for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == "eval"]
    assert evals and evals[-1]["step"] == STEPS, evals
    return evals[-1]


def assert_quality(example: str, model_dir: str) -> None:
    """Measured at step 100 (README): mse 0.555 against the mean predictor's 0.831; accuracy 0.92 and 1.0."""
    metrics = final_eval(model_dir)
    if example == "regression":
        assert metrics["mse"] < 0.75 * metrics["baseline_mse"], metrics
    else:
        assert metrics["accuracy"] > {"two_inputs": 0.85, "text": 0.9}[example], metrics


def main_flags(mode: str, example: str, model_dir: str, bindings: list[str]) -> list[str]:
    return [
        *(f"--gin_file={f}" for f in gin_files(mode, example)),
        f"--model_dir={model_dir}",
        *(f"--gin_bindings={b}" for b in bindings),
    ]


def run_in_group(args: list[str], timeout: float, *, full: bool = False) -> tuple[int, str]:
    """`python args...` in a session of its own, so that every process it starts dies with it at the end;
    `full`: with the packages launched processes start without (the regression example reads scikit-learn's data)."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=subprocess_env(full=full),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return proc.returncode, output


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_trains_to_quality_on_one_device(example, tmp_path, clean_gin):
    from trainer import configurables

    gin.add_config_file_search_path(REPO)
    gin.parse_config_files_and_bindings(gin_files("single", example), SHORT, finalize_config=False)
    configurables.train(model_dir=str(tmp_path), print_fn=lambda line: None)
    assert_quality(example, str(tmp_path))


@pytest.fixture(scope="module")
def mirrored_dirs(tmp_path_factory) -> dict[str, str]:
    """One mirrored run of each example (2 logical CPUs), each in a fresh process."""
    dirs = {}
    for example in EXAMPLES:
        model_dir = str(tmp_path_factory.mktemp(f"mirrored_{example}"))
        bindings = PER_STEP if example == "two_inputs" else SHORT
        args = ["-m", "trainer.main", *main_flags("mirrored", example, model_dir, bindings)]
        code, output = run_in_group(args, 120, full=example == "regression")
        assert code == 0, output[-3000:]
        assert "on 2 replica(s)" in output, output[-3000:]
        dirs[example] = model_dir
    return dirs


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_trains_to_quality_mirrored(example, mirrored_dirs):
    assert_quality(example, mirrored_dirs[example])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_dict_model_on_two_multi_worker_mirrored_workers(tmp_path):
    model_dir = str(tmp_path / "run")
    code, output = run_in_group(
        ["-m", "trainer.launch", "--num_workers=2", "--", *main_flags("mwms", "two_inputs", model_dir, SHORT)], 150
    )
    assert code == 0, output[-3000:]
    assert "on 2 replica(s) (2 worker(s))" in output and "[worker 1] finished at step 100/100" in output, output[-3000:]
    assert_quality("two_inputs", model_dir)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_regression_on_the_embedded_parameter_server_cluster(tmp_path):
    model_dir = str(tmp_path / "run")
    code, output = run_in_group(
        ["-m", "trainer.main", *main_flags("ps", "regression", model_dir, SHORT)], 150, full=True
    )
    assert code == 0, output[-3000:]
    assert "strategy 'parameter_server' on 1 replica(s) (2 worker(s))" in output, output[-3000:]
    assert_all_gone(server_pids(output))
    assert_quality("regression", model_dir)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_killed_dict_model_resumes_exactly_mirrored(tmp_path, mirrored_dirs):
    """SIGKILL after the first checkpoint, the same command again: the same per-step losses, bit for bit."""
    model_dir = str(tmp_path / "resumed")
    args = ["-m", "trainer.main", *main_flags("mirrored", "two_inputs", model_dir, PER_STEP)]
    kill_at = random.Random("two_inputs").randint(21, STEPS - 8)
    first = subprocess.Popen(
        [sys.executable, *args, *held_at(kill_at)],
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_step(model_dir, kill_at, first)
    finally:
        kill_group(first)
    code, output = run_in_group(args, 120)
    assert code == 0, output[-3000:]
    restored = int(output.split("continuing from step ")[1].split()[0])
    assert 20 <= restored < kill_at  # the first checkpoint, or a later one before the step it was held at

    expected, got = per_step_losses(mirrored_dirs["two_inputs"]), per_step_losses(model_dir)
    assert sorted(expected) == list(range(1, STEPS + 1)) and sorted(got) == sorted(expected)
    for step in range(restored + 1, STEPS + 1):
        assert got[step] == expected[step], (step, got[step], expected[step])
    assert_quality("two_inputs", model_dir)
