"""A NaN in the data at a known step: 'stop' exits naming that step, 'rollback' skips it and finishes."""
from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

from tests.support import read_jsonl, run_main
from trainer import data
from trainer.write_tfrecords import serialize

SEED, BATCH, BAD_STEP = 0, 32, 7


def position_of_first_example_in_step(step: int, num_train: int) -> int:
    """Which example the pipeline puts first in global step `step` (shuffle order ignores content)."""
    tf.random.set_seed(SEED)
    indices = tf.data.Dataset.range(num_train).shuffle(num_train, seed=SEED, reshuffle_each_iteration=True)
    batches = indices.repeat().batch(BATCH, drop_remainder=True)
    return int(next(iter(batches.skip(step - 1)))[0])


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> list[str]:
    """Digits as TFRecords with one NaN image, placed so that it lands in step BAD_STEP."""
    out = tmp_path_factory.mktemp("nan")
    digits = data.Digits()
    images, labels = digits._arrays["train"]
    images = images.copy()
    images[position_of_first_example_in_step(BAD_STEP, len(images))] = np.nan
    for split, (xs, ys) in (("train", (images, labels)), ("eval", digits._arrays["eval"])):
        with tf.io.TFRecordWriter(str(out / f"{split}-0.tfrecord")) as writer:
            for x, y in zip(xs, ys):
                writer.write(serialize(x, y))
    gin_file = out / "nan.gin"
    gin_file.write_text("import tests.nan_steps\ninclude 'gin/single.gin'\ntrain.step_fn = @input_energy_step\n")
    return [
        f"--gin_file={gin_file}", "--gin_bindings=train.data_source=@tfrecord_files()",
        f"--gin_bindings=tfrecord_files.train_pattern='{out}/train-*.tfrecord'",
        f"--gin_bindings=tfrecord_files.eval_pattern='{out}/eval-*.tfrecord'",
        "--gin_bindings=tfrecord_files.input_shape=(8, 8, 1)", "--gin_bindings=tfrecord_files.num_classes=10",
        f"--gin_bindings=train.global_batch_size={BATCH}", f"--gin_bindings=train.seed={SEED}",
        "--gin_bindings=train.total_steps=30", "--gin_bindings=train.checkpoint_every_steps=5",
        "--gin_bindings=train.eval_every_steps=1000", "--gin_bindings=train.log_every_steps=10",
        "--gin_bindings=train.steps_per_loop=4",
    ]


def test_stop_mode_exits_naming_the_step_and_the_last_good_checkpoint(poisoned, tmp_path):
    model_dir = str(tmp_path / "run")
    proc = run_main(*poisoned, f"--model_dir={model_dir}", "--gin_bindings=train.nonfinite='stop'")
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: step {BAD_STEP} gave a non-finite output (loss nan"), last
    assert last.endswith(f"the last good checkpoint is {model_dir}/ckpt-5"), last
    checkpoints = sorted(n for n in os.listdir(model_dir) if n.endswith(".index"))
    assert checkpoints == ["ckpt-5.index"]  # nothing saved after the NaN


def test_rollback_mode_skips_the_batch_and_finishes(poisoned, tmp_path):
    model_dir = str(tmp_path / "run")
    proc = run_main(*poisoned, f"--model_dir={model_dir}", "--gin_bindings=train.nonfinite='rollback'",
                    "--gin_bindings=train.max_rollbacks=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"step {BAD_STEP} gave a non-finite output" in proc.stdout
    assert f"rolled back to {model_dir}/ckpt-5 (step 5) and skipping batch {BAD_STEP - 1}" in proc.stdout
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    assert records[-1]["split"] == "eval" and records[-1]["step"] == 30
    assert all(np.isfinite(r["loss"]) for r in records)


def test_rollback_mode_gives_up_after_max_rollbacks(poisoned, tmp_path):
    proc = run_main(*poisoned, f"--model_dir={tmp_path / 'run'}", "--gin_bindings=train.nonfinite='rollback'",
                    "--gin_bindings=train.max_rollbacks=0")
    assert proc.returncode == 1
    assert "more than train.max_rollbacks 0" in proc.stderr.strip().splitlines()[-1]
