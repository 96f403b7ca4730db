"""--mode=predict: outputs equal to Keras `predict` on the restored model, every example once in input order,
under one device, mirrored, parameter_server (on one device) and 2 launched MultiWorkerMirrored workers."""

from __future__ import annotations

import io
import os
import re
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.support import launch_workers, refused_run, run_main
from trainer import data
from trainer.errors import UserError
from trainer.files.predictions import PredictionWriter, check_writable
from trainer.run.predict import Progress, chosen_checkpoint, output_keys, predict
from trainer.run.settings import Settings
from trainer.task import models as models_lib


def keras_predictions(model_dir: str, checkpoint: str) -> np.ndarray:
    """`model.predict` over the digits' eval split of the tutorial CNN restored from `checkpoint`."""
    x, _ = data.Digits().arrays("eval")
    model = models_lib.cnn(input_shape=x.shape[1:], num_classes=10)
    model(tf.zeros([1, *x.shape[1:]]))
    tf.train.Checkpoint(model=model).restore(os.path.join(model_dir, checkpoint)).expect_partial()
    return model.predict(x, batch_size=128, verbose=0)


def test_writer_streams_rows_into_one_npz_and_leaves_nothing_when_discarded(tmp_path):
    path = str(tmp_path / "out" / "p.npz")
    with PredictionWriter(path) as writer:
        assert not os.path.exists(tmp_path / "out")  # nothing before the first rows
        for start, stop in ((0, 3), (3, 6), (6, 7)):
            rows = np.arange(start, stop)
            writer.append({"a/b": rows.astype(np.float16)[:, None] * np.float16([1, 2]), "id": rows})
        assert writer.finish() == path
    loaded = np.load(path)
    assert sorted(loaded.files) == ["a/b", "id"] and loaded["a/b"].dtype == np.float16
    np.testing.assert_array_equal(loaded["id"], np.arange(7))
    np.testing.assert_array_equal(loaded["a/b"], np.arange(7)[:, None] * [1, 2])
    assert os.listdir(tmp_path / "out") == ["p.npz"]
    with pytest.raises(UserError, match="changed from rows of"), PredictionWriter(str(tmp_path / "q.npz")) as writer:
        writer.append({"x": np.zeros([2, 3])})
        writer.append({"x": np.zeros([2, 4])})
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_output_keys_flatten_nested_structures():
    assert list(output_keys(1)) == ["output"]
    assert list(output_keys({"b": {"y": 1, "x": 2}, "a": [3, (4,)]})) == ["a/0", "a/1/0", "b/x", "b/y"]


def test_progress_is_a_live_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("TERM", "xterm")
    lines, terminal = [], Terminal()
    for stream in (io.StringIO(), terminal):
        progress = Progress(3, 2, 4, lines.append, enabled=True, stream=stream)
        for done in (1, 2, 3):
            progress.update(done)
        progress.finish()
    assert [line.split("  ")[0] for line in lines] == ["predict step 2/3", "predict step 3/3"]
    assert "steps/s" in lines[-1] and "ex/s" in lines[-1] and "ETA 0:00:00" in lines[-1]
    drawn = terminal.getvalue()
    assert drawn.count("\r") == 3 and "step 3/3 [" in drawn and "100%" in drawn and drawn.endswith("\n")


def test_refusals_name_the_checkpoint_and_the_output(tmp_path):
    (tmp_path / "file").write_text("")
    for path, problem in ((tmp_path / "file" / "p.npz", "not a writable directory"), (tmp_path, "is a directory")):
        with pytest.raises(UserError, match=problem):
            check_writable(str(path))
    with pytest.raises(UserError, match=r"no checkpoint in .*: train first"):
        chosen_checkpoint(str(tmp_path), None)
    with pytest.raises(
        UserError, match="--mode=predict is not supported with tpu; it works with every strategy but tpu"
    ):
        predict(Settings(model_dir=str(tmp_path), strategy="tpu"))
    with pytest.raises(UserError, match="predict.batch_size must be a positive integer, got 0"):
        predict(Settings(model_dir=str(tmp_path)), batch_size=0)
    with pytest.raises(UserError, match="--mode=predict needs --model_dir=DIR"):
        predict(Settings())
    assert sorted(os.listdir(tmp_path)) == ["file"]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.xdist_group("single_runs")
