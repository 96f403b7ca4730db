"""train.export_saved_model: the SavedModel reloaded with tf.saved_model.load predicts what the
model restored from the final checkpoint predicts (raw weights, and the EMA weights with EMA on),
under the default strategy and mirrored (2 logical CPUs); refusals are one line."""

from __future__ import annotations

import os

import pytest

from tests.support import main_in_one_process, run_python
from trainer.errors import UserError
from trainer.extensions import export
from trainer.extensions.registry import Registry
from trainer.run.settings import Settings

SMALL = [
    "--gin_bindings=cnn.filters=(8,)",
    "--gin_bindings=cnn.dense_units=16",
    "--gin_bindings=train.total_steps=20",
    "--gin_bindings=train.steps_per_loop=10",
    "--gin_bindings=train.export_saved_model=True",
]

COMPARE = """
import json
import numpy as np
import tensorflow as tf
from trainer import data
from trainer.task import models
from trainer.extensions import ema

model_dir, with_ema, checkpoint_path, step = MODEL_DIR, WITH_EMA, CHECKPOINT, STEP
source = data.Digits()
model = models.cnn(source.input_shape, source.num_classes, filters=(8,), dense_units=16)
checkpoint = tf.train.Checkpoint(model=model)
if with_ema:
    checkpoint.ema = ema.WeightAverage(model, 0.9)
checkpoint.read(checkpoint_path or tf.train.latest_checkpoint(model_dir)).expect_partial()
if with_ema:
    for weight, average in zip(model.trainable_variables, checkpoint.ema.averages):
        weight.assign(average)
images = np.stack([x for x, _ in source("eval").take(100).as_numpy_iterator()])
loaded = tf.saved_model.load(f"{model_dir}/export/{step}")
serve = loaded.signatures["serving_default"]
exported = serve(features=tf.constant(images))["outputs"].numpy()
in_memory = model(images, training=False).numpy()
print(json.dumps({"max_diff": float(np.abs(exported - in_memory).max()), "inputs": list(serve.structured_input_signature[1]),
                  "spread": float(in_memory.std())}))
"""


def compare(model_dir: str, with_ema: bool, checkpoint: str | None = None, step: int = 20) -> dict:
    """The exported model's predictions against the model restored from `checkpoint` (default: the latest)."""
    code = COMPARE.replace("MODEL_DIR", repr(model_dir)).replace("WITH_EMA", repr(with_ema))
    return run_python(code.replace("CHECKPOINT", repr(checkpoint)).replace("STEP", repr(step)))


BEST = [  # the worst loss wins: step 20
    "--gin_bindings=train.ema_decay=0.9",
    "--gin_bindings=train.total_steps=40",
    "--gin_bindings=train.eval_every_steps=20",
    "--gin_bindings=train.keep_best=1",
    "--gin_bindings=train.best_mode='max'",
]


@pytest.fixture(scope="module")
def exporting_runs(tmp_path_factory) -> tuple[str, dict]:
    """The exporting runs in one interpreter (main_in_one_process: one TensorFlow start instead of three),
    mirrored with EMA first (TensorFlow splits the CPU before its first run), then one device raw, and one
    device exporting its best checkpoint too; the exports are read back in fresh processes. (their folder,
    outcomes by name); each run's model_dir is <folder>/<name>."""
    root = str(tmp_path_factory.mktemp("exporting"))
    cases = {
        "mirrored": ["--gin_file=gin/mirrored.gin", *SMALL, "--gin_bindings=train.ema_decay=0.9"],
        "single": ["--gin_file=gin/single.gin", *SMALL],
        "best": ["--gin_file=gin/single.gin", *SMALL, *BEST],
    }
    return root, main_in_one_process({name: (args, os.path.join(root, name)) for name, args in cases.items()})


