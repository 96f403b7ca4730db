"""The train split held on the devices (trainer/data/device.py): which runs take it, the same batches as the
tf.data path (the same example ids in the same order, per replica, after a skip and around dropped batches,
with a user's augmentation), and the same training: runs on both paths end on the same weights, and a
resumed run on the devices ends bit for bit where the uninterrupted one does."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests import id_counting
from tests.noisy_digits import NoisyDigits
from tests.support import main_in_one_process, run_python
from trainer import data
from trainer.data import device


def device_batches(inp, strategy, batch_size, seed, count, *, skip=0, drops=()):
    """The first `count` global batches the loop's feed gives on `strategy`, each replica's slice, in order."""
    arrays = data.pipeline.held_train(inp)[0]
    feed = device.feed_of(
        device.device_batches(strategy, inp, arrays, batch_size, seed, skip_steps=skip, drop_batches=drops)
    )

    @tf.function(autograph=False)
    def one(source):
        number = feed.next_item(source)
        return strategy.experimental_local_results(strategy.run(feed.replica_batch, args=(number,)))

    batches = []
    for _ in range(count):
        replicas = one(feed.source)
        batches.append(tf.nest.map_structure(lambda *parts: np.concatenate([p.numpy() for p in parts]), *replicas))
    return batches


def assert_same(expected, got):
    assert len(expected) == len(got)
    for want, have in zip(expected, got):
        for a, b in zip(tf.nest.flatten(want), tf.nest.flatten(have)):
            np.testing.assert_array_equal(np.asarray(a), b)


def test_the_split_on_the_device_gives_the_tf_data_batches_after_a_skip_and_around_dropped_ones():
    """Under the default strategy: example ids in order (the counting input, batches across epochs), a dict
    input, and a user's augmentation, drawn per example from its position alike on both paths."""
    strategy = tf.distribute.get_strategy()
    ids = data.Input(id_counting.ids)
    expected = [b for b in data.train_dataset(ids, 8, seed=3).take(70).as_numpy_iterator()]  # 70 * 8 > 512
    got = device_batches(ids, strategy, 8, 3, 70)
    assert [b[1].tolist() for b in got] == [b[1].tolist() for b in expected]
    assert_same(expected, got)
    drops = (2, 5, 6)
    kept = [b for b in data.train_dataset(ids, 8, seed=3, skip_batches=3, drop_batches=drops).take(5)]
    assert_same(
        [tuple(t.numpy() for t in b) for b in kept], device_batches(ids, strategy, 8, 3, 5, skip=3, drops=drops)
    )

    noisy = data.Input(NoisyDigits())
    expected = [b for b in data.train_dataset(noisy, 16, seed=1, skip_batches=110).take(3).as_numpy_iterator()]
    assert_same(expected, device_batches(noisy, strategy, 16, 1, 3, skip=110))
    plain = device_batches(data.Input(data.Digits()), strategy, 16, 1, 1, skip=110)[0]
    assert not np.allclose(plain[0], expected[0][0]) and np.array_equal(plain[1], expected[0][1])


def test_the_built_in_image_augmentation_draws_alike_on_both_paths_and_on_a_resume():
    augmentation = data.ImageAugmentation(flip_left_right=True, max_shift=1, max_brightness=0.1)
    augmented = data.Input(data.Digits(augmentation=augmentation))
    strategy = tf.distribute.get_strategy()
    expected = [b for b in data.train_dataset(augmented, 16, seed=1).take(4).as_numpy_iterator()]
    assert_same(expected, device_batches(augmented, strategy, 16, 1, 4))
    assert_same(expected[2:], device_batches(augmented, strategy, 16, 1, 2, skip=2))
    plain = device_batches(data.Input(data.Digits()), strategy, 16, 1, 4)
    assert all(np.array_equal(p[1], e[1]) for p, e in zip(plain, expected))  # the same examples
    changed = [not np.array_equal(p[0][i], e[0][i]) for p, e in zip(plain, expected) for i in range(16)]
    assert sum(changed) > 48  # most of the 64 images were moved, mirrored or brightened


def test_which_path_a_run_takes_is_said_in_one_line():
    digits = data.Input(data.Digits())
    choice, arrays = device.choose("mirrored", digits, max_bytes=device.DEFAULT_MAX_BYTES)
    assert choice.held and arrays is not None and "held on each replica's device" in choice.line
    over, _ = device.choose("default", digits, max_bytes=1000)
    assert not over.held and "over train.device_data_max_bytes" in over.line
    off, _ = device.choose("default", digits, max_bytes=0)
    assert not off.held
    stream = data.Input(lambda split: tf.data.Dataset.range(40).filter(lambda x: x % 2 == 0))
    assert "a stream" in device.choose("default", stream, max_bytes=device.DEFAULT_MAX_BYTES)[0].line
    ps, _ = device.choose("parameter_server", digits, max_bytes=device.DEFAULT_MAX_BYTES)
    assert not ps.held and "each parameter-server closure gathers" in ps.line
    served, _ = device.choose("mirrored", digits, max_bytes=device.DEFAULT_MAX_BYTES, data_service="local")
    assert not served.held and "tf.data service" in served.line