def test_one_device_and_parameter_server_equal_keras_predict(trained_single_dir, tmp_path):
    model_dir = str(tmp_path / "run")
    shutil.copytree(trained_single_dir, model_dir)
    lines: list[str] = []
    path, count = predict(Settings(model_dir=model_dir, log_every_steps=2), print_fn=lines.append)
    assert path == os.path.join(model_dir, "predictions", "eval-ckpt-60.npz") and count == 359
    assert lines[-1] == f"predictions: {path} (359 examples)"
    assert [line.split("  ")[0] for line in lines[1:-1]] == ["predict step 2/6", "predict step 4/6", "predict step 6/6"]
    assert "ETA" in lines[-2]
    loaded = np.load(path)
    assert loaded.files == ["output"]
    np.testing.assert_allclose(loaded["output"], keras_predictions(model_dir, "ckpt-60"), atol=1e-5)

    older, _ = predict(
        Settings(model_dir=model_dir, strategy="parameter_server"), checkpoint="ckpt-30", print_fn=lines.append
    )
    assert older.endswith("eval-ckpt-30.npz") and "restored without its cluster" in lines[-3]
    np.testing.assert_allclose(np.load(older)["output"], keras_predictions(model_dir, "ckpt-30"), atol=1e-5)
    assert np.abs(np.load(older)["output"] - loaded["output"]).max() > 0.1  # another checkpoint, other outputs

    for settings, kwargs, problem in (
        (
            Settings(model_dir=model_dir),
            {"checkpoint": "ckpt-7"},
            r"--checkpoint=ckpt-7: .* has no ckpt-7 \(it has ckpt-30, ckpt-60\)",
        ),
        (Settings(model_dir=model_dir), {"split": "test"}, "has no split 'test'"),
        (Settings(model_dir=model_dir), {"predict_step_fn": number_step}, "number_step returned float at 'output'"),
    ):
        with pytest.raises(UserError, match=problem):
            predict(settings, output=str(tmp_path / "refused.npz"), **kwargs)
    assert sorted(os.listdir(tmp_path)) == ["run"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_ema_weights_equal_keras_predict_with_the_averages_loaded(tmp_path):
    model_dir = str(tmp_path / "run")
    proc = run_main(
        "--gin_file=gin/single.gin",
        f"--model_dir={model_dir}",
        *(f"--gin_bindings=train.{b}" for b in ("model_fn=@mlp", "total_steps=20", "steps_per_loop=10")),
        *(f"--gin_bindings=train.{b}" for b in ("checkpoint_every_steps=20", "eval_every_steps=20", "ema_decay=0.9")),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    settings = Settings(model_dir=model_dir, model_fn=models_lib.mlp, ema_decay=0.9)
    lines: list[str] = []
    path, count = predict(settings, weights=["ema"], print_fn=lines.append)
    assert path.endswith("predictions/eval-ckpt-20-ema.npz") and count == 359
    assert lines[0].startswith("predicting Sequential with the ema weights of ckpt-20 (step 20)"), lines[0]
    own, _ = predict(settings, print_fn=lines.append)
    assert own.endswith("predictions/eval-ckpt-20.npz")

    x, _ = data.Digits().arrays("eval")
    model = models_lib.mlp(input_shape=x.shape[1:], num_classes=10)
    model(tf.zeros([1, *x.shape[1:]]))
    checkpoint = os.path.join(model_dir, "ckpt-20")
    tf.train.Checkpoint(model=model).restore(checkpoint).expect_partial()
    np.testing.assert_allclose(np.load(own)["output"], model.predict(x, batch_size=128, verbose=0), atol=1e-5)
    reader = tf.train.load_checkpoint(checkpoint)
    for index, variable in enumerate(model.trainable_variables):
        variable.assign(reader.get_tensor(f"ema/averages/{index}/.ATTRIBUTES/VARIABLE_VALUE"))
    ema = np.load(path)["output"]
    np.testing.assert_allclose(ema, model.predict(x, batch_size=128, verbose=0), atol=1e-5)
    assert np.abs(ema - np.load(own)["output"]).max() > 0.01

    for weights, problem in (
        (["swa"], r"--weights=swa: this run keeps no such weights \(it keeps model, ema\); name one"),
        (["model", "ema"], "--weights=model,ema: --mode=predict writes the outputs of one kind of weights; name one"),
    ):
        with pytest.raises(UserError, match=problem):
            predict(settings, weights=weights, output=str(tmp_path / "refused.npz"))
    assert sorted(os.listdir(tmp_path)) == ["run"]


def number_step(model, batch):
    return 1.0


def two_models(input_shape, num_classes=3):
    def one(units, activation):
        return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(units, activation=activation)])

    return {"a": one(num_classes, None), "b": one(2, "tanh")}


