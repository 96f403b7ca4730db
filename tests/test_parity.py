"""`python -m trainer.parity`: our loop trains like Keras fit, and says so in its exit code.

Real runs of the tool in fresh processes on small models (the CNN with 8 filters, the worked
examples of a dict-input model and of a regression), a few steps each; the full-size runs of every mode are in experiments/parity/.
"""

from __future__ import annotations

import re

import pytest

from tests.support import run_module, subprocess_env

SMALL = ["--gin_bindings=cnn.filters=(8, 8, 8)", "--gin_bindings=cnn.dense_units=16"]


def run_parity(*args: str, timeout: float = 200):
    return run_module("trainer.parity", *SMALL, *args, timeout=timeout)


def verdict(proc) -> tuple[str, float, float]:
    """(PASS|FAIL, max |dw|, max |dloss|) from the last line."""
    last = proc.stdout.strip().splitlines()[-1]
    match = re.match(r"(PASS|FAIL): max \|dw\| (\S+), max \|dloss\| (\S+) ", last)
    assert match, proc.stdout[-3000:] + proc.stderr[-3000:]
    return match[1], float(match[2]), float(match[3])


def step_losses(proc, column: int) -> list[float]:
    rows = re.findall(r"^\s+\d+\s+(\S+)\s+(\S+)\s+\S+$", proc.stdout, re.M)
    return [float(row[column]) for row in rows]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_parity_with_l2_adam_and_schedule_under_mirrored_2_replicas():
    # Adam with warm-up and cosine decay: the rate changes at every step.
    proc = run_parity(
        "--gin_file=gin/mirrored.gin",
        "--steps=8",
        "--gin_bindings=cnn.l2=1e-3",
        "--gin_bindings=train.total_steps=10",
        "--gin_bindings=make_optimizer.name='adam'",
        "--gin_bindings=make_optimizer.learning_rate=0.01",
        "--gin_bindings=make_optimizer.warmup_steps=3",
        "--gin_bindings=make_optimizer.decay='cosine'",
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mirrored, 2 replica(s), global batch 64: TrainLoop vs Keras 3 fit" in proc.stdout
    word, dw, dloss = verdict(proc)
    assert word == "PASS" and dw <= 1e-6 and dloss <= 1e-6
    ours, fit = step_losses(proc, 0), step_losses(proc, 1)
    assert len(ours) == len(fit) == 8
    assert ours[0] != ours[-1], "the weights never changed: the comparison would prove nothing"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_difference_the_guard_cannot_see_fails_parity():
    """Twice the learning rate in the step: scaled right on any replica count, but not fit's training."""
    proc = run_parity(
        "--gin_file=gin/mirrored.gin",
        "--steps=4",
        "--gin_bindings=import tests.guard_steps",
        "--gin_bindings=train.step_fn=@double_learning_rate_step",
        "--gin_bindings=make_optimizer.name='sgd'",
        "--gin_bindings=make_optimizer.learning_rate=0.05",
        timeout=110,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    word, dw, _ = verdict(proc)
    assert word == "FAIL" and dw > 1e-4
    assert step_losses(proc, 0)[0] == step_losses(proc, 1)[0], "step 1 starts from the same weights and batch"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_replica_counts_train_the_same():
    proc = run_parity(
        "--gin_file=gin/mirrored.gin", "--steps=4", "--replicas=1,2", "--gin_bindings=cnn.l2=1e-3", timeout=190
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on 1, 2 logical-CPU replicas" in proc.stdout
    word, dw, dloss = verdict(proc)
    assert word == "PASS" and dw <= 1e-6 and dloss <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_multi_worker_parity_against_tf_keras_fit_in_two_worker_processes():
    # SGD with momentum and the linear scaling rule (rate x 64/32) with warm-up, and an L2 regulariser.
    proc = run_parity(
        "--gin_file=gin/mwms.gin",
        "--steps=4",
        "--num_workers=2",
        "--gin_bindings=cnn.l2=1e-3",
        "--gin_bindings=make_optimizer.name='sgd'",
        "--gin_bindings=make_optimizer.momentum=0.9",
        "--gin_bindings=make_optimizer.learning_rate=0.05",
        "--gin_bindings=make_optimizer.reference_batch_size=32",
        "--gin_bindings=make_optimizer.warmup_steps=2",
        timeout=190,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "in 2 worker processes: TrainLoop vs tf_keras fit" in proc.stdout
    word, dw, dloss = verdict(proc)
    assert word == "PASS" and dw <= 1e-6 and dloss <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_dict_input_model_matches_keras_3_fit_under_mirrored():
    """fit gets our batches as they are: ({'image', 'stats'}, label) into a two-input functional model."""
    proc = run_module(
        "trainer.parity",
        "--gin_file=gin/mirrored.gin",
        "--gin_file=experiments/two_inputs/two_inputs.gin",
        "--steps=3",
        timeout=85,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mirrored, 2 replica(s), global batch 64: TrainLoop vs Keras 3 fit" in proc.stdout
    word, dw, dloss = verdict(proc)
    assert word == "PASS" and dw == 0 and dloss == 0
    ours = step_losses(proc, 0)
    assert len(ours) == 3 and ours[0] != ours[-1]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_regression_with_fit_loss_from_gin_matches_keras_3_fit_under_mirrored():
    """parity.loss names the step's loss for fit; the regression step's MSE trains like fit's."""
    proc = run_module(
        "trainer.parity",
        "--gin_file=gin/mirrored.gin",
        "--gin_file=experiments/regression/regression.gin",
        "--gin_bindings=parity.loss='mean_squared_error'",
        "--steps=3",
        env=subprocess_env(full=True),  # the example reads scikit-learn's diabetes data
        timeout=85,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mirrored, 2 replica(s), global batch 32: TrainLoop vs Keras 3 fit" in proc.stdout
    word, dw, dloss = verdict(proc)
    assert word == "PASS" and dw == 0 and dloss == 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_user_mistake_exits_2_with_one_line():
    proc = run_parity("--gin_file=gin/mirrored.gin", "--replicas=1,3", "--steps=1", timeout=55)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "3 does not divide train.global_batch_size 64" in errors[0]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_metric_steps_of_part_of_a_loop_are_refused_before_either_side_runs():
    proc = run_parity("--gin_file=gin/ps.gin", "--metric_steps=40", timeout=55)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --metric_steps 40 must be a multiple of train.steps_per_loop 50"]
    assert "ours:" not in proc.stdout and "local cluster" not in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_parameter_server_with_one_worker_matches_tf_keras_fit_step_by_step():
    proc = run_parity(
        "--gin_file=gin/ps.gin",
        "--steps=3",
        "--gin_bindings=local_cluster.num_workers=1",
        "--gin_bindings=cnn.l2=1e-3",
        timeout=190,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "parameter_server, 1 worker(s), global batch 64: TrainLoop vs tf_keras fit" in proc.stdout
    word, dw, dloss = verdict(proc)
    assert word == "PASS" and dw <= 1e-6 and dloss <= 1e-6
    assert len(step_losses(proc, 0)) == 3


WEIGHTED = [
    "--gin_bindings=import tests.weighted_inputs",
    "--gin_bindings=train.input_fn=@weighted_digits",
    "--gin_bindings=cnn.num_classes=10",
]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["single", "mirrored"])
def test_weighted_examples_train_like_keras_fit_with_sample_weights(mode):
    """(x, y, sample_weight) examples: the built-in step weights the loss as fit does (fit gets the
    same three-element batches); ignoring the weights, it differed by 1.3 in the loss at step 4."""
    proc = run_parity(f"--gin_file=gin/{mode}.gin", "--steps=4", *WEIGHTED, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    word, dw, dloss = verdict(proc)
    assert word == "PASS" and dw <= 1e-6 and dloss <= 1e-6
    ours = step_losses(proc, 0)
    assert len(ours) == 4 and ours[0] != ours[-1]


def test_the_verdict_passes_within_atol_of_weights_and_losses_and_shows_every_step():
    """The parity table and verdict (trainer/parity.py) on made-up results: no run needed."""
    import numpy as np

    from trainer.errors import UserError
    from trainer.parity import by_losses, max_abs_difference

    ours = [np.zeros((2, 2)), np.ones(3)]
    assert max_abs_difference(ours, [w + 0.25 for w in ours]) == 0.25
    with pytest.raises(UserError, match="different weights"):
        max_abs_difference(ours, ours[:1])
    runs = [{"losses": [1.0, 0.5], "final": ours}, {"losses": [1.0, 0.5 + 2e-6], "final": [w + 1e-7 for w in ours]}]
    outcome = by_losses("mirrored, 2 replica(s)", ["trainer", "fit"], runs, 1e-6)
    assert not outcome.passed
    assert outcome.verdict.startswith("FAIL: max |dw| 1.00e-07, max |dloss| 2.00e-06 exceeds atol 1e-06 after 2 steps")
    text = outcome.text().splitlines()
    assert text[0] == "mirrored, 2 replica(s)" and text[-1] == outcome.verdict
    assert text[1].split() == ["step", "trainer", "loss", "fit", "loss", "diff"] and text[3].split()[-1] == "+2.00e-06"
    assert text[-2] == "max |weight difference| 1.00e-07 over 7 parameters; max |loss difference| 2.00e-06; 0 s"
    passed = by_losses("mirrored, 2 replica(s)", ["trainer", "fit"], runs, 1e-5)
    assert passed.passed and "**PASS: " in passed.markdown("python -m trainer.parity ...")
    assert "|---:|---:|---:|---:|" in passed.markdown(
        ""
    ) and "over 7 parameters; 0 s on this machine" in passed.markdown("")


def test_the_metric_verdict_of_asynchronous_training_compares_one_eval_output():
    """parameter_server with several workers (trainer/parity.py): a table of both sides' numbers, one compared."""
    from trainer.parity import by_metric

    ours = {"optimizer iterations": 300, "train loss (last loop)": 0.5123, "eval accuracy": 0.9123}
    outcome = by_metric("ps: by final eval metrics", 300, 0.03, ours, ours | {"eval accuracy": 0.8723}, "eval accuracy")
    text = outcome.text().splitlines()
    assert not outcome.passed and text[-1] == outcome.verdict
    assert (
        outcome.verdict
        == "FAIL: |eval accuracy difference| 0.0400 exceeds 0.03 after 300 steps (ps: by final eval metrics)"
    )
    assert text[3].split() == ["optimizer", "iterations", "300", "300", "+0"] and text[5].split()[-1] == "-0.0400"
    assert "compared: final eval accuracy" in text[1] and "|---|---:|---:|---:|" in outcome.markdown("")
