"""The tutorial's Fashion-MNIST run with Keras `fit`: the reference that fashion_mnist.gin reproduces.

Its steps as the tutorial takes them: `keras.datasets.fashion_mnist.load_data()`; the FIRST
5,000 training images held out for validation; a StandardScaler fitted on the 55,000 training
images' pixels as one column (`reshape(-1, 1)`: one mean, one deviation) and applied to all
three sets; `tf.data` from_tensor_slices, shuffle(10000), repeat, batch(128), prefetch(50); the
Sequential CNN ending in a softmax (Keras' default 'valid' pooling); compile with
sparse_categorical_crossentropy, 'sgd' and accuracy; fit for 10 epochs of 55000 // 128 steps.
Then it evaluates on the validation and test images, which the tutorial leaves out. It imports
only TensorFlow, Keras, scikit-learn and NumPy, nothing of this framework.

load_data reads the files `fashion_mnist` reads: `--data_dir`, else Keras' cache, else
/usr/share/datasets/fashion-mnist (apt-get install dataset-fashion-mnist). Files outside
Keras' cache are linked into a temporary KERAS_HOME for it, so nothing is downloaded.

    python experiments/fashion_mnist/tutorial_fit.py [--data_dir=DIR] [--seed=0] [--json=FILE]

`--seed` (Keras' `set_random_seed`) fixes the initial weights and the shuffle; the tutorial
sets none. `--epochs` and `--steps_per_epoch` shorten the run to estimate its time.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time

FILES = (
    "train-labels-idx1-ubyte.gz",
    "train-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
)
SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
VALIDATION_SIZE = 5000
BATCH_SIZE = 128


def keras_cache() -> str:
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "datasets", "fashion-mnist")


def complete(directory: str) -> bool:
    return all(os.path.isfile(os.path.join(directory, name)) for name in FILES)


def point_keras_at(data_dir: str | None) -> str:
    """The directory load_data will read; sets KERAS_HOME (before Keras is imported) where needed."""
    if data_dir is None:
        data_dir = next((d for d in (keras_cache(), SYSTEM_DIR) if complete(d)), None)
        if data_dir is None:
            sys.exit(
                f"error: Fashion-MNIST files are missing from {keras_cache()} and {SYSTEM_DIR}: "
                "run `apt-get install dataset-fashion-mnist` or pass --data_dir"
            )
    elif not complete(data_dir):
        sys.exit(f"error: --data_dir {data_dir} lacks some of {', '.join(FILES)}")
    if os.path.realpath(data_dir) != os.path.realpath(keras_cache()):
        home = tempfile.mkdtemp(prefix="keras_home_")
        atexit.register(shutil.rmtree, home, ignore_errors=True)
        os.makedirs(os.path.join(home, "datasets", "fashion-mnist"))
        for name in FILES:
            os.symlink(
                os.path.realpath(os.path.join(data_dir, name)), os.path.join(home, "datasets", "fashion-mnist", name)
            )
        os.environ["KERAS_HOME"] = home
    return data_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", help="directory of the four Fashion-MNIST .gz files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps_per_epoch", type=int, default=None, help="default: 55000 // 128 = 429")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    data_dir = point_keras_at(args.data_dir)

    import numpy as np
    import tensorflow as tf
    from sklearn.preprocessing import StandardScaler
    from tensorflow import keras

    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}; files from {data_dir}", flush=True)
    for gpu in tf.config.list_physical_devices("GPU"):  # the tutorial's GPU setting; nothing on a CPU
        tf.config.experimental.set_memory_growth(gpu, True)
    keras.utils.set_random_seed(args.seed)

    (x_train_all, y_train_all), (x_test, y_test) = keras.datasets.fashion_mnist.load_data()
    x_valid, x_train = x_train_all[:VALIDATION_SIZE], x_train_all[VALIDATION_SIZE:]
    y_valid, y_train = y_train_all[:VALIDATION_SIZE], y_train_all[VALIDATION_SIZE:]

    scaler = StandardScaler()
    x_train_scaled = scaler.fit_transform(x_train.astype(np.float32).reshape(-1, 1)).reshape(-1, 28, 28, 1)
    x_valid_scaled = scaler.transform(x_valid.astype(np.float32).reshape(-1, 1)).reshape(-1, 28, 28, 1)
    x_test_scaled = scaler.transform(x_test.astype(np.float32).reshape(-1, 1)).reshape(-1, 28, 28, 1)
    print(f"scaler: mean {scaler.mean_[0]:.4f}, standard deviation {scaler.scale_[0]:.4f}", flush=True)

    def make_dataset(images, labels, epochs, batch_size, shuffle=True):
        dataset = tf.data.Dataset.from_tensor_slices((images, labels))
        if shuffle:
            dataset = dataset.shuffle(10000)
        return dataset.repeat(epochs).batch(batch_size).prefetch(50)

    train_dataset = make_dataset(x_train_scaled, y_train, args.epochs, BATCH_SIZE)

    model = keras.models.Sequential()
    model.add(
        keras.layers.Conv2D(filters=32, kernel_size=3, padding="same", activation="relu", input_shape=(28, 28, 1))
    )
    model.add(keras.layers.Conv2D(filters=32, kernel_size=3, padding="same", activation="relu"))
    model.add(keras.layers.MaxPool2D(pool_size=2))
    model.add(keras.layers.Conv2D(filters=64, kernel_size=3, padding="same", activation="relu"))
    model.add(keras.layers.Conv2D(filters=64, kernel_size=3, padding="same", activation="relu"))
    model.add(keras.layers.MaxPool2D(pool_size=2))
    model.add(keras.layers.Conv2D(filters=128, kernel_size=3, padding="same", activation="relu"))
    model.add(keras.layers.Conv2D(filters=128, kernel_size=3, padding="same", activation="relu"))
    model.add(keras.layers.MaxPool2D(pool_size=2))
    model.add(keras.layers.Flatten())
    model.add(keras.layers.Dense(128, activation="relu"))
    model.add(keras.layers.Dense(10, activation="softmax"))
    model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd", metrics=["accuracy"])
    model.summary()

    epoch_seconds = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epoch_seconds.append(time.perf_counter() - self.started)

    steps_per_epoch = args.steps_per_epoch or x_train_scaled.shape[0] // BATCH_SIZE
    history = model.fit(
        train_dataset, steps_per_epoch=steps_per_epoch, epochs=args.epochs, callbacks=[EpochTimer()], verbose=2
    )
    results = {
        "data_dir": data_dir,
        "seed": args.seed,
        "steps": steps_per_epoch * args.epochs,
        "parameters": model.count_params(),
        "scaler_mean": float(scaler.mean_[0]),
        "scaler_std": float(scaler.scale_[0]),
        "epoch_seconds": [round(s, 1) for s in epoch_seconds],
        "train_loss": [round(v, 4) for v in history.history["loss"]],
    }
    for name, (x, y) in (("validation", (x_valid_scaled, y_valid)), ("test", (x_test_scaled, y_test))):
        loss, accuracy = model.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0)
        results[name] = {"loss": round(loss, 4), "accuracy": round(accuracy, 4), "examples": len(y)}
    print(json.dumps(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
