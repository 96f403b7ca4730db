"""The tutorial's Fashion-MNIST run (experiments/fashion_mnist) end to end, on small idx files
written in the Fashion-MNIST layout: its model, optimizer, batch, standardisation and
validation hold-out as the tutorial has them, both eval splits reported."""
from __future__ import annotations

import os

import numpy as np

from tests.support import read_jsonl, run_main, write_idx

GIN = "experiments/fashion_mnist/fashion_mnist.gin"
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 700),
    "eval": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 150),
}



def _write_fashion_mnist(directory: str) -> None:
    """Images whose brightness pattern depends on the class, so a few steps learn something."""
    rng = np.random.RandomState(0)
    for images_file, labels_file, count in FILES.values():
        labels = rng.randint(0, 10, count)
        images = rng.randint(0, 60, (count, 28, 28))
        for i, label in enumerate(labels):
            images[i, label * 2:label * 2 + 8, :] += 190
        write_idx(os.path.join(directory, images_file), 2051, images)
        write_idx(os.path.join(directory, labels_file), 2049, labels)


def test_tutorial_config_trains_end_to_end_on_fashion_mnist_files(tmp_path):
    data_dir, model_dir = str(tmp_path / "fashion"), str(tmp_path / "run")
    os.makedirs(data_dir)
    _write_fashion_mnist(data_dir)
    proc = run_main(
        f"--gin_file={GIN}", f"--model_dir={model_dir}",
        f"--gin_bindings=fashion_mnist.data_dir='{data_dir}'",
        "--gin_bindings=fashion_mnist.validation_size=100",  # the tutorial holds out 5,000 of 60,000
        "--gin_bindings=train.total_steps=40", "--gin_bindings=train.steps_per_loop=20",
        "--gin_bindings=train.log_every_steps=20", "--gin_bindings=train.eval_every_steps=40",
        "--gin_bindings=train.checkpoint_every_steps=40", timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy 'mirrored' on 2 replica(s)" in proc.stdout and "global batch 128" in proc.stdout

    with open(os.path.join(model_dir, "operative_config.gin")) as f:
        config = f.read()
    for binding in ("cnn.filters = (32, 64, 128)", "make_optimizer.name = 'sgd'",
                    "make_optimizer.learning_rate = 0.01", "train.global_batch_size = 128",
                    "fashion_mnist.standardize = True"):
        assert binding in config, binding

    records = read_jsonl(os.path.join(model_dir, "metrics.jsonl"))
    by_split = {r["split"]: r for r in records if r["step"] == 40 and r["split"] != "train"}
    assert set(by_split) == {"validation", "eval"}
    assert by_split["validation"]["accuracy"] > 0.3 and by_split["eval"]["accuracy"] > 0.3  # chance: 0.1
    assert os.path.isdir(os.path.join(model_dir, "eval", "validation"))
    assert "eval on validation at step 40" in proc.stdout and "(100 examples)" in proc.stdout
    assert "(150 examples)" in proc.stdout
