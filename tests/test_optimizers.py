"""Learning-rate schedules: the linear scaling rule, warm-up, cosine decay, and plain floats."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from trainer.errors import UserError
from trainer.task import optimizers


def rates(schedule, steps):
    return [float(schedule(s)) for s in steps]


def test_nothing_to_scale_gives_the_plain_float_keras_fit_would_get():
    assert optimizers.learning_rate_schedule(0.01, global_batch_size=64) == 0.01
    assert optimizers.learning_rate_schedule(0.01, global_batch_size=64, reference_batch_size=64) == 0.01


def test_linear_scaling_rule_with_warmup():
    schedule = optimizers.learning_rate_schedule(0.01, global_batch_size=256, reference_batch_size=64, warmup_steps=4)
    np.testing.assert_allclose(rates(schedule, [0, 1, 3, 4, 100]), [0.01, 0.02, 0.04, 0.04, 0.04], rtol=1e-6)


def test_cosine_decay_reaches_zero_at_total_steps():
    schedule = optimizers.learning_rate_schedule(0.1, global_batch_size=32, decay="cosine", total_steps=100)
    np.testing.assert_allclose(rates(schedule, [0, 50, 100, 150]), [0.1, 0.05, 0.0, 0.0], atol=1e-6)


def test_schedule_round_trips_through_keras_serialization():
    schedule = optimizers.ScaledWarmupSchedule(0.01, 2.0, 10, "cosine", 100)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert rates(restored, [0, 5, 60]) == rates(schedule, [0, 5, 60])


@pytest.mark.parametrize("name,cls", [("sgd", "SGD"), ("adam", "Adam"), ("adamw", "AdamW"), ("rmsprop", "RMSprop")])
def test_make_optimizer_by_name(name, cls):
    optimizer = optimizers.make_optimizer(global_batch_size=32, total_steps=10, name=name, learning_rate=0.5)
    assert type(optimizer).__name__ == cls
    assert float(optimizer.learning_rate) == 0.5


def test_unknown_names_are_user_errors():
    with pytest.raises(UserError, match="unknown optimizer 'adamm'"):
        optimizers.make_optimizer(global_batch_size=32, total_steps=10, name="adamm")
    with pytest.raises(UserError, match="unknown decay"):
        optimizers.make_optimizer(global_batch_size=32, total_steps=10, decay="linear")


@pytest.mark.parametrize("name", optimizers.OPTIMIZERS)
@pytest.mark.parametrize("weight_decay", [0.0, None, 0.1])
def test_weight_decay_is_applied_as_keras_applies_it_and_zero_means_none(name, weight_decay):
    """With zero gradients every optimizer's own update is 0, so one step leaves w = 1 - lr * decay."""
    optimizer = optimizers.make_optimizer(
        global_batch_size=32, total_steps=10, name=name, learning_rate=0.5, weight_decay=weight_decay
    )
    variable = keras.Variable(np.ones(3, np.float32))
    optimizer.apply_gradients([(np.zeros(3, np.float32), variable)])
    expected = {0.0: 0.0, 0.1: 0.1, None: 0.004 if name == "adamw" else 0.0}[weight_decay]
    np.testing.assert_allclose(variable.numpy(), 1 - 0.5 * expected, rtol=0, atol=1e-7)


def test_a_negative_weight_decay_is_one_user_error():
    with pytest.raises(UserError, match="make_optimizer.weight_decay must be a number >= 0"):
        optimizers.make_optimizer(global_batch_size=32, total_steps=10, name="sgd", weight_decay=-0.1)
