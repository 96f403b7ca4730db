"""Keras metrics the train step updates (trainer/extensions/train_metrics.py), as TensorFlow's "Custom training
with tf.distribute.Strategy" tutorial writes them (experiments/custom_training): the metric's `result()` at each
log interval is what metrics.jsonl and the console show, the same on one device, on two mirrored replicas and
on two MultiWorkerMirrored processes; under parameter_server a model holding metrics is refused in one line.
Small Fashion-MNIST idx files stand in for the real ones."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import launch_workers, main_in_one_process, read_jsonl, refused_run, write_idx

pytestmark = pytest.mark.xdist_group("train_metrics")

TUTORIAL = "experiments/custom_training/custom_training.gin"


def short(data_dir: str) -> list[str]:
    """The tutorial's config on 128 training images: an epoch of 4 steps of 32, 6 steps logged every 2."""
    return [
        f"--gin_bindings={b}"
        for b in (
            f"fashion_mnist.data_dir = '{data_dir}'",
            "train.global_batch_size = 32",
            "train.total_steps = 6",
            "train.steps_per_loop = 2",
            "train.log_every_steps = 2",
            "train.checkpoint_every_steps = 6",
            "train.eval_every_steps = 6",
        )
    ]


@pytest.fixture(scope="module")
def fashion_dir(tmp_path_factory) -> str:
    """Images whose bright rows depend on the class, so a few steps learn something."""
    directory = str(tmp_path_factory.mktemp("fashion"))
    rng = np.random.RandomState(0)
    for prefix, count in (("train", 128), ("t10k", 64)):
        labels = rng.randint(0, 10, count)
        images = rng.randint(0, 60, (count, 28, 28))
        for i, label in enumerate(labels):
            images[i, label * 2 : label * 2 + 8, :] += 190
        write_idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte.gz"), 2051, images)
        write_idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte.gz"), 2049, labels)
    return directory


def accuracies(model_dir: str) -> dict[int, float]:
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    return {r["step"]: r["train_accuracy"] for r in records if r["split"] == "train"}


@pytest.fixture(scope="module")
def local_runs(fashion_dir, tmp_path_factory) -> dict[str, tuple[dict, str]]:
    """The tutorial on two mirrored replicas, then on one device, in one interpreter (mirrored first: the
    default strategy leaves the split CPU as it is); by name, (outcome, model_dir)."""
    root = tmp_path_factory.mktemp("local_runs")
    gin_files = {"mirrored": "gin/mirrored.gin", "one_device": "gin/single.gin"}
    cases = {
        name: ([f"--gin_file={gin}", f"--gin_file={TUTORIAL}", *short(fashion_dir)], str(root / name))
        for name, gin in gin_files.items()
    }
    for _, model_dir in cases.values():
        os.makedirs(model_dir)
    outcomes = main_in_one_process(cases, timeout=280)
    return {name: (outcomes[name], model_dir) for name, (_, model_dir) in cases.items()}


@pytest.fixture(scope="module")
def one_device(local_runs) -> dict[int, float]:
    outcome, model_dir = local_runs["one_device"]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    stdout = outcome["stdout"]
    assert "train metrics train_accuracy: result() logged every 2 steps, reset every 4 steps (each epoch)" in stdout
    found = accuracies(model_dir)
    assert sorted(found) == [2, 4, 6] and len(set(found.values())) > 1, found
    assert f"train_accuracy {found[6]:.4f}" in stdout
    return found


def assert_same(found: dict[int, float], expected: dict[int, float], what: str) -> None:
    assert found.keys() == expected.keys(), (what, found)
    for step, value in expected.items():
        assert abs(found[step] - value) <= 1e-6, (what, step, found[step], value)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_tutorial_step_under_mirrored_logs_the_one_device_result(one_device, local_runs):
    outcome, model_dir = local_runs["mirrored"]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    assert "loss-scaling check passed" in outcome["stdout"]
    assert_same(accuracies(model_dir), one_device, "mirrored")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_tutorial_step_on_two_multiworker_processes_logs_the_one_device_result(one_device, fashion_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    launch_workers("--gin_file=gin/mwms.gin", f"--gin_file={TUTORIAL}", *short(fashion_dir), f"--model_dir={model_dir}")
    assert_same(accuracies(model_dir), one_device, "multi_worker_mirrored")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_under_parameter_servers_a_model_holding_metrics_is_refused_with_how_to_get_the_number(fashion_dir, tmp_path):
    error = refused_run(tmp_path, "--gin_file=gin/ps.gin", f"--gin_file={TUTORIAL}", *short(fashion_dir), timeout=250)
    assert error.startswith(
        "error: Keras metrics held by the model and updated in the train step (train_accuracy) is not supported "
        "with parameter_server"
    ), error
    assert "return the metric's share from the step" in error
