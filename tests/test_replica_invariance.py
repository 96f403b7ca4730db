"""Same global batch, same weights: 1, 2 and 4 logical-CPU replicas train identically (atol 1e-6).

This is what the loss contract buys (per-example loss averaged over the *global* batch,
regularisation scaled by the replica count, gradients summed): a step written to it
trains the same on any number of replicas. Each replica count runs in a fresh process
that splits the CPU (collective groups of different sizes cannot share one process).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support import run_python

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

SCRIPT = """
import json, sys
import keras
import numpy as np
import tensorflow as tf
NUM_REPLICAS, OUT = {num_replicas}, {out!r}
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_REPLICAS)
from trainer import data
from trainer.task import models
from trainer.task import optimizers
from trainer.task import steps
from trainer.loops.sync import TrainLoop

source = data.Digits()
GB, K = 32, 8
strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
arrays, losses = {{}}, {{}}
for name in ("sgd", "adam"):
    for method in ("dataset",):  # 'function' is checked against one process in test_multiworker
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = models.cnn(source.input_shape, source.num_classes, filters=(8, 16, 16), dense_units=32, l2=1e-3)
            optimizer = optimizers.make_optimizer(
                global_batch_size=GB, total_steps=K, name=name, momentum=0.9,
                learning_rate=0.05 if name == "sgd" else 0.003)
            optimizer.build(model.trainable_variables)
            step = tf.Variable(0, dtype=tf.int64, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        dataset = data.distribute_train(strategy, source, GB, seed=3, method=method)
        loop = TrainLoop(strategy, model, optimizer, steps.classification_step, GB, dataset, step)
        losses[f"{{name}}/{{method}}"] = [loop.run(2)["loss"] for _ in range(K // 2)]
        assert int(step.numpy()) == K
        for i, v in enumerate(model.trainable_variables):
            arrays[f"{{name}}/{{method}}/{{i}}"] = v.numpy()
np.savez(OUT, **arrays)
print(json.dumps({{"replicas": strategy.num_replicas_in_sync, "losses": losses}}))
"""


@pytest.mark.timeout(400)
def test_weights_match_across_replica_counts_for_sgd_and_adam_with_l2(tmp_path):
    results = {}
    for n in (1, 2, 4):
        out = str(tmp_path / f"weights{n}.npz")
        meta = run_python(SCRIPT.format(num_replicas=n, out=out), timeout=120)
        assert meta["replicas"] == n
        results[n] = (dict(np.load(out)), meta["losses"])
    reference, reference_losses = results[1]
    initial_moved = False
    for n in (2, 4):
        weights, losses = results[n]
        assert weights.keys() == reference.keys()
        for key in reference:
            np.testing.assert_allclose(weights[key], reference[key], rtol=0, atol=1e-6, err_msg=f"{n} replicas {key}")
        for key in reference_losses:
            np.testing.assert_allclose(losses[key], reference_losses[key], rtol=0, atol=1e-5, err_msg=key)
            initial_moved |= reference_losses[key][0] != reference_losses[key][-1]
    assert initial_moved, "training did not change the loss: the comparison would prove nothing"
