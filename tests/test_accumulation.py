"""train.grad_accum_steps: K accumulated micro-batches make the same update as the whole batch.

Real TensorFlow in fresh processes (the multi-replica ones split the CPU into logical devices):
20 SGD steps of an MLP on the digits, whole batch vs 4 micro-batches, single and mirrored.
"""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

from tests.support import main_in_one_process, read_jsonl, run_main, run_python
from tests.update_runs import STEPS, max_difference
from trainer.errors import UserError
from trainer.update import accumulation


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2], ids=["single", "mirrored"])
def test_four_micro_batches_update_like_the_whole_batch(replicas):
    result = run_python(f"from tests.update_runs import main; main({replicas}, [[1, None], [4, None]])", timeout=180)
    whole, accumulated = result["runs"]
    assert result["replicas"] == replicas
    difference = max_difference(whole["weights"], accumulated["weights"])
    print(f"{replicas} replica(s): max |weights(K=1) - weights(K=4)| after {STEPS} SGD steps = {difference:.3g}")
    assert difference < 1e-5
    assert accumulated["moved"] > 0.1  # the weights did train
    # One update per step: the global step and the optimizer count updates, not micro-batches.
    assert accumulated["global_step"] == accumulated["iterations"] == STEPS
    # The micro-steps' outputs sum to the whole batch's (each is a share of the update's mean).
    for a, b in zip(whole["outputs"], accumulated["outputs"]):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["accuracy"] - b["accuracy"]) < 1e-6


def test_micro_batches_cut_any_structure():
    batch = {"x": tf.reshape(tf.range(24.0), [8, 3]), "y": (tf.range(8), tf.ones([8]))}
    parts = accumulation.micro_batches(batch, 4)
    assert len(parts) == 4 and parts[1]["x"].shape == (2, 3)
    assert parts[3]["y"][0].numpy().tolist() == [6, 7]
    with pytest.raises(UserError, match="grad_accum_steps 3"):
        accumulation.micro_batches(batch, 3)


@pytest.mark.parametrize("value", [0, 2.5, True])
def test_bad_grad_accum_steps_is_one_line(value):
    with pytest.raises(UserError, match="train.grad_accum_steps must be a positive integer"):
        accumulation.UpdateOptions(grad_accum_steps=value)


@pytest.mark.slow
def test_batch_not_divisible_by_micro_batches_times_replicas_exits_2(tmp_path):
    model_dir = str(tmp_path / "run")
    proc = run_main(
        "--gin_file=gin/mirrored.gin",
        "--gin_bindings=train.grad_accum_steps = 3",
        f"--model_dir={model_dir}",
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not divisible by train.grad_accum_steps 3 x 2 replica(s)" in errors[0], errors
    assert not os.path.exists(model_dir) or not os.listdir(model_dir)


@pytest.mark.slow
def test_accumulated_run_resumes_exactly(tmp_path):
    """10 steps of 2 micro-batches (the CNN with dropout) straight, and as 5 + 5 across a restart."""
    common = [
        "--gin_file=gin/single.gin",
        "--gin_bindings=train.grad_accum_steps=2",
        "--gin_bindings=cnn.dropout=0.5",
        "--gin_bindings=train.checkpoint_every_steps=5",
        "--gin_bindings=train.eval_every_steps=10",
        "--gin_bindings=train.steps_per_loop=5",
    ]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    outcomes = main_in_one_process(  # the three runs in turn in one interpreter
        {
            f"{model_dir} to {total}": ([*common, f"--gin_bindings=train.total_steps={total}"], model_dir)
            for model_dir, totals in ((straight, (10,)), (resumed, (5, 10)))
            for total in totals
        },
        timeout=240,
    )
    for outcome in outcomes.values():
        assert outcome["code"] == 0, outcome["stderr"][-3000:]
    assert "continuing from step 5" in outcomes[f"{resumed} to 10"]["stdout"]
    finals = [
        [r for r in read_jsonl(os.path.join(d, "metrics.jsonl")) if r["split"] == "eval"][-1]
        for d in (straight, resumed)
    ]
    assert finals[0]["step"] == finals[1]["step"] == 10
    assert finals[0]["loss"] == finals[1]["loss"]


def test_micro_batches_update_like_the_whole_batch_on_one_device_in_process():
    """update_step on the default strategy: two micro-batches give the whole batch's loss and update;
    with clipping the norm is an output and the update is at most lr * clip."""
    import keras
    import numpy as np

    def step(model, optimizer, batch, global_batch_size):
        x, y = batch
        with tf.GradientTape() as tape:
            per_example = tf.reduce_sum(tf.square(model(x) - y), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return {"loss": loss}

    rng = np.random.default_rng(0)
    batch = (tf.constant(rng.normal(size=(8, 3)), tf.float32), tf.constant(rng.normal(size=(8, 1)), tf.float32))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    initial = model.get_weights()

    def trained(options: accumulation.UpdateOptions) -> tuple[dict, list]:
        model.set_weights(initial)
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
        accumulation.prepare(options, optimizer, num_replicas=1, global_batch_size=8)
        outputs = accumulation.update_step(step, options)(model, optimizer, batch, 8)  # eagerly: quicker here
        assert int(optimizer.iterations) == 1  # one update, whatever the micro-batches
        return {k: float(v) for k, v in outputs.items()}, model.get_weights()

    assert accumulation.update_step(step, accumulation.UpdateOptions()) is step
    whole, micro = trained(accumulation.UpdateOptions()), trained(accumulation.UpdateOptions(grad_accum_steps=2))
    assert micro[0]["loss"] == pytest.approx(whole[0]["loss"], rel=1e-6)
    for a, b in zip(whole[1], micro[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    outputs, weights = trained(accumulation.UpdateOptions(grad_accum_steps=4, clip_global_norm=1e-3))
    assert outputs["grad_norm"] > 1e-3 and outputs["loss"] == pytest.approx(whole[0]["loss"], rel=1e-6)
    moved = np.sqrt(sum(np.sum(np.square(w - i)) for w, i in zip(weights, initial)))
    assert moved == pytest.approx(0.1 * 1e-3, rel=1e-3)  # float32 weights
    with pytest.raises(UserError, match="not divisible by train.grad_accum_steps 3 x 2 replica"):
        accumulation.prepare(accumulation.UpdateOptions(grad_accum_steps=3), [], num_replicas=2, global_batch_size=8)
