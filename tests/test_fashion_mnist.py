"""The tutorial's Fashion-MNIST run (experiments/fashion_mnist): its split, scaling and model against
the tutorial's own NumPy, scikit-learn and Keras code, its config end to end on small idx files
written in the Fashion-MNIST layout, the old option forms refused, and a short run on the real
files where Debian's dataset-fashion-mnist package has installed them."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
from sklearn.preprocessing import StandardScaler

from tests.support import main_in_one_process, read_jsonl, run_main, write_idx
from trainer import data
from trainer.data import fashion_mnist_files
from trainer.task import models

GIN = "experiments/fashion_mnist/fashion_mnist.gin"
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 700),
    "eval": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 150),
}
TUTORIAL_PARAMETERS = 435_306


def _write_fashion_mnist(directory: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Images whose brightness pattern depends on the class, so a few steps learn something."""
    rng = np.random.RandomState(0)
    raw = {}
    for split, (images_file, labels_file, count) in FILES.items():
        labels = rng.randint(0, 10, count)
        images = rng.randint(0, 60, (count, 28, 28))
        for i, label in enumerate(labels):
            images[i, label * 2 : label * 2 + 8, :] += 190
        write_idx(os.path.join(directory, images_file), 2051, images)
        write_idx(os.path.join(directory, labels_file), 2049, labels)
        raw[split] = images.astype(np.uint8), labels.astype(np.uint8)
    return raw


def _tutorial_model() -> keras.Sequential:
    """The tutorial's Sequential, layer for layer."""
    model = keras.models.Sequential([keras.Input((28, 28, 1))])
    for filters in (32, 64, 128):
        model.add(keras.layers.Conv2D(filters=filters, kernel_size=3, padding="same", activation="relu"))
        model.add(keras.layers.Conv2D(filters=filters, kernel_size=3, padding="same", activation="relu"))
        model.add(keras.layers.MaxPool2D(pool_size=2))
    model.add(keras.layers.Flatten())
    model.add(keras.layers.Dense(128, activation="relu"))
    model.add(keras.layers.Dense(10, activation="softmax"))
    return model


