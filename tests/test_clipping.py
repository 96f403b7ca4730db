"""train.clip_global_norm clips the update's gradient after the cross-replica sum: the same weights
on 1, 2 and 4 replicas; Keras' own global_clipnorm (per replica, docs/design.md, rule 11) is refused."""

from __future__ import annotations

import os

import pytest

from tests.support import launch_workers, read_jsonl, run_main, run_python
from tests.update_runs import CLIP, STEPS, max_difference
from trainer.errors import UserError
from trainer.extensions.registry import Registry
from trainer.extensions.update_path import UpdatePath
from trainer.run.settings import Settings
from trainer.update import accumulation


@pytest.mark.slow
def test_clipped_sgd_gives_the_same_weights_on_1_2_and_4_replicas():
    runs = {
        n: run_python(
            f"from tests.update_runs import main; main({n}, [[1, {CLIP}]] + ([[1, None]] if {n} == 1 else []))",
            timeout=180,
        )
        for n in (1, 2, 4)
    }
    reference = runs[1]["runs"][0]
    for n, result in runs.items():
        clipped = result["runs"][0]
        assert result["replicas"] == n
        norms = [o["grad_norm"] for o in clipped["outputs"]]
        assert len(norms) == STEPS and min(norms) > CLIP  # clipping was active at every step
        difference = max_difference(reference["weights"], clipped["weights"])
        print(
            f"{n} replica(s): max |weights - weights on 1 replica| = {difference:.3g}, "
            f"gradient norms {min(norms):.3g}..{max(norms):.3g} > clip {CLIP}"
        )
        assert difference < 1e-5
    unclipped = runs[1]["runs"][1]
    assert max_difference(reference["weights"], unclipped["weights"]) > 0.1  # clipping changed the training


@pytest.mark.slow
def test_keras_global_clipnorm_on_2_replicas_exits_2(tmp_path):
    model_dir = str(tmp_path / "run")
    proc = run_main(
        "--gin_file=gin/mirrored.gin",
        "--gin_bindings=import tests.update_runs",
        "--gin_bindings=train.optimizer_fn = @keras_clipping_sgd",
        f"--model_dir={model_dir}",
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "global_clipnorm=1.0" in errors[0] and "before the" in errors[0] and "train.clip_global_norm" in errors[0]
    assert not os.path.exists(model_dir) or not os.listdir(model_dir)


@pytest.mark.parametrize("value", [0, -1.0, "1", True])
def test_bad_clip_global_norm_is_one_line(value):
    with pytest.raises(UserError, match="train.clip_global_norm must be a number > 0 or None"):
        accumulation.UpdateOptions(clip_global_norm=value)


def test_parameter_server_refuses_both_options():
    for name, value in (("grad_accum_steps", 2), ("clip_global_norm", 1.0)):
        with pytest.raises(UserError, match=f"train.{name} is not supported with parameter_server"):
            Registry([UpdatePath(**{name: value})], Settings(strategy="parameter_server"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_multiworker_workers_clip_and_accumulate_like_one_device(tmp_path):
    """Real `trainer.launch` processes: 2 MultiWorkerMirrored workers with 2 micro-batches and clipping
    active every step end at the eval loss of one device running the same configuration."""
    bindings = [
        f"--gin_bindings={b}"
        for b in (
            "train.total_steps=20",
            "train.grad_accum_steps=2",
            f"train.clip_global_norm={CLIP}",
            "train.eval_every_steps=20",
            "make_optimizer.name='sgd'",
            "make_optimizer.learning_rate=0.5",
        )
    ]
    multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
    launch_workers("--gin_file=gin/mwms.gin", f"--model_dir={multi}", *bindings, timeout=240)
    proc = run_main("--gin_file=gin/single.gin", f"--model_dir={single}", *bindings, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [
        [r for r in read_jsonl(os.path.join(d, "metrics.jsonl")) if r["split"] == "eval"][-1] for d in (multi, single)
    ]
    trains = [
        [r for r in read_jsonl(os.path.join(d, "metrics.jsonl")) if r["split"] == "train"][-1] for d in (multi, single)
    ]
    print(f"eval loss at step 20: 2 workers {evals[0]['loss']:.9f}, one device {evals[1]['loss']:.9f}")
    assert evals[0]["step"] == evals[1]["step"] == 20
    assert abs(evals[0]["loss"] - evals[1]["loss"]) < 1e-5
    assert trains[0]["grad_norm"] > CLIP


def test_the_global_norm_is_taken_after_the_sum_and_keras_own_clipping_is_refused_where_it_differs():
    """One device (the default replica context): the sum is the gradients themselves, clipped to
    the global norm; Keras' per-replica clipping is refused beside clip_global_norm or on replicas."""
    import keras
    import numpy as np
    import tensorflow as tf

    from trainer.update import clipping

    clipped, norm = clipping.sum_and_clip([tf.constant([3.0]), None, tf.constant([[4.0]])], clip_norm=1.0)
    assert clipped[1] is None and float(norm) == 5.0
    np.testing.assert_allclose([clipped[0].numpy(), clipped[2].numpy()[0]], [[0.6], [0.8]], rtol=1e-6)

    clipping.check_keras_clipping({"d": keras.optimizers.SGD(clipnorm=1.0)}, num_replicas=1, clip_global_norm=None)
    clipping.check_keras_clipping(keras.optimizers.SGD(), num_replicas=2, clip_global_norm=0.5)
    with pytest.raises(UserError, match="Keras' clipvalue=0.1 and train.clip_global_norm = 0.5 is set too"):
        clipping.check_keras_clipping(keras.optimizers.SGD(clipvalue=0.1), num_replicas=1, clip_global_norm=0.5)
    with pytest.raises(UserError, match=r"on 2 replicas .* set train.clip_global_norm = 2.0 \(the global norm"):
        clipping.check_keras_clipping(keras.optimizers.SGD(global_clipnorm=2.0), num_replicas=2, clip_global_norm=None)

    optimizer = keras.optimizers.SGD()
    clipping.take_over_gradient_sum(optimizer)
    assert optimizer._all_reduce_sum_gradients([(1, "v")]) == [(1, "v")]  # applied as given (trainer.internals)
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(UserError, match="does not work with mixed_float16 loss scaling"):
        clipping.take_over_gradient_sum(scaled)


def test_the_recorder_keeps_what_the_step_would_apply_and_refuses_a_second_update():
    import keras
    import tensorflow as tf

    from trainer.update.recorder import ONCE_MESSAGE, GradientRecorder

    optimizer = keras.optimizers.SGD(learning_rate=0.5)
    weight = keras.Variable([1.0, 2.0])
    recorder = GradientRecorder(optimizer)
    sparse = tf.IndexedSlices(tf.constant([[3.0]]), tf.constant([1]), tf.constant([2, 1]))
    recorder.apply_gradients([(sparse, weight)])
    assert recorder.calls == 1 and recorder.variables == [weight] and recorder.learning_rate == 0.5
    assert recorder.gradients[0].numpy().tolist() == [[0.0], [3.0]]  # made dense
    assert weight.numpy().tolist() == [1.0, 2.0]  # recorded, not applied
    with pytest.raises(ValueError, match=ONCE_MESSAGE[:40]):
        recorder.apply([tf.constant([1.0, 1.0])], [weight])
    every = GradientRecorder(optimizer, once=False)
    every.apply([tf.constant([1.0, 1.0])], [weight])
    every.apply_gradients([(tf.constant([2.0, 2.0]), weight)])
    assert every.calls == 2 and [g.numpy().tolist() for g in every.gradients] == [[1.0, 1.0], [2.0, 2.0]]
