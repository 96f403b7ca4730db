"""Layers' non-trainable state (Dropout's seed generator, BatchNorm's moving statistics) under
central_storage and mirrored (2 logical CPUs, a fresh process)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import run_python

# The module-scoped fixture below is shared by this file's tests: one worker runs them all.
pytestmark = pytest.mark.xdist_group("layer_state")

SCRIPT = """
import json, os, tempfile
import numpy as np
import keras
import tensorflow as tf
from trainer.distribution import devices, strategies
devices.configure_devices(devices.DeviceConfig(logical_cpus_without_gpu=2))
from trainer.task import layer_state
from trainer.task import models
from trainer.task import steps
from trainer.loops.sync import TrainLoop
from trainer import data

source = data.Digits()
result = {}
# One strategy object each: two MirroredStrategy objects in one process reuse collective keys.
made = {name: strategies.make_strategy(name) for name in ("central_storage", "mirrored")}
for name in ("central_storage", "mirrored"):
    strategy = made[name]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        with layer_state.model_creation_scope(strategy):
            model = models.cnn(source.input_shape, source.num_classes, filters=(8,), dense_units=16, dropout=0.5)
            probe = keras.layers.Dropout(0.5)
        optimizer = keras.optimizers.SGD(0.05)
        optimizer.build(model.trainable_variables)
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                  aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    states = layer_state.random_states({"model": model, "also": model})
    before = [s.numpy().tolist() for s in states]
    dataset = data.distribute_train(strategy, source, 32, seed=0)
    loop = TrainLoop(strategy, model, optimizer, steps.classification_step, 32, dataset, global_step)
    losses = [loop.run(3)["loss"], loop.run(2)["loss"]]

    # Checkpoint round trip of the states (what train.py saves for exact resume).
    ckpt = tf.train.Checkpoint(random_state=states)
    path = ckpt.write(os.path.join(tempfile.mkdtemp(), "ckpt"))
    saved = states[0].numpy().tolist()
    states[0].assign([0, 0])
    ckpt.read(path).assert_consumed()

    # Same input on both replicas: are the two dropout masks the same?
    ones = tf.ones([4, 64])
    masks = strategy.experimental_local_results(strategy.run(tf.function(lambda x: probe(x, training=True)),
                                                             args=(ones,)))
    result[name] = {
        "num_states": len(states), "before": before, "after": [s.numpy().tolist() for s in states],
        "restored": states[0].numpy().tolist() == saved, "losses": losses,
        "aggregation": str(states[0].value.aggregation), "global_step": int(global_step.numpy()),
        "same_masks": bool(np.array_equal(masks[0].numpy(), masks[1].numpy())),
        "replicas": len(masks),
    }

# BatchNormalization: moving statistics updated in replica context from each replica's half of
# the batch (different halves), then read back per replica.
for name in ("central_storage", "mirrored"):
    strategy = made[name]
    keras.utils.set_random_seed(0)
    with strategy.scope(), layer_state.model_creation_scope(strategy):
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3),
                                  keras.layers.BatchNormalization(momentum=0.5), keras.layers.Flatten(),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.05)
        optimizer.build(model.trainable_variables)
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                  aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    dataset = data.distribute_train(strategy, source, 32, seed=0)
    loop = TrainLoop(strategy, model, optimizer, steps.classification_step, 32, dataset, global_step)
    loss = loop.run(3)["loss"]
    moving_mean = model.layers[1].moving_mean
    copies = [c.numpy() for c in strategy.experimental_local_results(moving_mean.value)]
    result[name + "_batchnorm"] = {
        "loss": loss, "moved": bool(np.abs(copies[0]).max() > 0),
        "copies_equal": all(np.array_equal(copies[0], c) for c in copies),
        "aggregation": str(moving_mean.value.aggregation),
    }
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def layer_runs() -> dict:
    return run_python(SCRIPT, timeout=220)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dropout_trains_under_central_storage_and_mirrored(layer_runs):
    r = layer_runs
    for name in ("central_storage", "mirrored"):
        run = r[name]
        assert run["num_states"] == 1, run  # the dict lists the same model twice: counted once
        assert all(np.isfinite(loss) for loss in run["losses"]), run
        assert run["global_step"] == 5
        # One Dropout call per step: the state's counter advanced once per step, seed unchanged.
        ((seed, counter),) = run["before"]
        assert run["after"] == [[seed, counter + 5]], run
        assert run["restored"]
        assert run["replicas"] == 2
    assert r["central_storage"]["aggregation"] == "VariableAggregationV2.ONLY_FIRST_REPLICA"
    assert r["mirrored"]["aggregation"] == "VariableAggregationV2.NONE"  # untouched under mirrored
    # Every replica draws the same seed, so the same mask for the same input (under mirrored each
    # replica's own copy of the state, all equal).
    assert r["mirrored"]["same_masks"] and r["central_storage"]["same_masks"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_batchnorm_statistics_train_and_stay_equal_on_every_replica(layer_runs):
    for name in ("central_storage", "mirrored"):
        run = layer_runs[name + "_batchnorm"]
        assert np.isfinite(run["loss"]) and run["moved"], run
        # Keras 3 creates them NONE-aggregated: each mirrored copy would follow its own half.
        assert run["copies_equal"] and run["aggregation"] == "VariableAggregationV2.MEAN", run


def test_scope_is_a_no_op_without_aggregating_variables():
    import tensorflow as tf

    from trainer.task import layer_state

    default = tf.distribute.get_strategy()
    assert not layer_state.needs_state_aggregation(default)
    with layer_state.model_creation_scope(default):
        v = tf.Variable([1, 0], name="seed_generator_state", trainable=False)
    assert v.aggregation == tf.VariableAggregation.NONE


def test_every_keras_layer_of_models_modules_and_dicts_is_found_once():
    import keras
    import tensorflow as tf

    from trainer.task import layer_state

    inner = keras.layers.Dense(2)
    model = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dropout(0.1)])
    module = tf.Module()
    module.head = [keras.layers.Dense(4)]
    module.body = tf.Module()
    module.body.model = model  # a Keras model inside a tf.Module's submodule
    found = layer_state._keras_layers({"a": model, "b": module, "c": model})
    expected = [model, *model._flatten_layers(include_self=False), module.head[0]]  # the InputLayer too
    assert inner in expected and len(found) == len(expected) == 5
    assert {id(layer) for layer in found} == {id(layer) for layer in expected}