def exported(runs: tuple[str, dict], name: str) -> tuple[str, str]:
    """The model_dir and stdout of run `name`, checked to have exited 0."""
    root, outcomes = runs
    assert outcomes[name]["code"] == 0, outcomes[name]["stderr"][-3000:]
    return os.path.join(root, name), outcomes[name]["stdout"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("exporting_runs")
@pytest.mark.parametrize("gin_file,with_ema", [("gin/single.gin", False), ("gin/mirrored.gin", True)])
def test_exported_saved_model_predicts_like_the_restored_model(exporting_runs, gin_file, with_ema):
    model_dir, stdout = exported(exporting_runs, os.path.basename(gin_file).removesuffix(".gin"))
    assert f"exported SavedModel{' (EMA weights)' if with_ema else ''} to {model_dir}/export/20" in stdout
    assert os.listdir(os.path.join(model_dir, "export")) == ["20"]  # no partial directory left beside it
    result = compare(model_dir, with_ema)
    print(gin_file, "ema" if with_ema else "raw", result)
    assert result["inputs"] == ["features"] and result["spread"] > 0.01
    assert result["max_diff"] <= 1e-6


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("exporting_runs")
def test_the_best_checkpoint_is_exported_too(exporting_runs):
    model_dir, stdout = exported(exporting_runs, "best")
    assert f"of the best checkpoint by loss to {model_dir}/export/20" in stdout
    assert sorted(os.listdir(os.path.join(model_dir, "export"))) == ["20", "40"]
    best = compare(model_dir, True, os.path.join(model_dir, "best", "ckpt-20"), 20)
    final = compare(model_dir, True, None, 40)  # the final weights were put back after the best export
    print("best", best, "final", final)
    assert best["max_diff"] <= 1e-6 and final["max_diff"] <= 1e-6


REFUSED = {
    "two_models": (
        [
            "--gin_file=gin/single.gin",
            "--gin_file=experiments/gan/gan.gin",
            "--gin_bindings=train.export_saved_model=True",
        ],
        "exports one model",
    ),
    "not_a_bool": (["--gin_file=gin/single.gin", "--gin_bindings=train.export_saved_model='yes'"], "True or False"),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> tuple[str, dict[str, dict]]:
    """Each case of REFUSED with a new model_dir, both in one interpreter; (their folder, outcomes)."""
    root = tmp_path_factory.mktemp("refusals")
    cases = {name: (args, str(root / name)) for name, (args, _) in REFUSED.items()}
    return str(root), main_in_one_process(cases, timeout=120)


@pytest.mark.slow
@pytest.mark.xdist_group("export_refusals")
@pytest.mark.parametrize("name", list(REFUSED))
def test_refusals_are_one_line_and_write_nothing(refusals, name):
    root, outcomes = refusals
    outcome, expected = outcomes[name], REFUSED[name][1]
    assert outcome["code"] == 2, outcome["stderr"][-2000:]
    errors = [line for line in outcome["stderr"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0] and "train.export_saved_model" in errors[0], errors
    model_dir = os.path.join(root, name)
    assert not os.path.exists(model_dir) or not os.listdir(model_dir)


def test_parameter_server_is_refused():
    with pytest.raises(UserError, match="train.export_saved_model is not supported with parameter_server"):
        Registry([export.Export()], Settings(strategy="parameter_server"))  # before the runtime is made


def test_the_serving_signature_batches_the_features_of_one_example():
    import tensorflow as tf

    image = tf.TensorSpec([8, 8, 1], tf.float32)
    label = tf.TensorSpec([], tf.int64)
    assert export.serving_spec((image, label)) == tf.TensorSpec([None, 8, 8, 1], tf.float32, name="features")
    assert export.serving_spec(image) == tf.TensorSpec([None, 8, 8, 1], tf.float32, name="features")
    ids = tf.TensorSpec([5], tf.int32)
    assert export.serving_spec(({"ids": ids, "image": image}, label, tf.TensorSpec([], tf.float32))) == {
        "ids": tf.TensorSpec([None, 5], tf.int32, name="ids"),
        "image": tf.TensorSpec([None, 8, 8, 1], tf.float32, name="image"),
    }
    with pytest.raises(UserError, match=r"needs the model's input to be a tensor or a dict of tensors"):
        export.serving_spec(((image, image), label))
    with pytest.raises(UserError, match=r"returned models \['critic', 'generator'\]; export them yourself"):
        export.check_exportable({"generator": None, "critic": None})
    export.check_exportable(object())
