"""Tests of trainer.data and trainer.write_tfrecords with real TensorFlow: shapes, order, resume, sharding."""

import gzip
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tests.support import write_idx
from trainer import data
from trainer.data import fashion_mnist_files, pipeline
from trainer.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batches(dataset: tf.data.Dataset, count: int) -> list:
    return [tuple(x.numpy() for x in batch) for batch in dataset.take(count)]


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b):
        for x, y in zip(left, right):
            np.testing.assert_array_equal(x, y)


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, **kwargs)


def test_digits_shapes_ranges_split_and_determinism():
    digits = data.Digits()
    assert digits.num_examples("train") + digits.num_examples("eval") == 1797
    assert digits.num_examples("eval") == round(1797 * 0.2)
    images, labels = next(iter(digits.examples("train").batch(2000)))
    assert images.shape[1:] == (8, 8, 1) and images.dtype == tf.float32 and labels.dtype == tf.int32
    assert 0.0 <= float(tf.reduce_min(images)) and float(tf.reduce_max(images)) == 1.0
    assert set(labels.numpy()) == set(range(10))
    again = next(iter(data.Digits().examples("train").batch(2000)))
    np.testing.assert_array_equal(labels, again[1])
    other = next(iter(data.Digits(seed=1).examples("train").batch(2000)))
    assert not np.array_equal(labels, other[1])


def test_train_dataset_shapes_repeat_determinism_and_skip():
    source = data.Synthetic(num_train=40, num_eval=8)
    batches = _batches(data.train_dataset(source, 16, seed=3), 8)  # 8 * 16 > 40: it repeats
    assert all(images.shape == (16, 8, 8, 1) and labels.shape == (16,) for images, labels in batches)
    _assert_same(batches, _batches(data.train_dataset(source, 16, seed=3), 8))
    assert not np.array_equal(batches[0][0], _batches(data.train_dataset(source, 16, seed=4), 1)[0][0])
    _assert_same(batches[5:], _batches(data.train_dataset(source, 16, seed=3, skip_batches=5), 3))


def test_index_batches_are_whole_epoch_permutations_across_batch_boundaries():
    count, batch = 10, 4  # batches straddle epochs: 4 + 4 + (2 | 2) + ...
    stream = np.concatenate([b.numpy() for b in data.shuffled_index_batches(count, batch, seed=1).take(15)])
    epochs = stream.reshape(-1, count)
    for epoch in epochs:
        assert sorted(epoch) == list(range(count))
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled every epoch
    shard = np.concatenate([b.numpy() for b in data.shuffled_index_batches(count, 2, seed=1, shard=(3, 1)).take(3)])
    assert sorted(shard[:3]) == sorted(shard[3:]) == [1, 4, 7]


def test_skip_and_drop_give_the_batches_of_the_full_stream():
    source = data.Synthetic(num_train=40, num_eval=8)
    full = _batches(data.train_dataset(source, 16, seed=3), 20)
    for skip in (0, 3, 7, 11):  # 7 * 16 = 112 = 2 * 40 + 32: starts mid-epoch
        _assert_same(full[skip : skip + 4], _batches(data.train_dataset(source, 16, seed=3, skip_batches=skip), 4))
    drops = [2, 3, 9]
    kept = [b for i, b in enumerate(full) if i not in drops]
    _assert_same(kept[:10], _batches(data.train_dataset(source, 16, seed=3, drop_batches=drops), 10))
    for skip in (1, 2, 6, 7):
        _assert_same(
            kept[skip : skip + 5],
            _batches(data.train_dataset(source, 16, seed=3, skip_batches=skip, drop_batches=drops), 5),
        )


def test_held_batches_are_the_same_on_every_iteration_where_the_stream_reshuffles():
    """`held` (Keras fit's data in trainer.parity, which may iterate it more than once)."""
    stream = tf.data.Dataset.range(40).shuffle(40, seed=1, reshuffle_each_iteration=True).batch(8)
    assert [b.tolist() for b in stream.take(3).as_numpy_iterator()] != [
        b.tolist() for b in stream.take(3).as_numpy_iterator()
    ]
    held = data.held(stream, 3)
    first = [b.tolist() for b in held.as_numpy_iterator()]
    assert len(first) == 3 and first == [b.tolist() for b in held.as_numpy_iterator()]
    assert data.held(stream, None) is stream


