"""Weighted examples `(x, y, sample_weight)` in the built-in eval step count as Keras `evaluate`
counts them: loss sum(l_i w_i) / number of examples, accuracy the weighted accuracy
sum(correct_i w_i) / sum(w_i) (Keras' `weighted_metrics`), on one device and on two replicas,
padding included. (Training with them is checked against fit in tests/test_parity.py.)"""

from __future__ import annotations

import pytest

from tests.support import run_python

pytestmark = pytest.mark.slow  # every test here starts processes or trains for long

CODE = """
import json
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from tests.weighted_inputs import weighted_digits
from trainer import data
from trainer.loops.evaluator import Evaluator
from trainer.task import models, steps

keras.utils.set_random_seed(0)
inp = data.as_input(weighted_digits)
model = models.mlp(inp.input_shape, 10, hidden=(16,))
x, y, w = (np.stack(a) for a in zip(*weighted_digits("eval").as_numpy_iterator()))
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              weighted_metrics=["sparse_categorical_accuracy"])
keras_loss, keras_accuracy = model.evaluate(x, y, sample_weight=w, batch_size=64, verbose=0)
gb, count = 64, len(y)
ours = {}
mirrored = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
for name, strategy in (("one", tf.distribute.get_strategy()), ("two", mirrored)):
    dataset = data.distribute_eval(strategy, inp, gb, split="eval")
    ours[name] = Evaluator(strategy, model, steps.classification_eval_step, dataset, -(-count // gb)).evaluate()
print(json.dumps({"keras": [keras_loss, keras_accuracy], "ours": ours, "count": count,
                  "unweighted": float(np.mean(np.argmax(model.predict(x, verbose=0), -1) == y))}))
"""


@pytest.mark.timeout(120)
def test_weighted_eval_counts_as_keras_evaluate_on_one_and_two_replicas():
    result = run_python(CODE, timeout=110)
    keras_loss, keras_accuracy = result["keras"]
    assert abs(keras_accuracy - result["unweighted"]) > 1e-3, "the weights must change the accuracy to prove anything"
    for name, ours in result["ours"].items():
        assert ours["num_examples"] == result["count"], (name, ours)
        assert abs(ours["loss"] - keras_loss) < 1e-5 and abs(ours["accuracy"] - keras_accuracy) < 1e-6, (
            name,
            ours,
            result["keras"],
        )
        assert "accuracy/denominator" not in ours


TRAIN_CODE = """
import json
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from trainer.task import models, steps

keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(64, 8, 8, 1)).astype(np.float32)
y = np.arange(64) % 10
w = np.where(y % 3 == 0, 3.0, 0.25).astype(np.float32)  # weights above 1: a sum over the batch size passes 1
mirrored = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
with mirrored.scope():
    model = models.mlp((8, 8, 1), 10, hidden=(16,))
    optimizer = keras.optimizers.SGD(0.0)
    optimizer.build(model.trainable_variables)
correct = (np.argmax(model(x).numpy(), -1) == y).astype(np.float32)
step = tf.function(lambda batch: mirrored.run(steps.classification_step, (model, optimizer, batch, 64)))
outputs = step(next(iter(mirrored.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y, w)).batch(64)))))
ours = float(mirrored.reduce("SUM", outputs["accuracy"], axis=None))
print(json.dumps({"ours": ours, "weighted": float((correct * w).sum() / w.sum()),
                  "unweighted": float(correct.mean())}))
"""


@pytest.mark.timeout(120)
def test_weighted_train_accuracy_is_normalised_by_the_weights_on_two_replicas():
    result = run_python(TRAIN_CODE, timeout=110)
    assert abs(result["weighted"] - result["unweighted"]) > 1e-3, result  # the weights change it
    assert abs(result["ours"] - result["weighted"]) < 1e-6 and result["ours"] <= 1.0, result
