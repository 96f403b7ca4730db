"""Losses made inside the model call (`add_loss`, activity regularisers) next to BatchNormalization,
counted once per replica under every synchronous strategy (trainer/task/layer_state.py,
`separate_replica_losses`): the replicas' losses sum to one device's, the weights end the same,
the loss-scaling guard passes such a step, and parity with Keras fit holds. Without the fix the
activity penalty summed over 2 replicas was 1.5 times one device's, and the guard stopped the
built-in step (1.01 times) or, with synchronized BatchNorm, could not check it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import portpicker
import pytest

from tests.support import REPO, launch_workers, main_in_one_process, run_module, subprocess_env
from tests.test_cross_replica import assert_same_weights
from trainer.task.layer_state import PerThreadLosses

# The module-scoped fixture below is shared by this file's tests: one worker runs them all.
pytestmark = pytest.mark.xdist_group("replica_losses")

MODELS = {
    "sequential": ["train.model_fn=@bn_activity_model"],  # the built-in classification_step
    "subclassed": ["train.model_fn=@bn_dropout_add_loss_model", "train.step_fn=@compute_loss_step"],
}
SHORT = ["train.total_steps=2", "train.eval_every_steps=2", "train.checkpoint_every_steps=2"]
PASSED = "loss-scaling check passed: step outputs summed over 2 replicas match one replica"


def bindings(kind: str) -> list[str]:
    return [f"--gin_bindings={b}" for b in ("import tests.replica_loss_models", *MODELS[kind], *SHORT)]


def assert_one_device(results: dict, mode: str) -> None:
    for kind in MODELS:
        r = results[f"{mode}/{kind}"]
        assert r["replicas"] == 2, r
        assert r["model_losses_diff"] <= 1e-6 and r["model_losses"][0] > 1e-3, r
        assert r["loss_diff"] <= 1e-6, r
        assert r["weights_diff"] <= 1e-5 and r["trained"] > 1e-2, r


@pytest.fixture(scope="module")
def local_results() -> dict:
    proc = run_module("tests.replica_loss_run", "mirrored,central_storage", timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(220)
@pytest.mark.parametrize("mode", ["mirrored", "central_storage"])
def test_model_call_losses_and_weights_match_one_device(local_results, mode):
    assert_one_device(local_results, mode)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_multiworker_mirrored_workers_match_one_device():
    cluster = {"worker": [f"localhost:{portpicker.pick_unused_port()}" for _ in range(2)]}
    workers = []
    try:
        for index in range(2):
            env = subprocess_env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
            command = [sys.executable, "-m", "tests.replica_loss_run", "multi_worker_mirrored"]
            workers.append(
                subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            )
        outputs = [w.communicate(timeout=180) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=30)
    assert [w.returncode for w in workers] == [0, 0], [err[-3000:] for _, err in outputs]
    assert_one_device(json.loads(outputs[0][0].strip().splitlines()[-1]), "multi_worker_mirrored")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("mode", ["mirrored", "central_storage"])
def test_the_guard_passes_batchnorm_with_model_call_losses(runs, mode, kind):
    outcome = runs[1][f"guard/{mode}/{kind}"]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    assert PASSED in outcome["stdout"] and "step 2/2" in outcome["stdout"], outcome["stdout"][-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_guard_passes_the_subclassed_model_on_two_multiworker_mirrored_workers(tmp_path):
    proc = launch_workers("--gin_file=gin/mwms.gin", f"--model_dir={tmp_path / 'run'}", *bindings("subclassed"))
    assert PASSED in proc.stdout, proc.stdout[-3000:]


# Synchronized BatchNorm (batch statistics of the global batch: an all-reduce inside the call, where
# the replica threads take turns too) computes alike on 1 and 2 replicas over the real split of each
# batch, so 30 SGD steps must end with the same weights. (With per-replica statistics they differ by
# design: 5.7e-3 after these 30 steps, measured.)
SYNCHRONIZED_30 = [
    f"--gin_bindings={b}"
    for b in (
        "import tests.replica_loss_models",
        *MODELS["sequential"],
        "bn_activity_model.synchronized=True",
        "make_optimizer.name='sgd'",
        "make_optimizer.learning_rate=0.1",
        "train.total_steps=30",
        "train.checkpoint_every_steps=30",
        "train.eval_every_steps=30",
    )
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, dict]:
    """This file's runs of trainer.main on one machine's devices, in one interpreter (main_in_one_process:
    one TensorFlow start instead of seven): the guard's four (mirrored and central storage, each model)
    and synchronized BatchNorm on 2 replicas and on one device, the 2-replica ones first (TensorFlow
    splits the CPU before its first run). (their folder, outcomes by name); each run's model_dir is
    <folder>/<name>."""
    root = str(tmp_path_factory.mktemp("replica_losses"))
    cases = {
        f"guard/{mode}/{kind}": [f"--gin_file=gin/{mode}.gin", *bindings(kind)]
        for mode in ("mirrored", "central_storage")
        for kind in MODELS
    }
    cases |= {
        f"synchronized/{mode}": [f"--gin_file=gin/{mode}.gin", *SYNCHRONIZED_30]
        for mode in ("mirrored", "central_storage", "single")
    }
    return root, main_in_one_process({name: (args, os.path.join(root, name)) for name, args in cases.items()})


@pytest.fixture(scope="module")
def one_device(runs) -> str:
    root, outcomes = runs
    outcome = outcomes["synchronized/single"]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    return os.path.join(root, "synchronized", "single")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["mirrored", "central_storage", "mwms"])
def test_synchronized_batchnorm_with_an_activity_penalty_trains_the_weights_of_one_device(
    runs, one_device, tmp_path, mode
):
    if mode == "mwms":  # real worker processes
        model_dir = str(tmp_path / mode)
        args = [f"--gin_file=gin/{mode}.gin", f"--model_dir={model_dir}", *SYNCHRONIZED_30]
        stdout = launch_workers(*args, timeout=350).stdout
    else:
        root, outcomes = runs
        outcome = outcomes[f"synchronized/{mode}"]
        assert outcome["code"] == 0, outcome["stderr"][-3000:]
        model_dir, stdout = os.path.join(root, "synchronized", mode), outcome["stdout"]
    assert PASSED in stdout and "on 2 replica(s)" in stdout, stdout[-3000:]
    assert_same_weights(one_device, model_dir)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_parity_with_keras_fit_under_mirrored():
    proc = run_module(
        "trainer.parity",
        "--gin_file=gin/mirrored.gin",
        "--steps=10",
        *(f"--gin_bindings={b}" for b in ("import tests.replica_loss_models", *MODELS["sequential"])),
        timeout=140,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS: ") and "mirrored, 2 replica(s)" in last, last


def test_per_thread_losses_keep_each_threads_own():
    losses = PerThreadLosses(["built"])
    seen = {}

    def replica(name: str, ready: threading.Barrier) -> None:
        losses.clear()  # a call's entry clears only this thread's losses
        ready.wait()
        losses.extend([f"{name}-a"])
        ready.wait()  # both threads have added theirs before either reads
        losses.append(f"{name}-b")
        seen[name] = (losses[:], list(losses), len(losses))

    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=replica, args=(n, barrier)) for n in ("r0", "r1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen == {n: ([f"{n}-a", f"{n}-b"],) * 2 + (2,) for n in ("r0", "r1")}
    assert losses[:] == ["built"]  # the installing thread keeps what the list held