def test_batches_gathered_several_per_call_are_those_of_one_per_call(monkeypatch):
    source = data.Synthetic(num_train=40, num_eval=8)
    arrays = source.arrays("train")
    indices = data.shuffled_index_batches(40, 16, seed=3)
    expected = [tuple(a[i] for a in arrays) for i in (b.numpy() for b in indices.take(11))]
    assert pipeline.GATHER_BATCHES > 1 and 16 * 64 * 4 * pipeline.GATHER_BATCHES < pipeline.MAX_GATHER_BYTES
    _assert_same(_batches(pipeline.gathered(indices, arrays, 16), 11), expected)  # 11: across a partial call
    monkeypatch.setattr(pipeline, "MAX_GATHER_BYTES", 1)  # batches bigger than the bound: one per call
    _assert_same(_batches(pipeline.gathered(indices, arrays, 16), 11), expected)


def test_no_prefetch_thread_where_the_cpu_runs_the_step():
    dataset = tf.data.Dataset.range(4)
    if tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"):
        assert data.prefetch_for_accelerators(dataset) is not dataset
    else:  # the step already keeps every core busy: the pipeline runs inline
        assert data.prefetch_for_accelerators(dataset) is dataset


def test_eval_dataset_counts_each_example_once_and_pads_with_copies_of_zero_weight():
    digits = data.Digits()
    count = digits.num_examples("eval")
    batches = _batches(data.eval_dataset(digits, 64), 100)
    assert sum(len(labels) for _, labels, _ in batches) == count
    assert len(batches[-1][1]) == count % 64
    expected = np.concatenate([images for images, _ in digits.examples("eval").batch(1000).as_numpy_iterator()])
    np.testing.assert_array_equal(np.concatenate([images for images, _, _ in batches]), expected)

    padded = _batches(data.eval_dataset(digits, 64, pad_to_multiple_of=128), 100)
    weights = np.concatenate([w for _, _, w in padded])
    assert len(weights) % 128 == 0 and weights.sum() == count
    assert all(len(labels) == 64 for _, labels, _ in padded)
    padding = np.concatenate([images for images, _, _ in padded])[count:]
    np.testing.assert_array_equal(padding, expected[: len(padding)])  # the split's first examples again


def test_synthetic_any_shape():
    source = data.Synthetic(input_shape=(5, 7, 3), num_classes=4, num_train=10, num_eval=6, seed=1)
    images, labels = next(iter(source.examples("train").batch(10)))
    assert images.shape == (10, 5, 7, 3) and int(tf.reduce_max(labels)) < 4
    assert source.num_examples("eval") == 6
    same = next(iter(data.Synthetic(input_shape=(5, 7, 3), num_classes=4, num_train=10, seed=1).examples("train")))
    np.testing.assert_array_equal(images[0], same[0])


