"""train.ema_decay: EMA eval differs from raw eval, resumes exactly, and is the same on every
replica under mirrored and central_storage (2 logical CPUs) and under 2 MultiWorkerMirrored workers."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support import launch_workers, main_in_one_process, read_jsonl, run_main, run_python, subprocess_env
from trainer.errors import UserError
from trainer.extensions import ema
from trainer.extensions.registry import Registry
from trainer.run.settings import Settings

SMALL = [
    "--gin_file=gin/single.gin",
    "--gin_bindings=cnn.filters=(8,)",
    "--gin_bindings=cnn.dense_units=16",
    "--gin_bindings=train.ema_decay=0.9",
    "--gin_bindings=train.eval_every_steps=20",
    "--gin_bindings=train.checkpoint_every_steps=20",
    "--gin_bindings=train.steps_per_loop=10",
    "--gin_bindings=train.log_every_steps=20",
]


def evals(model_dir: str, split: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(os.path.join(model_dir, "metrics.jsonl")) if r["split"] == split}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_ema_eval_differs_from_raw_and_resumes_exactly(tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    outcomes = main_in_one_process(  # the three runs in turn in one interpreter
        {
            "straight": ([*SMALL, "--gin_bindings=train.total_steps=40"], straight),
            "interrupted": ([*SMALL, "--gin_bindings=train.total_steps=20"], resumed),  # at 20, rerun to 40
            "rerun": ([*SMALL, "--gin_bindings=train.total_steps=40"], resumed),
        },
        timeout=180,
    )
    for outcome in outcomes.values():
        assert outcome["code"] == 0, outcome["stderr"][-3000:]
    assert "eval (EMA) at step 40" in outcomes["straight"]["stdout"]
    assert "restored" in outcomes["rerun"]["stdout"]
    raw, averaged = evals(straight, "eval"), evals(straight, "eval_ema")
    assert sorted(averaged) == [20, 40]
    assert abs(raw[40]["loss"] - averaged[40]["loss"]) > 1e-3  # the averaged weights are other weights
    again = evals(resumed, "eval_ema")
    print("straight eval", raw[40], "ema", averaged[40], "resumed ema", again[40])
    assert again[40]["loss"] == averaged[40]["loss"] and again[40]["accuracy"] == averaged[40]["accuracy"]
    assert evals(resumed, "eval")[40]["loss"] == raw[40]["loss"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ema_under_mirrored_and_central_storage_matches_one_device():
    script = """
import json
import numpy as np
import keras
import tensorflow as tf
from trainer.distribution import devices, strategies
devices.configure_devices(devices.DeviceConfig(logical_cpus_without_gpu=2))
from trainer.extensions import ema
from trainer.task import models
from trainer.task import steps
from trainer.loops.sync import TrainLoop
from trainer import data

source = data.Digits()
result = {}
for name in ("default", "mirrored", "central_storage"):
    strategy = strategies.make_strategy(name)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = models.cnn(source.input_shape, source.num_classes, filters=(8,), dense_units=16)
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
        step = tf.Variable(0, dtype=tf.int64, trainable=False, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        average = ema.WeightAverage(model, 0.9)
    loop = TrainLoop(strategy, model, optimizer, steps.classification_step, 32,
                     data.distribute_train(strategy, source, 32, seed=0), step, after_update=average.update)
    loop.run(5)
    copies = [[c.numpy() for c in strategy.experimental_local_results(a)] for a in average.averages]
    weights = [v.numpy() for v in model.trainable_variables]
    with average.swapped_in():
        swapped = [v.numpy() for v in model.trainable_variables]
    back = [v.numpy() for v in model.trainable_variables]
    result[name] = {
        "copies": len(copies[0]), "aggregation": str(average.averages[0].aggregation),
        "copies_equal": all(np.array_equal(c[0], other) for c in copies for other in c),
        "ema_vs_weights": max(float(np.abs(c[0] - w).max()) for c, w in zip(copies, weights)),
        "swapped_in": all(np.array_equal(s, c[0]) for s, c in zip(swapped, copies)),
        "swapped_back": all(np.array_equal(b, w) for b, w in zip(back, weights)),
        "ema": [c[0].tolist() for c in copies],
    }
print(json.dumps(result))
"""
    result = run_python(script)
    for name in ("mirrored", "central_storage"):
        r = result[name]
        assert r["copies_equal"] and r["swapped_in"] and r["swapped_back"], name
        assert r["ema_vs_weights"] > 1e-4, name
        for got, expected in zip(r["ema"], result["default"]["ema"]):
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6, err_msg=name)
    assert result["mirrored"]["copies"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ema_and_export_of_final_and_best_under_two_multi_worker_mirrored_workers(tmp_path):
    model_dir, scratch = str(tmp_path / "run"), tmp_path / "scratch"
    scratch.mkdir()
    launch_workers(
        "--gin_file=gin/mwms.gin",
        f"--model_dir={model_dir}",
        *SMALL[1:],
        "--gin_bindings=train.total_steps=40",
        "--gin_bindings=train.export_saved_model=True",
        "--gin_bindings=train.keep_best=1",
        "--gin_bindings=train.best_mode='max'",  # best: step 20
        env=subprocess_env(TMPDIR=str(scratch)),
    )
    raw, averaged = evals(model_dir, "eval"), evals(model_dir, "eval_ema")
    print("mwms eval", raw[40], "ema", averaged[40])
    assert (
        list(averaged) == [20, 40] and abs(raw[40]["loss"] - averaged[40]["loss"]) > 1e-3
    )  # one writer, other weights
    for step in (20, 40):  # the best checkpoint's and the final one
        assert os.path.exists(os.path.join(model_dir, "export", str(step), "saved_model.pb"))
    assert sorted(os.listdir(os.path.join(model_dir, "export"))) == ["20", "40"]
    assert [p for p in scratch.rglob("*") if "trainer" in p.name] == []  # worker 1's temp exports deleted


@pytest.mark.slow
def test_bad_decay_is_one_line_and_parameter_server_is_refused(tmp_path):
    model_dir = tmp_path / "run"
    proc = run_main(
        "--gin_file=gin/single.gin", f"--model_dir={model_dir}", "--gin_bindings=train.ema_decay=1.0", timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train.ema_decay must be a number > 0 and < 1" in errors[0], errors
    assert not model_dir.exists()
    with pytest.raises(UserError, match="train.ema_decay is not supported with parameter_server"):
        Registry([ema.Ema(0.9)], Settings(strategy="parameter_server"))  # before the runtime is made


def test_the_average_moves_by_the_decay_swaps_in_and_out_and_resets():
    """WeightAverage on one device: average := d * average + (1 - d) * weight after each update."""
    import keras
    import tensorflow as tf

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, kernel_initializer="ones")])
    average = ema.WeightAverage(model, decay=0.75)
    kernel = model.trainable_variables[0]
    kernel.assign(tf.fill(kernel.shape, 5.0))
    tf.function(average.update)()
    np.testing.assert_allclose(average.averages[0].numpy(), 0.75 * 1.0 + 0.25 * 5.0)
    with average.swapped_in():
        np.testing.assert_allclose(kernel.numpy(), 2.0)  # the model evaluates with the averages
    np.testing.assert_allclose(kernel.numpy(), 5.0)
    np.testing.assert_allclose(average.averages[0].numpy(), 2.0)
    average.reset()
    np.testing.assert_allclose(average.averages[0].numpy(), 5.0)
    assert not any(v.trainable for v in average.averages) and len(average.averages) == 2  # kernel and bias