MIRRORED_SCRIPT = """
import json
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tests import id_counting
from tests.noisy_digits import NoisyDigits
from tests.test_device_data import assert_same, device_batches
from trainer import data

local = lambda value: [t.numpy() for t in value]
for strategy in (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
                 tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])):
    for inp, gb, skip in ((data.Input(id_counting.ids), 8, 0), (data.Input(NoisyDigits()), 16, 110)):
        dist = iter(data.distribute_train(strategy, inp, gb, seed=3, method="dataset", skip_steps=skip))
        expected = []
        for _ in range(6):
            replicas = strategy.experimental_local_results(next(dist))
            expected.append(tf.nest.map_structure(lambda *p: np.concatenate([t.numpy() for t in p]), *replicas))
        assert_same(expected, device_batches(inp, strategy, gb, 3, 6, skip=skip))
print(json.dumps({"ok": True}))
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_each_replica_gathers_its_slice_of_the_tf_data_batch_under_mirrored_and_central_storage():
    """Replica r trains on slice r of global batch i, as `experimental_distribute_dataset` hands it out:
    example ids in order, and a user's augmentation, after a skip."""
    assert run_python(MIRRORED_SCRIPT, timeout=180) == {"ok": True}


SMALL = [
    "--gin_bindings=import tests.noisy_digits",
    "--gin_bindings=train.input_fn = @NoisyDigits()",
    "--gin_bindings=cnn.filters=(8,)",
    "--gin_bindings=cnn.dense_units=16",
    "--gin_bindings=train.global_batch_size=32",
    "--gin_bindings=train.steps_per_loop=10",
    "--gin_bindings=train.log_every_steps=20",
    "--gin_bindings=train.checkpoint_every_steps=20",
    "--gin_bindings=train.eval_every_steps=40",
]
TF_DATA = "--gin_bindings=train.device_data_max_bytes=0"


def checkpoint_values(model_dir: str) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(model_dir)
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_runs_on_both_paths_end_on_the_same_weights_and_a_resumed_run_on_the_devices_is_bit_identical(tmp_path):
    """40 steps of a small CNN on the digits with a user's augmentation (about 6 passes), under the default
    strategy and mirrored (2 logical CPUs): the split on the devices and the tf.data path end on the same
    weights; on the devices, a run stopped at step 20 and resumed ends bit for bit where one straight run does."""
    cases = {}
    for mode in ("mirrored", "single"):
        flags = [f"--gin_file=gin/{mode}.gin", *SMALL, "--gin_bindings=train.total_steps=40"]
        cases[f"{mode}_tf_data"] = ([*flags, TF_DATA], str(tmp_path / f"{mode}_tf_data"))
        cases[f"{mode}_device"] = (flags, str(tmp_path / f"{mode}_device"))
    mirrored = ["--gin_file=gin/mirrored.gin", *SMALL]
    cases["stopped"] = ([*mirrored, "--gin_bindings=train.total_steps=20"], str(tmp_path / "resumed"))
    cases["resumed"] = ([*mirrored, "--gin_bindings=train.total_steps=40"], str(tmp_path / "resumed"))
    outcomes = main_in_one_process(cases, timeout=380)
    for name, outcome in outcomes.items():
        assert outcome["code"] == 0, (name, outcome["stderr"][-3000:])
        line = "through the tf.data pipeline" if name.endswith("tf_data") else "held on each replica's device"
        assert line in outcome["stdout"], (name, outcome["stdout"][-2000:])
    for mode in ("mirrored", "single"):
        on_tf_data, on_devices = (checkpoint_values(str(tmp_path / f"{mode}_{path}")) for path in ("tf_data", "device"))
        assert sorted(on_tf_data) == sorted(on_devices)
        for key, value in on_tf_data.items():
            if np.asarray(value).dtype.kind == "f":
                np.testing.assert_allclose(on_devices[key], value, rtol=1e-6, atol=1e-7, err_msg=f"{mode} {key}")
            else:
                np.testing.assert_array_equal(on_devices[key], value, err_msg=f"{mode} {key}")
    straight, resumed = (
        checkpoint_values(str(tmp_path / "mirrored_device")),
        checkpoint_values(str(tmp_path / "resumed")),
    )
    for key, value in straight.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)
