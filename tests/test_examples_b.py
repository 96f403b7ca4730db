"""The worked examples experiments/gan, experiments/batchnorm and experiments/auc, each run as a
user runs it (its gin file after a mode file, a fresh `trainer.main` process) under one replica
and under two (mirrored, 2 logical CPUs), to the quality their README lines state.

The AUC check: the AUC that the 2-replica eval logged (a keras.metrics.AUC summed over the
replicas) equals scikit-learn's roc_auc_score of the final checkpoint's predictions on every
eval example within 1e-3.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from tests.support import read_jsonl, run_main

# The module-scoped fixture below is shared by this file's tests: one worker runs them all.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("examples_b")]

MODES = ("single", "mirrored")


def _run(example: str, mode: str, model_dir: str) -> list[dict]:
    """`python -m trainer.main --gin_file=gin/<mode>.gin --gin_file=experiments/<example>/<example>.gin`."""
    proc = run_main(
        f"--gin_file=gin/{mode}.gin",
        f"--gin_file=experiments/{example}/{example}.gin",
        f"--model_dir={model_dir}",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_jsonl(os.path.join(model_dir, "metrics.jsonl"))


def _split(records: list[dict], split: str) -> list[dict]:
    return [r for r in records if r["split"] == split]


def _restored(model, model_dir: str):
    """`model` with the weights of model_dir's final checkpoint (what the sidecar does)."""
    import tensorflow as tf

    tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(model_dir)).expect_partial()
    return model


@pytest.fixture(scope="module")
def auc_runs(tmp_path_factory) -> dict[str, str]:
    """The AUC example run once per mode: mode -> model_dir."""
    runs = {}
    for mode in MODES:
        runs[mode] = str(tmp_path_factory.mktemp(f"auc_{mode}"))
        _run("auc", mode, runs[mode])
    return runs


@pytest.mark.parametrize("mode", MODES)
def test_gan_logs_finite_losses_at_every_log_step(mode, tmp_path):
    records = _run("gan", mode, str(tmp_path))
    train = _split(records, "train")
    assert [r["step"] for r in train] == list(range(50, 301, 50))
    for r in train:
        assert math.isfinite(r["d_loss"]) and math.isfinite(r["g_loss"]), r
        assert 0.0 <= r["d_real_accuracy"] <= 1.0
    final_eval = _split(records, "eval")[-1]
    assert final_eval["step"] == 300 and math.isfinite(final_eval["d_loss"]) and math.isfinite(final_eval["g_loss"])


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_cnn_learns_and_eval_uses_checkpointed_moving_statistics(mode, tmp_path):
    import keras
    import tensorflow as tf

    from experiments.batchnorm.batchnorm import batchnorm_cnn
    from trainer import data
    from trainer.task.steps import classification_eval_step

    model_dir = str(tmp_path)
    final = _split(_run("batchnorm", mode, model_dir), "eval")[-1]
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
def test_auc_example_scores_well_above_chance(mode, auc_runs):
    records = read_jsonl(os.path.join(auc_runs[mode], "metrics.jsonl"))
    final = _split(records, "eval")[-1]
    assert final["step"] == 300 and final["auc"] > 0.9  # chance: 0.5


def test_keras_auc_on_two_replicas_equals_sklearn_roc_auc(auc_runs):
    import tensorflow as tf
    from sklearn.metrics import roc_auc_score

    from experiments.auc.auc import auc_mlp, small_or_large_digits

    model_dir = auc_runs["mirrored"]
    logged = _split(read_jsonl(os.path.join(model_dir, "metrics.jsonl")), "eval")[-1]
    assert logged["step"] == 300
    examples = list(small_or_large_digits("eval").as_numpy_iterator())
    images = np.stack([image for image, _ in examples])
    labels = np.array([label for _, label in examples])
    model = _restored(auc_mlp(input_shape=images.shape[1:]), model_dir)
    probabilities = tf.sigmoid(tf.reshape(model(images, training=False), [-1])).numpy()
    assert len(labels) == 359 and 0 < labels.sum() < len(labels)
    assert abs(roc_auc_score(labels, probabilities) - logged["auc"]) < 1e-3
