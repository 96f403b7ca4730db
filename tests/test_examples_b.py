"""The worked examples experiments/gan, experiments/batchnorm and experiments/auc, each run as a
user runs it (its gin file after a mode file, through trainer.main's own flags and `run`) under one
replica and under two (mirrored, 2 logical CPUs), to the quality their README lines state. The six
runs share one fresh interpreter (main_in_one_process), the mirrored ones first.

The AUC check: the AUC that the 2-replica eval logged (a keras.metrics.AUC summed over the
replicas) equals scikit-learn's roc_auc_score of the final checkpoint's predictions on every
eval example within 1e-3.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from tests.support import main_in_one_process, read_jsonl

# The module-scoped fixture below is shared by this file's tests: one worker runs them all.
# The first of them waits for the six runs: a longer timeout than the suite's.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("examples_b"), pytest.mark.timeout(500)]

MODES = ("single", "mirrored")


EXAMPLES = ("gan", "batchnorm", "auc")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], str]:
    """Each example under each mode, `python -m trainer.main --gin_file=gin/<mode>.gin
    --gin_file=experiments/<example>/<example>.gin` in one interpreter (one TensorFlow start instead of
    six), mirrored first (TensorFlow splits the CPU before its first run): (example, mode) -> model_dir."""
    root = tmp_path_factory.mktemp("examples_b")
    cases = {
        f"{example}/{mode}": (
            [f"--gin_file=gin/{mode}.gin", f"--gin_file=experiments/{example}/{example}.gin"],
            str(root / example / mode),
        )
        for mode in reversed(MODES)
        for example in EXAMPLES
    }
    outcomes = main_in_one_process(cases)
    for name, outcome in outcomes.items():
        assert outcome["code"] == 0, (name, outcome["stderr"][-4000:])
    return {tuple(name.split("/")): model_dir for name, (_, model_dir) in cases.items()}


def _records(runs: dict[tuple[str, str], str], example: str, mode: str) -> list[dict]:
    """The metrics.jsonl records of `example` run under `mode`."""
    return read_jsonl(os.path.join(runs[example, mode], "metrics.jsonl"))


def _split(records: list[dict], split: str) -> list[dict]:
    return [r for r in records if r["split"] == split]


def _restored(model, model_dir: str):
    """`model` with the weights of model_dir's final checkpoint (what the sidecar does)."""
    import tensorflow as tf

    tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(model_dir)).expect_partial()
    return model


@pytest.mark.parametrize("mode", MODES)
def test_gan_logs_finite_losses_at_every_log_step(mode, runs):
    records = _records(runs, "gan", mode)
    train = _split(records, "train")
    assert [r["step"] for r in train] == list(range(50, 301, 50))
    for r in train:
        assert math.isfinite(r["d_loss"]) and math.isfinite(r["g_loss"]), r
        assert 0.0 <= r["d_real_accuracy"] <= 1.0
    final_eval = _split(records, "eval")[-1]
    assert final_eval["step"] == 300 and math.isfinite(final_eval["d_loss"]) and math.isfinite(final_eval["g_loss"])


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_cnn_learns_and_eval_uses_checkpointed_moving_statistics(mode, runs):
    import keras
    import tensorflow as tf

    from experiments.batchnorm.batchnorm import batchnorm_cnn
    from trainer import data
    from trainer.task.steps import classification_eval_step

    model_dir = runs["batchnorm", mode]
    final = _split(_records(runs, "batchnorm", mode), "eval")[-1]
    assert final["step"] == 300 and final["accuracy"] > 0.8  # chance: 0.1

    checkpoint = tf.train.latest_checkpoint(model_dir)
    moving = {
        name: tf.train.load_variable(checkpoint, name)
        for name, _ in tf.train.list_variables(checkpoint)
        if "moving_mean" in name or "moving_variance" in name
    }
    assert len(moving) == 4  # two BatchNormalization layers, a mean and a variance each
    assert all(not np.allclose(v, 0.0) and not np.allclose(v, 1.0) for v in moving.values())  # trained, not initial

    digits = data.Digits()
    images, labels = digits.arrays("eval")
    model = _restored(batchnorm_cnn(input_shape=digits.input_shape, num_classes=digits.num_classes), model_dir)
    batch = (images, labels, np.ones(len(labels), np.float32))
    sums = classification_eval_step(model, batch)
    assert float(sums["loss"]) / len(labels) == pytest.approx(final["loss"], rel=1e-4)
    assert float(sums["accuracy"]) / len(labels) == pytest.approx(final["accuracy"], abs=1e-6)
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(norms) == 2
    for layer in norms:  # the same weights with the moving statistics at their initial values
        layer.moving_mean.assign(np.zeros(layer.moving_mean.shape, np.float32))
        layer.moving_variance.assign(np.ones(layer.moving_variance.shape, np.float32))
    reset = float(classification_eval_step(model, batch)["loss"]) / len(labels)
    assert abs(reset - final["loss"]) > 0.1, "eval did not depend on the moving statistics"


@pytest.mark.parametrize("mode", MODES)
def test_auc_example_scores_well_above_chance(mode, runs):
    records = _records(runs, "auc", mode)
    final = _split(records, "eval")[-1]
    assert final["step"] == 300 and final["auc"] > 0.9  # chance: 0.5


def test_keras_auc_on_two_replicas_equals_sklearn_roc_auc(runs):
    import tensorflow as tf
    from sklearn.metrics import roc_auc_score

    from experiments.auc.auc import auc_mlp, small_or_large_digits

    model_dir = runs["auc", "mirrored"]
    logged = _split(read_jsonl(os.path.join(model_dir, "metrics.jsonl")), "eval")[-1]
    assert logged["step"] == 300
    examples = list(small_or_large_digits("eval").as_numpy_iterator())
    images = np.stack([image for image, _ in examples])
    labels = np.array([label for _, label in examples])
    model = _restored(auc_mlp(input_shape=images.shape[1:]), model_dir)
    probabilities = tf.sigmoid(tf.reshape(model(images, training=False), [-1])).numpy()
    assert len(labels) == 359 and 0 < labels.sum() < len(labels)
    assert abs(roc_auc_score(labels, probabilities) - logged["auc"]) < 1e-3
