"""Steps that talk across replicas (experiments/contrastive: negatives gathered with all_gather) train
in every synchronous mode, the same on 1 and 2 replicas, pass the loss-scaling guard (which still
stops such a step when it is mis-scaled), and are refused in one line under parameter_server."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import launch_workers, read_jsonl, refused_run, run_main, tree_digest
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
def one_replica(tmp_path_factory) -> str:
    model_dir = str(tmp_path_factory.mktemp("contrastive") / "single")
    proc = run_main("--gin_file=gin/single.gin", GIN, f"--model_dir={model_dir}", *SGD_30, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return model_dir


def assert_same_weights(a: str, b: str) -> None:
    left, right = model_weights(a), model_weights(b)
    assert sorted(left) == sorted(right) and left
    for name in left:
        assert np.allclose(left[name], right[name], atol=1e-5, rtol=0), (name, np.abs(left[name] - right[name]).max())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["mirrored", "central_storage"])
def test_two_replicas_pass_the_guard_and_train_the_weights_of_one(one_replica, tmp_path, mode):
    model_dir = str(tmp_path / mode)
    proc = run_main(f"--gin_file=gin/{mode}.gin", GIN, f"--model_dir={model_dir}", *SGD_30, timeout=250)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert PASSED in proc.stdout and "on 2 replica(s)" in proc.stdout
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
def test_a_mis_scaled_step_that_gathers_is_still_stopped(tmp_path):
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    proc = run_main(
        "--gin_file=gin/mirrored.gin",
        GIN,
        "--gin_bindings=import tests.guard_steps",
        "--gin_bindings=train.step_fn=@contrastive_mean_step",
        f"--model_dir={model_dir}",
        *SGD_30,
        timeout=150,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: loss scaling: step output 'loss' summed over 2 replicas is 2 times")
        and "per-replica mean instead of the global-batch share" in last
    ), last
    assert tree_digest(str(model_dir)) == {}


@pytest.mark.timeout(200)
def test_parameter_server_refuses_a_cross_replica_call_in_one_line(tmp_path):
    error = refused_run(tmp_path, "--gin_file=gin/ps.gin", GIN, *SGD_30)
    assert (
        "calls get_replica_context().all_gather, a cross-replica call, which parameter_server does not support" in error
    ), error
