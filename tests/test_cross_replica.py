"""Steps that talk across replicas (experiments/contrastive: negatives gathered with all_gather) train
in every synchronous mode, the same on 1 and 2 replicas, pass the loss-scaling guard (which still
stops such a step when it is mis-scaled), and are refused in one line under parameter_server."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import launch_workers, main_in_one_process, read_jsonl, refused_run, tree_digest
from tests.test_multiworker import model_weights

# The module-scoped fixture below is shared by this file's tests: one worker runs them all.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cross_replica")]

GIN = "--gin_file=experiments/contrastive/contrastive.gin"
SGD_30 = [
    f"--gin_bindings={b}"
    for b in (
        "train.total_steps=30",
        "train.eval_every_steps=30",
        "train.checkpoint_every_steps=30",
        "train.log_every_steps=10",
    )
]
PASSED = "loss-scaling check passed: the step depends on other replicas' examples"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, dict]:
    """This file's runs of trainer.main on one machine's devices, in one interpreter (main_in_one_process:
    one TensorFlow start instead of four), the 2-replica ones first (TensorFlow splits the CPU before its
    first run): mirrored and central storage, the mis-scaled step under mirrored (on an empty folder),
    and one device. (their folder, outcomes by name); each run's model_dir is <folder>/<name>."""
    root = tmp_path_factory.mktemp("contrastive")
    (root / "mis_scaled").mkdir()
    cases = {
        "mirrored": ["--gin_file=gin/mirrored.gin", GIN, *SGD_30],
        "central_storage": ["--gin_file=gin/central_storage.gin", GIN, *SGD_30],
        "mis_scaled": [
            "--gin_file=gin/mirrored.gin",
            GIN,
            "--gin_bindings=import tests.guard_steps",
            "--gin_bindings=train.step_fn=@contrastive_mean_step",
            *SGD_30,
        ],
        "single": ["--gin_file=gin/single.gin", GIN, *SGD_30],
    }
    return str(root), main_in_one_process({name: (args, str(root / name)) for name, args in cases.items()})


@pytest.fixture(scope="module")
def one_replica(runs) -> str:
    root, outcomes = runs
    assert outcomes["single"]["code"] == 0, outcomes["single"]["stderr"][-3000:]
    return os.path.join(root, "single")


def assert_same_weights(a: str, b: str) -> None:
    left, right = model_weights(a), model_weights(b)
    assert sorted(left) == sorted(right) and left
    for name in left:
        assert np.allclose(left[name], right[name], atol=1e-5, rtol=0), (name, np.abs(left[name] - right[name]).max())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["mirrored", "central_storage"])
def test_two_replicas_pass_the_guard_and_train_the_weights_of_one(runs, one_replica, mode):
    root, outcomes = runs
    model_dir, outcome = os.path.join(root, mode), outcomes[mode]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    assert PASSED in outcome["stdout"] and "on 2 replica(s)" in outcome["stdout"], outcome["stdout"][-3000:]
    assert_same_weights(one_replica, model_dir)
    evals = {r["split"]: r for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["step"] == 30}
    reference = {r["split"]: r for r in read_jsonl(os.path.join(one_replica, "metrics.jsonl")) if r["step"] == 30}
    assert abs(evals["eval"]["loss"] - reference["eval"]["loss"]) < 1e-4  # the eval step gathers too


@pytest.mark.timeout(400)
def test_two_multiworker_mirrored_workers_train_the_weights_of_one(one_replica, tmp_path):
    model_dir = str(tmp_path / "mwms")
    launch_workers("--gin_file=gin/mwms.gin", GIN, f"--model_dir={model_dir}", *SGD_30, timeout=350)
    assert_same_weights(one_replica, model_dir)


@pytest.mark.timeout(200)
def test_a_mis_scaled_step_that_gathers_is_still_stopped(runs):
    root, outcomes = runs
    outcome = outcomes["mis_scaled"]
    assert outcome["code"] == 2, outcome["stderr"][-3000:]
    last = outcome["stderr"].strip().splitlines()[-1]
    assert (
        last.startswith("error: loss scaling: step output 'loss' summed over 2 replicas is 2 times")
        and "per-replica mean instead of the global-batch share" in last
    ), last
    assert tree_digest(os.path.join(root, "mis_scaled")) == {}


@pytest.mark.timeout(200)
def test_parameter_server_refuses_a_cross_replica_call_in_one_line(tmp_path):
    error = refused_run(tmp_path, "--gin_file=gin/ps.gin", GIN, *SGD_30)
    assert (
        "calls get_replica_context().all_gather, a cross-replica call, which parameter_server does not support" in error
    ), error
