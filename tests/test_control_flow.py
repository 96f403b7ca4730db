"""An update inside graph control flow (a WGAN critic loop, `for _ in tf.range(n_critic)` around
`apply_gradients`): trains on one device; under MirroredStrategy and parameter servers, where
TensorFlow cannot run the update's cross-replica merge_call inside a while loop, one line naming
the fix (a Python range), exit 2, before anything is written; the unrolled loop trains there."""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

from tests.support import main_in_one_process, read_jsonl, refused_run, tree_digest

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[str, dict]:
    """The critic loop under mirrored (on an empty folder), unrolled under mirrored, and on one device, in one
    interpreter (main_in_one_process: one TensorFlow start instead of three), mirrored first (TensorFlow
    splits the CPU before its first run). (their folder, outcomes by name); each run's model_dir is
    <folder>/<name>."""
    root = tmp_path_factory.mktemp("critic")
    (root / "mirrored").mkdir()
    cases = {
        "mirrored": ["--gin_file=gin/mirrored.gin", *CRITIC],
        "unrolled": ["--gin_file=gin/mirrored.gin", *CRITIC, "--gin_bindings=critic_loop_step.unrolled=True"],
        "single": ["--gin_file=gin/single.gin", *CRITIC],
    }
    return str(root), main_in_one_process({name: (args, str(root / name)) for name, args in cases.items()})


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.xdist_group("control_flow")
def test_a_critic_loop_over_tf_range_trains_on_one_device(runs):
    root, outcomes = runs
    assert outcomes["single"]["code"] == 0, outcomes["single"]["stderr"][-4000:]
    model_dir = os.path.join(root, "single")
    assert _critic_updates(model_dir) == 2 * 20  # n_critic updates per step
    assert all(r["d_loss"] > 0 for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")))


def assert_names_a_python_range(line: str) -> None:
    assert line.startswith(
        "error: train.step_fn critic_loop_step calls optimizer.apply_gradients inside graph control flow"
    ), line
    assert FIX in line and "batch structure" not in line and "merge_call" not in line, line


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("control_flow")
def test_under_mirrored_and_parameter_servers_it_is_one_line_naming_a_python_range(runs, tmp_path):
    root, outcomes = runs
    refused = outcomes["mirrored"]  # refused_run's checks, in the shared interpreter
    assert refused["code"] == 2 and "Traceback" not in refused["stderr"], refused["stderr"][-3000:]
    errors = [line for line in refused["stderr"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == refused["stderr"].strip().splitlines()[-1], refused["stderr"][-3000:]
    assert tree_digest(os.path.join(root, "mirrored")) == {}
    assert_names_a_python_range(errors[0])
    # The embedded cluster of parameter servers: a process of its own.
    assert_names_a_python_range(
        refused_run(tmp_path, "--gin_file=gin/ps.gin", *CRITIC, "--gin_bindings=local_cluster.num_workers=1")
    )
    unrolled = outcomes["unrolled"]
    assert unrolled["code"] == 0, unrolled["stderr"][-4000:]
    assert _critic_updates(os.path.join(root, "unrolled")) == 2 * 20