def small_input(split):
    """37 examples to predict (not a multiple of the batch: padded, then dropped), others to build on."""
    count = {"train": 16, "eval": 16, "predict": 37}[split]
    x = np.random.RandomState(count).normal(size=(count, 4)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, np.arange(count) % 3))


def nested_step(model, batch):
    x, _ = batch
    return {"scores": {key: m(x) for key, m in model.items()}, "first": [x[:, 0]]}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_dict_of_models_by_key_and_a_step_of_nested_outputs(tmp_path):
    """A checkpoint of two models with weights unlike a fresh build's, written as a run writes them."""
    rng = np.random.RandomState(7)
    models = two_models((4,), 3)
    for variable in [v for m in models.values() for v in m.variables]:
        variable.assign(rng.normal(size=variable.shape).astype(np.float32))
    step = tf.Variable(5, dtype=tf.int64)
    tf.train.CheckpointManager(tf.train.Checkpoint(model=models, global_step=step), str(tmp_path), 1).save(5)
    settings = Settings(model_dir=str(tmp_path), model_fn=two_models, input_fn=small_input, global_batch_size=8)
    x = np.stack([features for features, _ in small_input("predict").as_numpy_iterator()])

    path, count = predict(settings, input_fn=small_input, print_fn=lambda line: None)
    assert path.endswith("predictions/predict-ckpt-5.npz") and count == 37
    loaded = np.load(path)
    assert sorted(loaded.files) == ["a", "b"]
    for key, model in models.items():
        np.testing.assert_allclose(loaded[key], model.predict(x, verbose=0), atol=1e-5)

    path, _ = predict(settings, input_fn=small_input, predict_step_fn=nested_step, output=str(tmp_path / "n.npz"))
    nested = np.load(path)
    assert sorted(nested.files) == ["first/0", "scores/a", "scores/b"]
    np.testing.assert_array_equal(nested["first/0"], x[:, 0])  # every example once, in input order
    np.testing.assert_allclose(nested["scores/b"], loaded["b"], atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("single_runs")
def test_mirrored_and_two_launched_workers_write_every_example_once_in_order(trained_single_dir, tmp_path):
    """359 examples in batches of 50: the last global batch padded, split across 2 replicas."""
    common = [f"--model_dir={trained_single_dir}", "--mode=predict", "--gin_bindings=predict.batch_size=50"]
    mirrored = run_main("--gin_file=gin/mirrored.gin", *common, f"--output={tmp_path}/m.npz", timeout=150)
    assert mirrored.returncode == 0, mirrored.stderr[-3000:]
    assert "on 2 replica(s) (1 worker(s))" in mirrored.stdout
    assert mirrored.stdout.strip().splitlines()[-1] == f"predictions: {tmp_path}/m.npz (359 examples)"
    np.testing.assert_allclose(
        np.load(tmp_path / "m.npz")["output"], keras_predictions(trained_single_dir, "ckpt-60"), atol=1e-5
    )

    launched = launch_workers(
        "--gin_file=gin/mwms.gin", *common, "--checkpoint=ckpt-30", f"--output={tmp_path}/w.npz", timeout=200
    )
    lines = launched.stdout.strip().splitlines()
    assert not any("[worker 1]" in line for line in lines)
    assert lines[-1] == f"[worker 0] predictions: {tmp_path}/w.npz (359 examples)"
    np.testing.assert_allclose(
        np.load(tmp_path / "w.npz")["output"], keras_predictions(trained_single_dir, "ckpt-30"), atol=1e-5
    )
    assert sorted(os.listdir(tmp_path)) == ["m.npz", "w.npz"]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--mode=predict"],
            r"error: no checkpoint in \S+: train first, or pass the --model_dir of a run that saved one",
        ),
        (
            ["--mode=predict", "--weights=model,ema"],
            r"error: --weights=model,ema: --mode=predict writes the outputs of one kind of weights; name one",
        ),
        (
            ["--output=p.npz"],
            r"error: --output is an option of --mode=predict, not of --mode=train; drop it or add --mode=predict",
        ),
    ],
    ids=["no checkpoint", "two kinds of weights", "output without predict"],
)
def test_a_refused_prediction_is_one_error_line(tmp_path, args, expected):
    assert re.fullmatch(expected, refused_run(tmp_path, "--gin_file=gin/single.gin", *args))
