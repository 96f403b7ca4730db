"""Dropout's seed-generator state under central_storage and mirrored (2 logical CPUs, a fresh process)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support import run_python

SCRIPT = """
import json, os, tempfile
import numpy as np
import keras
import tensorflow as tf
from trainer.distribution import devices, strategies
devices.configure_devices(devices.DeviceConfig(logical_cpus_without_gpu=2))
from trainer.core import models, random_state, steps
from trainer.core.loop import TrainLoop
from trainer import data

source = data.Digits()
result = {}
for name in ("central_storage", "mirrored"):
    strategy = strategies.make_strategy(name)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        with random_state.model_creation_scope(strategy):
            model = models.cnn(source.input_shape, source.num_classes, filters=(8,), dense_units=16, dropout=0.5)
            probe = keras.layers.Dropout(0.5)
        optimizer = keras.optimizers.SGD(0.05)
        optimizer.build(model.trainable_variables)
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                  aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    states = random_state.random_states({"model": model, "also": model})
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
print(json.dumps(result))
"""


@pytest.mark.timeout(240)
def test_dropout_trains_under_central_storage_and_mirrored():
    r = run_python(SCRIPT, timeout=220)
    for name in ("central_storage", "mirrored"):
        run = r[name]
        assert run["num_states"] == 1, run  # the dict lists the same model twice: counted once
        assert all(np.isfinite(loss) for loss in run["losses"]), run
        assert run["global_step"] == 5
        # One Dropout call per step: the state's counter advanced once per step, seed unchanged.
        (seed, counter), = run["before"]
        assert run["after"] == [[seed, counter + 5]], run
        assert run["restored"]
        assert run["replicas"] == 2
    assert r["central_storage"]["aggregation"] == "VariableAggregationV2.ONLY_FIRST_REPLICA"
    assert r["mirrored"]["aggregation"] == "VariableAggregationV2.NONE"  # untouched under mirrored
    # Measured: every replica draws the same seed, so the same mask for the same input, under
    # mirrored today (each replica's own copy of the state, all equal) and under central_storage.
    assert r["mirrored"]["same_masks"] and r["central_storage"]["same_masks"]


def test_scope_is_a_no_op_without_aggregating_variables():
    import tensorflow as tf

    from trainer.core import random_state

    default = tf.distribute.get_strategy()
    assert not random_state.needs_seed_state_aggregation(default)
    with random_state.model_creation_scope(default):
        v = tf.Variable([1, 0], name="seed_generator_state", trainable=False)
    assert v.aggregation == tf.VariableAggregation.NONE