def _write_files(directory, counts=(20, 7)) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Random images and labels in the Fashion-MNIST files' layout, `counts` for train and eval;
    returns what was written, by split."""
    rng = np.random.RandomState(0)
    os.makedirs(directory, exist_ok=True)
    arrays = {}
    for split, (image_file, label_file), count in zip(data.SPLITS, data.FASHION_MNIST_FILES.values(), counts):
        arrays[split] = rng.randint(0, 256, (count, 28, 28)), rng.randint(0, 10, count)
        write_idx(os.path.join(directory, image_file), 2051, arrays[split][0])
        write_idx(os.path.join(directory, label_file), 2049, arrays[split][1])
    return arrays


def test_fashion_mnist_reads_idx_files(tmp_path):
    arrays = _write_files(tmp_path)
    source = data.FashionMnist(str(tmp_path))
    source.validate()
    for split, (raw_images, raw_labels) in arrays.items():
        images, labels = next(iter(source.examples(split).batch(100)))
        assert source.num_examples(split) == len(raw_labels) and images.shape[1:] == (28, 28, 1)
        np.testing.assert_allclose(images.numpy()[..., 0], raw_images / 255.0, rtol=1e-6)
        np.testing.assert_array_equal(labels, raw_labels)


def test_fashion_mnist_is_read_from_data_dir_else_keras_cache_else_debian(tmp_path, monkeypatch):
    keras_dir, system_dir = tmp_path / "keras" / "datasets" / "fashion-mnist", tmp_path / "debian"
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))
    monkeypatch.setattr(fashion_mnist_files, "SYSTEM_DIR", str(system_dir))
    with pytest.raises(UserError) as missing:
        data.FashionMnist().num_examples("train")
    for named in (str(keras_dir), str(system_dir), "apt-get install dataset-fashion-mnist", "fashion_mnist.data_dir"):
        assert named in str(missing.value)
    _write_files(system_dir, counts=(12, 5))
    assert data.FashionMnist().directory == str(system_dir) and data.FashionMnist().num_examples("train") == 12
    _write_files(keras_dir, counts=(20, 7))
    assert data.FashionMnist().directory == str(keras_dir) and data.FashionMnist().num_examples("train") == 20
    # A directory the user names is the only one read: a typo must not train on other files.
    with pytest.raises(UserError, match=re.escape(str(tmp_path / "typo" / "train-images-idx3-ubyte.gz"))) as named:
        data.FashionMnist(str(tmp_path / "typo")).validate()
    assert str(keras_dir) in str(named.value) and "apt-get install dataset-fashion-mnist" in str(named.value)


@pytest.mark.parametrize(
    "damage, words",
    [
        ("truncated", "holds 15679 bytes after its header, its header says (20, 28, 28) (15680)"),
        ("magic", "does not start with the idx header 2051"),
        ("not_gzip", "is not a complete gzip file"),
        ("counts", "hold images of (20, 28, 28) and labels of (19,)"),
        ("label", "holds label 10; the classes are 0..9"),
    ],
)
def test_fashion_mnist_files_are_checked_by_content(tmp_path, damage, words):
    _write_files(tmp_path)
    images_path = tmp_path / "train-images-idx3-ubyte.gz"
    content = gzip.decompress(images_path.read_bytes())
    if damage == "truncated":
        images_path.write_bytes(gzip.compress(content[:-1]))
    elif damage == "magic":
        images_path.write_bytes(gzip.compress((2049).to_bytes(4, "big") + content[4:]))
    elif damage == "not_gzip":
        images_path.write_bytes(gzip.compress(content)[:100])
    elif damage == "counts":
        write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 2049, np.zeros(19))
    else:
        write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 2049, np.full(20, 10))
    with pytest.raises(UserError, match=re.escape(words)):
        data.FashionMnist(str(tmp_path)).validate()


def test_fashion_mnist_of_the_original_size_must_have_its_label_counts(tmp_path):
    """MNIST digits share the layout and sizes; their classes are not 1,000 each in the test set."""
    _write_files(tmp_path)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", 2051, np.zeros((10_000, 28, 28)))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", 2049, np.arange(10_000) % 10)
    assert data.FashionMnist(str(tmp_path)).num_examples("eval") == 10_000
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", 2049, np.arange(10_000) % 9)
    with pytest.raises(UserError, match=re.escape("class counts [1112, 1111,")) as unlike:
        data.FashionMnist(str(tmp_path)).validate()
    assert "not 1000 each" in str(unlike.value)


@pytest.mark.slow
def test_write_tfrecords_round_trip(tmp_path):
    result = _run(
        [sys.executable, "-m", "trainer.write_tfrecords", "--dataset=digits", f"--out_dir={tmp_path}", "--num_shards=3"]
    )
    assert result.returncode == 0, result.stderr
    assert "input_shape = (8, 8, 1)" in result.stdout
    assert sorted(os.listdir(tmp_path))[:2] == ["eval-00000-of-00003.tfrecord", "eval-00001-of-00003.tfrecord"]
    source = data.TFRecordFiles(str(tmp_path / "train-*"), str(tmp_path / "eval-*"), (8, 8, 1), 10)
    source.validate()
    digits = data.Digits()
    for split in data.SPLITS:
        assert source.num_files(split) == 3 and source.num_examples(split) == digits.num_examples(split)
        _assert_same(_batches(source.examples(split).batch(2000), 1), _batches(digits.examples(split).batch(2000), 1))
    parts = [len(list(source.examples("train", (2, i)))) for i in range(2)]  # files 0, 2 and file 1
    assert parts == [480 + 479, 479]
    assert len(list(source.examples("train", (4, 1)))) == 360  # fewer files than shards: by example
    assert _batches(data.train_dataset(source, 32, seed=0), 1)[0][0].shape == (32, 8, 8, 1)


@pytest.mark.slow
def test_write_tfrecords_user_error_exits_2(tmp_path):
    result = _run(
        [
            sys.executable,
            "-m",
            "trainer.write_tfrecords",
            "--dataset=fashion_mnist",
            f"--out_dir={tmp_path / 'out'}",
            f"--fashion_mnist_dir={tmp_path}",
        ]
    )
    assert result.returncode == 2
    last_line = result.stderr.strip().splitlines()[-1]  # TF's own log lines may come before it
    assert last_line.startswith("error: Fashion-MNIST file") and "train-images-idx3-ubyte.gz" in last_line


def test_glob_without_files_is_a_user_error(tmp_path):
    source = data.TFRecordFiles(str(tmp_path / "nothing-*"), str(tmp_path / "eval-*"), (8, 8, 1), 10)
    with pytest.raises(UserError, match="nothing-"):
        source.validate()


def test_bad_shard_policy_is_a_user_error():
    with pytest.raises(UserError, match="AUTO, FILE, DATA, OFF"):
        data.train_dataset(data.Synthetic(), 8, seed=0, shard_policy="rows")
    assert data.train_dataset(data.Synthetic(), 8, seed=0, shard_policy="data") is not None


MIRRORED_SCRIPT = """
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from trainer import data
from trainer.data import pipeline
from trainer.errors import UserError

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
source, gb = data.Synthetic(num_train=64), 8
local = lambda value: [t.numpy() for t in strategy.experimental_local_results(value)]
dist = iter(data.distribute_train(strategy, source, gb, seed=1, method="dataset"))
plain = iter(data.train_dataset(source, gb, seed=1))
for _ in range(3):
    images, labels = next(dist)
    expected_images, expected_labels = next(plain)
    assert [len(x) for x in local(labels)] == [gb // 2] * 2
    np.testing.assert_array_equal(np.concatenate(local(images)), expected_images)
    np.testing.assert_array_equal(np.concatenate(local(labels)), expected_labels)
resumed = next(iter(data.distribute_train(strategy, source, gb, seed=1, method="dataset", skip_steps=3)))
np.testing.assert_array_equal(np.concatenate(local(resumed[0])), next(plain)[0])

per_replica = data.train_dataset(source, gb // 2, seed=1)
expected = [x.numpy() for x, _ in per_replica.take(4)]
dist = iter(data.distribute_train(strategy, source, gb, seed=1, method="function"))
first, second = next(dist)[0], next(dist)[0]
assert [len(x) for x in local(first)] == [gb // 2] * 2
np.testing.assert_array_equal(np.concatenate(local(first) + local(second)), np.concatenate(expected))
resumed = next(iter(data.distribute_train(strategy, source, gb, seed=1, method="function", skip_steps=1)))
np.testing.assert_array_equal(np.concatenate(local(resumed[0])), np.concatenate(expected[2:]))

for method in ("dataset", "function"):
    batches = list(data.distribute_eval(strategy, data.Synthetic(num_eval=21), gb, method=method))
    weights = [local(w) for _, _, w in batches]
    assert all(len(w) == gb // 2 for ws in weights for w in ws), method
    assert sum(w.sum() for ws in weights for w in ws) == 21, method
def regression(split):  # a user input function: dict features, float targets
    rng = np.random.RandomState(0 if split == "train" else 1)
    count = 32 if split == "train" else 13
    features = {"x": rng.normal(size=(count, 3)).astype(np.float32)}
    return tf.data.Dataset.from_tensor_slices((features, rng.normal(size=count).astype(np.float32)))
inp = data.Input(regression)
expected = next(iter(data.train_dataset(inp, gb, seed=2)))
for method in ("dataset", "function"):
    features, target = next(iter(data.distribute_train(strategy, inp, gb, seed=2, method=method)))
    np.testing.assert_array_equal(np.concatenate(local(features["x"])), expected[0]["x"].numpy())
    np.testing.assert_array_equal(np.concatenate(local(target)), expected[1].numpy())
    weights = [w for _, _, ws in data.distribute_eval(strategy, inp, gb, method=method) for w in local(ws)]
    assert sum(w.sum() for w in weights) == 13 and all(len(w) == gb // 2 for w in weights), method
try:
    data.distribute_train(strategy, source, gb, seed=1, method="rows")
    raise AssertionError("no UserError")
except UserError:
    pass
print("MIRRORED OK")
"""

PARAMETER_SERVER_SCRIPT = """
import os, portpicker, tensorflow as tf
from trainer import data
from trainer.data import pipeline
from trainer.errors import UserError

ports = {"worker": [portpicker.pick_unused_port() for _ in range(2)], "ps": [portpicker.pick_unused_port()]}
spec = tf.train.ClusterSpec({job: [f"localhost:{port}" for port in ps] for job, ps in ports.items()})
servers = [tf.distribute.Server(spec, job_name=job, task_index=i, protocol="grpc", start=True)
           for job, ps in ports.items() for i in range(len(ps))]
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
assert data.num_workers(strategy) == 2
try:
    data.distribute_train(strategy, data.Digits(), 8, seed=0, shard_policy="FILE")
    raise AssertionError("no UserError")
except UserError as error:
    assert "at least as many files (1) as workers (2)" in str(error), error
print("PS OK", flush=True)
os._exit(0)  # in-process gRPC servers never shut down
"""


@pytest.mark.slow
def test_distribute_train_and_eval_under_mirrored_with_two_cpus():
    result = _run([sys.executable, "-c", textwrap.dedent(MIRRORED_SCRIPT)])
    assert result.returncode == 0 and "MIRRORED OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.slow
def test_file_sharding_needs_as_many_files_as_workers():
    assert data.num_workers(tf.distribute.get_strategy()) == 1
    result = _run([sys.executable, "-c", textwrap.dedent(PARAMETER_SERVER_SCRIPT)])
    assert result.returncode == 0 and "PS OK" in result.stdout, result.stderr[-3000:]