def test_split_and_scaling_are_the_tutorials_numpy_and_standard_scaler(tmp_path):
    raw = _write_fashion_mnist(str(tmp_path))
    source = data.FashionMnist(str(tmp_path), validation_size=100, validation_from="front", standardize="global")
    # The tutorial's lines, with 100 held out of 700 instead of 5,000 of 60,000.
    (x_train_all, y_train_all), (x_test, y_test) = raw["train"], raw["eval"]
    x_valid, x_train = x_train_all[:100], x_train_all[100:]
    y_valid, y_train = y_train_all[:100], y_train_all[100:]
    scaler = StandardScaler()
    x_train_scaled = scaler.fit_transform(x_train.astype(np.float32).reshape(-1, 1)).reshape(-1, 28, 28, 1)
    x_valid_scaled = scaler.transform(x_valid.astype(np.float32).reshape(-1, 1)).reshape(-1, 28, 28, 1)
    x_test_scaled = scaler.transform(x_test.astype(np.float32).reshape(-1, 1)).reshape(-1, 28, 28, 1)

    assert source.splits == ("train", "validation", "eval")
    for split, (images, labels) in (
        ("train", (x_train_scaled, y_train)),
        ("validation", (x_valid_scaled, y_valid)),
        ("eval", (x_test_scaled, y_test)),
    ):
        got_images, got_labels = source.arrays(split)
        assert got_images.dtype == np.float32 and got_images.shape == images.shape
        # 1e-6 is a few float32 ulps of these values (up to ~3): StandardScaler has applied its
        # statistics in float64 in some versions, in float32 in others (as this source does).
        np.testing.assert_allclose(got_images, images, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(got_labels, labels)
    # One mean and one deviation for every pixel: the contrast between pixels is kept.
    train = source.arrays("train")[0]
    np.testing.assert_allclose(train * scaler.scale_[0] + scaler.mean_[0], x_train[..., None], atol=1e-3)

    back = data.FashionMnist(str(tmp_path), validation_size=100, validation_from="back").arrays
    np.testing.assert_array_equal(back("validation")[0][..., 0], x_train_all[600:] / np.float32(255))
    np.testing.assert_array_equal(back("train")[1], y_train_all[:600])
    # Per pixel, as an option: each pixel on its own scale, unlike the tutorial's.
    per_pixel = data.FashionMnist(
        str(tmp_path), validation_size=100, validation_from="front", standardize="per_pixel"
    ).arrays("train")[0]
    np.testing.assert_allclose(per_pixel.std(axis=0), 1, atol=1e-4)
    assert np.abs(train.std(axis=0) - 1).max() > 0.3


def test_valid_pooling_is_the_tutorials_sequential_with_logits():
    ours = models.cnn((28, 28, 1), 10, filters=(32, 64, 128), pool_padding="valid")
    tutorial = _tutorial_model()
    assert [type(layer).__name__ for layer in ours.layers] == [type(layer).__name__ for layer in tutorial.layers]
    assert [layer.output.shape for layer in ours.layers] == [layer.output.shape for layer in tutorial.layers]
    assert [layer.count_params() for layer in ours.layers] == [layer.count_params() for layer in tutorial.layers]
    assert ours.layers[-4].output.shape == (None, 3, 3, 128) and ours.layers[-3].output.shape == (None, 1152)
    assert ours.count_params() == tutorial.count_params() == TUTORIAL_PARAMETERS
    assert models.num_parameters(ours) == TUTORIAL_PARAMETERS
    # The one difference: ours ends in logits, the tutorial in their softmax.
    tutorial.set_weights(ours.get_weights())
    images = np.random.RandomState(0).normal(size=(8, 28, 28, 1)).astype(np.float32)
    np.testing.assert_allclose(keras.ops.softmax(ours(images)), tutorial(images), rtol=1e-5, atol=1e-7)
    # The default pools with 'same' padding, as every other config was trained.
    assert models.cnn((28, 28, 1), 10, filters=(32, 64, 128)).count_params() == 549_994


@pytest.mark.slow
def test_tutorial_config_trains_end_to_end_on_fashion_mnist_files(tmp_path):
    data_dir, model_dir = str(tmp_path / "fashion"), str(tmp_path / "run")
    os.makedirs(data_dir)
    _write_fashion_mnist(data_dir)
    proc = run_main(
        f"--gin_file={GIN}",
        f"--model_dir={model_dir}",
        f"--gin_bindings=fashion_mnist.data_dir='{data_dir}'",
        "--gin_bindings=fashion_mnist.validation_size=100",  # the tutorial holds out 5,000 of 60,000
        "--gin_bindings=train.total_steps=40",
        "--gin_bindings=train.steps_per_loop=20",
        "--gin_bindings=train.log_every_steps=20",
        "--gin_bindings=train.eval_every_steps=40",
        "--gin_bindings=train.checkpoint_every_steps=40",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy 'mirrored' on 2 replica(s)" in proc.stdout and "global batch 128" in proc.stdout

    with open(os.path.join(model_dir, "operative_config.gin")) as f:
        config = f.read()
    for binding in (
        "cnn.filters = (32, 64, 128)",
        "cnn.pool_padding = 'valid'",
        "make_optimizer.name = 'sgd'",
        "make_optimizer.learning_rate = 0.01",
        "train.global_batch_size = 128",
        "fashion_mnist.standardize = 'global'",
        "fashion_mnist.validation_from = 'front'",
    ):
        assert binding in config, binding
    with open(os.path.join(model_dir, "run_record.json")) as f:
        shapes = json.load(f)["model_variables"]
    assert sum(int(np.prod(shape)) for shape in shapes.values()) == TUTORIAL_PARAMETERS

    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    by_split = {r["split"]: r for r in records if r["step"] == 40 and r["split"] != "train"}
    assert set(by_split) == {"validation", "eval"}
    assert by_split["validation"]["accuracy"] > 0.3 and by_split["eval"]["accuracy"] > 0.3  # chance: 0.1
    assert os.path.isdir(os.path.join(model_dir, "eval", "validation"))
    assert "eval on validation at step 40" in proc.stdout and "(100 examples)" in proc.stdout
    assert "(150 examples)" in proc.stdout


OLD_FORMS = {
    "fashion_mnist.standardize = True": "'global' (one mean and deviation over all training pixels",
    "fashion_mnist.validation_size = 5000": "fashion_mnist.validation_from: 'front' holds out the first",
}


@pytest.fixture(scope="module")
def old_form_outcomes(tmp_path_factory) -> dict[str, dict]:
    """A gin file with each old form, run against a model_dir holding a user's file, in one interpreter."""
    root = tmp_path_factory.mktemp("old_forms")
    cases = {}
    for i, old in enumerate(OLD_FORMS):
        old_gin, model_dir = root / f"old{i}.gin", root / f"run{i}"
        old_gin.write_text(f"include 'gin/base.gin'\ntrain.data_source = @fashion_mnist()\n{old}\n")
        model_dir.mkdir()
        (model_dir / "notes.txt").write_text("keep\n")
        cases[old] = ([f"--gin_file={old_gin}", f"--gin_bindings=fashion_mnist.data_dir='{root}'"], str(model_dir))
    return main_in_one_process(cases, timeout=120)


@pytest.mark.slow
@pytest.mark.xdist_group("old_form_outcomes")
@pytest.mark.parametrize("old", list(OLD_FORMS))
def test_a_gin_file_with_an_old_option_form_is_refused_naming_the_new_one(old_form_outcomes, old):
    """`standardize = True` scaled per pixel and `validation_size` alone held out the last images:
    both are refused in one line that names the new forms, before model_dir is written."""
    outcome = old_form_outcomes[old]
    assert outcome["code"] == 2 and "Traceback" not in outcome["stderr"], outcome["stderr"][-3000:]
    lines = outcome["stderr"].strip().splitlines()
    assert lines[-1].startswith("error: ") and [line for line in lines if line.startswith("error:")] == lines[-1:]
    assert OLD_FORMS[old] in lines[-1], lines[-1]
    assert outcome["unchanged"]


@pytest.mark.slow
@pytest.mark.skipif(
    not all(
        os.path.isfile(os.path.join(fashion_mnist_files.SYSTEM_DIR, name))
        for pair in fashion_mnist_files.FILES.values()
        for name in pair
    ),
    reason=f"the real Fashion-MNIST files are not in {fashion_mnist_files.SYSTEM_DIR} "
    f"(`{fashion_mnist_files.INSTALL}` installs them)",
)
def test_the_tutorial_config_on_the_real_fashion_mnist_files(tmp_path):
    """Reads and checks Debian's files (sizes, headers, 6,000 and 1,000 labels of each class), and
    trains the config a few steps on one device: the tutorial's statistics, split sizes and model."""
    model_dir = str(tmp_path / "run")
    proc = run_main(
        f"--gin_file={GIN}",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.strategy='default'",
        f"--gin_bindings=fashion_mnist.data_dir='{fashion_mnist_files.SYSTEM_DIR}'",
        "--gin_bindings=train.total_steps=60",
        "--gin_bindings=train.steps_per_loop=30",
        "--gin_bindings=train.log_every_steps=30",
        "--gin_bindings=train.eval_every_steps=60",
        "--gin_bindings=train.checkpoint_every_steps=60",
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval on validation at step 60" in proc.stdout and "(5000 examples)" in proc.stdout
    assert "(10000 examples)" in proc.stdout
    with open(os.path.join(model_dir, "run_record.json")) as f:
        shapes = json.load(f)["model_variables"]
    assert sum(int(np.prod(shape)) for shape in shapes.values()) == TUTORIAL_PARAMETERS
    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    final = {r["split"]: r["accuracy"] for r in records if r["step"] == 60}
    assert final["validation"] > 0.2 and final["eval"] > 0.2, final  # chance: 0.1

    images, labels = fashion_mnist_files.read_split(fashion_mnist_files.SYSTEM_DIR, "train")
    assert images.shape == (60_000, 28, 28) and np.bincount(labels).tolist() == [6000] * 10
    train = images[5000:].astype(np.float64)
    assert (round(train.mean(), 2), round(train.std(), 2)) == (72.94, 89.99)  # the tutorial's StandardScaler
