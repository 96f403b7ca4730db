"""An update inside graph control flow (a WGAN critic loop, `for _ in tf.range(n_critic)` around
`apply_gradients`): trains on one device; under MirroredStrategy and parameter servers, where
TensorFlow cannot run the update's cross-replica merge_call inside a while loop, one line naming
the fix (a Python range), exit 2, before anything is written; the unrolled loop trains there."""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

from tests.support import read_jsonl, refused_run, run_main

CRITIC = (
    "--gin_file=experiments/gan/gan.gin",
    "--gin_bindings=import tests.critic_steps",
    "--gin_bindings=train.step_fn=@critic_loop_step",
    "--gin_bindings=train.total_steps=20",
    "--gin_bindings=train.steps_per_loop=10",
    "--gin_bindings=train.log_every_steps=10",
    "--gin_bindings=train.eval_every_steps=20",
    "--gin_bindings=train.checkpoint_every_steps=20",
)
FIX = "unroll the loop with a Python range (`for _ in range(n_critic)`, n a Python int)"


def _critic_updates(model_dir) -> int:
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "ckpt-20"))
    return int(reader.get_tensor("optimizer/discriminator/_iterations/.ATTRIBUTES/VARIABLE_VALUE"))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_critic_loop_over_tf_range_trains_on_one_device(tmp_path):
    proc = run_main("--gin_file=gin/single.gin", *CRITIC, f"--model_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _critic_updates(tmp_path) == 2 * 20  # n_critic updates per step
    assert all(r["d_loss"] > 0 for r in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_under_mirrored_and_parameter_servers_it_is_one_line_naming_a_python_range(tmp_path):
    for mode, extra in (("mirrored", ()), ("ps", ("--gin_bindings=local_cluster.num_workers=1",))):
        (tmp_path / mode).mkdir()
        line = refused_run(tmp_path / mode, f"--gin_file=gin/{mode}.gin", *CRITIC, *extra)
        assert line.startswith(
            "error: train.step_fn critic_loop_step calls optimizer.apply_gradients inside graph control flow"
        ), line
        assert FIX in line and "batch structure" not in line and "merge_call" not in line, line
    unrolled = tmp_path / "unrolled"
    proc = run_main(
        "--gin_file=gin/mirrored.gin",
        *CRITIC,
        "--gin_bindings=critic_loop_step.unrolled=True",
        f"--model_dir={unrolled}",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _critic_updates(unrolled) == 2 * 20
