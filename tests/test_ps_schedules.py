"""Schedules and Adam under asynchronous updates (issue 13): the optimizer counts every step.

Keras 3's counter lost steps under 2 async workers (177 of 200 counted here before the fix,
so a cosine schedule ended at 7.9e-5 instead of 0); now it equals the global step.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support import read_jsonl, run_main
from trainer.loops.ps_schedules import count_steps_atomically
from trainer.task.optimizers import ScaledWarmupSchedule

TOTAL, WARMUP, LR = 200, 20, 0.002


@pytest.mark.slow
def test_schedule_reaches_its_final_value_at_total_steps_under_two_async_workers(tmp_path):
    model_dir = tmp_path / "run"
    proc = run_main(
        "--gin_file=gin/ps.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=local_cluster.num_workers=2",
        f"--gin_bindings=train.total_steps={TOTAL}",
        "--gin_bindings=train.log_every_steps=50",
        f"--gin_bindings=train.eval_every_steps={TOTAL}",
        f"--gin_bindings=train.checkpoint_every_steps={TOTAL}",
        f"--gin_bindings=make_optimizer.learning_rate={LR}",
        f"--gin_bindings=make_optimizer.warmup_steps={WARMUP}",
        "--gin_bindings=make_optimizer.decay='cosine'",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    schedule = ScaledWarmupSchedule(LR, 1.0, WARMUP, "cosine", TOTAL)
    train = [r for r in read_jsonl(model_dir / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in train] == [50, 100, 150, 200]
    for record in train:  # at each join the counter is exactly the global step
        np.testing.assert_allclose(record["learning_rate"], float(schedule(record["step"])), rtol=1e-6)
    assert train[-1]["learning_rate"] == 0.0
    reader = tf.train.load_checkpoint(str(model_dir))
    assert reader.get_tensor("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == TOTAL
    assert reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE") == TOTAL


def test_counter_starts_at_the_global_step_and_still_counts_updates():
    optimizer = keras.optimizers.Adam(ScaledWarmupSchedule(LR, 1.0, WARMUP, "cosine", TOTAL))
    weight = keras.Variable(np.ones(3, np.float32))
    optimizer.apply_gradients([(tf.ones(3), weight)])
    counter = optimizer.iterations
    count_steps_atomically(optimizer, tf.Variable(7, dtype=tf.int64))  # e.g. a resume from a lagging checkpoint
    assert optimizer.iterations is counter and int(counter.numpy()) == 7
    assert type(counter).__name__.startswith("Atomic") and isinstance(counter, keras.Variable)
    optimizer.apply_gradients([(tf.ones(3), weight)])
    assert int(optimizer.iterations.numpy()) == 8
    atomic = type(counter)
    count_steps_atomically(optimizer, tf.Variable(8, dtype=tf.int64))  # idempotent
    assert type(counter) is atomic and int(counter.numpy()) == 8
