"""The loss-scaling guard: mis-scaled steps stop before step 1 with exit 2 and the right fix.

Real runs of `python -m trainer.main` on gin/mirrored.gin (2 logical-CPU replicas) with the
steps of tests/guard_steps.py; the probe's rollback is checked in a fresh process.
"""

from __future__ import annotations

import os

import pytest

from tests.support import main_in_one_process, run_main, run_python
from trainer.safety import loss_scaling as guard

SMALL = [
    "--gin_bindings=cnn.filters=(8, 8, 8)",
    "--gin_bindings=cnn.dense_units=16",
    "--gin_bindings=train.total_steps=2",
    "--gin_bindings=train.log_every_steps=1",
    "--gin_bindings=train.checkpoint_every_steps=2",
    "--gin_bindings=train.eval_every_steps=2",
]


def run_mirrored(model_dir, *bindings: str):
    return run_main(
        "--gin_file=gin/mirrored.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=import tests.guard_steps",
        "--gin_bindings=cnn.l2=1e-3",
        *SMALL,
        *(f"--gin_bindings={b}" for b in bindings),
        timeout=150,
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


MIS_SCALED = {  # step -> phrases of its error line
    "per_replica_mean_step": [
        "per-replica mean instead of the global-batch share (gradients 2 times too large)",
        "tf.nn.compute_average_loss(per_example, global_batch_size=...)",
    ],
    "keras_loss_scaled_by_hand_step": [
        "a Keras 3 loss at its default reduction already divides by the replica count",
        "2 times too small",
        "reduction=None and compute_average_loss",
    ],
    "unscaled_regularization_step": ["model.losses added without tf.nn.scale_regularization_loss"],
}


@pytest.fixture(scope="module")
def mis_scaled(tmp_path_factory) -> tuple[str, dict[str, dict]]:
    """Each step of MIS_SCALED under mirrored, all in one interpreter; (their folder, outcomes)."""
    root = tmp_path_factory.mktemp("mis_scaled")
    args = [
        "--gin_file=gin/mirrored.gin",
        "--gin_bindings=import tests.guard_steps",
        "--gin_bindings=cnn.l2=1e-3",
        *SMALL,
    ]
    cases = {
        step: ([*args, f"--gin_bindings=train.step_fn=@{step}"], str(root / step))
        for step in [*MIS_SCALED, "step_without_update"]
    }
    return str(root), main_in_one_process(cases, timeout=200)


@pytest.mark.slow
@pytest.mark.timeout(220)
@pytest.mark.xdist_group("mis_scaled")
@pytest.mark.parametrize("step", list(MIS_SCALED))
def test_mis_scaled_step_is_stopped_before_training(mis_scaled, step):
    root, outcomes = mis_scaled
    outcome, model_dir = outcomes[step], os.path.join(root, step)
    assert outcome["code"] == 2, outcome["stderr"][-3000:]
    errors = error_lines(outcome["stderr"])
    assert len(errors) == 1, outcome["stderr"][-3000:]
    assert errors[0].startswith("error: loss scaling: step output 'loss' summed over 2 replicas")
    for phrase in MIS_SCALED[step]:
        assert phrase in errors[0]
    assert "training " not in outcome["stdout"] and "step 1/" not in outcome["stdout"], outcome["stdout"]
    assert not os.path.exists(model_dir) or not os.listdir(model_dir), "the run wrote to model_dir"


@pytest.mark.slow
@pytest.mark.timeout(220)
@pytest.mark.xdist_group("mis_scaled")
def test_a_step_that_applies_no_update_is_named_after_the_first_loop_call(mis_scaled):
    outcome = mis_scaled[1]["step_without_update"]
    assert outcome["code"] == 0, outcome["stderr"][-3000:]
    warnings = [line for line in outcome["stdout"].splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: no trainable variable changed over steps 0-1: the step (train.step_fn = @step_without_update) "
        "applies no update; call optimizer.apply_gradients(zip(gradients, variables)) in it"
    ]


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_correct_step_is_not_stopped(tmp_path):
    model_dir = tmp_path / "run"
    proc = run_mirrored(model_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss-scaling check passed: step outputs summed over 2 replicas match one replica" in proc.stdout
    assert "step 2/2" in proc.stdout and "no trainable variable changed" not in proc.stdout
    assert any(name.startswith("ckpt-") for name in os.listdir(model_dir))


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_check_can_be_switched_off(tmp_path):
    proc = run_mirrored(tmp_path / "run", "train.step_fn=@per_replica_mean_step", "train.check_loss_scaling=False")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss-scaling" not in proc.stdout
    assert "step 2/2" in proc.stdout


PROBE_SCRIPT = """
import json
import keras
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tests import guard_steps
from trainer import data
from trainer.safety import loss_scaling as guard
from trainer.task import optimizers
from trainer.task import steps
from trainer.errors import UserError

source = data.Digits()
strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, kernel_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.BatchNormalization(),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.5),
        keras.layers.Dense(10, kernel_regularizer=keras.regularizers.L2(1e-3)),
    ])
    optimizer = optimizers.make_optimizer(global_batch_size=32, total_steps=10, name="adam", warmup_steps=3)
    optimizer.build(model.trainable_variables)
state = lambda: [np.array(v.numpy()) for v in [*model.variables, *optimizer.variables]]
before = state()
results = {}
for name, step_fn in [("correct", steps.classification_step),
                      ("double_learning_rate", guard_steps.double_learning_rate_step),
                      ("per_replica_mean", guard_steps.per_replica_mean_step)]:
    try:
        guard.check_loss_scaling(strategy, model, optimizer, step_fn, source, global_batch_size=32, seed=0,
                                 print_fn=lambda line: None)
        results[name] = "passed"
    except UserError as e:
        results[name] = str(e)
after = state()
results["unchanged"] = len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after))
results["iterations"] = int(optimizer.iterations.numpy())
print(json.dumps(results))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_probe_is_exact_with_batchnorm_and_dropout_and_rolls_everything_back():
    results = run_python(PROBE_SCRIPT, timeout=110)
    assert results["correct"] == "passed"
    assert results["double_learning_rate"] == "passed"  # scaled right: the guard cannot see it (parity can)
    assert "per-replica mean instead of the global-batch share" in results["per_replica_mean"]
    assert results["unchanged"], "the probe changed a model or optimizer variable"
    assert results["iterations"] == 0


# The classification of a mismatch, on numbers (no TensorFlow run needed).


def outputs(loss: float, grads=()):
    return {"loss": loss}, list(grads)


@pytest.mark.parametrize(
    "distributed, single, reg, mistake",
    [
        (4.6, 2.3, 0.0, "per_replica_mean"),
        (2 * (2.3 - 0.2) + 0.2, 2.3, 0.2, "per_replica_mean"),  # data term doubled, regularisation scaled right
        (2.3 / 2, 2.3, 0.0, "keras_default_scaled"),
        ((2.3 - 0.2) / 2 + 0.2, 2.3, 0.2, "keras_default_scaled"),
        (2.3 + 0.2, 2.3, 0.2, "unscaled_regularization"),
        (2.3 * 1.5, 2.3, 0.2, None),
    ],
)
def test_mismatch_is_explained(distributed, single, reg, mistake):
    findings = guard.compare(outputs(distributed), outputs(single), outputs(single), 2, reg)
    assert len(findings) == 1 and findings[0].mistake == mistake
    text = guard.message(findings[0], 2)
    assert "\n" not in text and f"{distributed / single:.4g} times" in text


def test_agreement_within_rounding_or_the_steps_own_noise_passes():
    assert guard.compare(outputs(2.3000001), outputs(2.3), outputs(2.3), 2, 0.1) == []
    # A step whose randomness the seed state does not fix: two one-replica runs differ by 0.01.
    assert guard.compare(outputs(2.32), outputs(2.3), outputs(2.31), 2, 0.0) == []
    assert guard.compare(outputs(2.5), outputs(2.3), outputs(2.31), 2, 0.0)[0].mistake is None


def test_gradients_scaled_unlike_the_returned_loss_are_caught():
    import numpy as np

    g = np.array([0.3, -0.4])
    findings = guard.compare(outputs(2.3, [4 * g]), outputs(2.3, [g]), outputs(2.3, [g]), 4, 0.0)
    assert findings[0].name == "gradients" and findings[0].mistake == "per_replica_mean"
    assert "gradients 4 times too large" in guard.message(findings[0], 4)
