"""Strategies by name on logical devices carved out of the CPU, and the devices config."""

from __future__ import annotations

import pytest

from tests.support import run_python
from trainer.distribution import strategies
from trainer.errors import UserError

SCRIPT = """
import json
import tensorflow as tf
from trainer.distribution import devices, strategies
devices.configure_devices(devices.DeviceConfig(logical_cpus_without_gpu=2))
result = {"cpus": len(tf.config.list_logical_devices("CPU")), "compute": devices.compute_devices()}
for name in ("default", "one_device", "mirrored", "central_storage", "multi_worker_mirrored"):
    strategy = strategies.make_strategy(name)
    with strategy.scope():
        v = tf.Variable(1.0)
    result[name] = {"replicas": strategy.num_replicas_in_sync, "type": type(strategy).__name__,
                    "value": float(strategy.reduce("SUM", strategy.run(lambda: v * 2.0), axis=None))}
try:
    devices.configure_devices(devices.DeviceConfig(logical_cpus=3))
except Exception as e:
    result["late"] = type(e).__name__ + ": " + str(e)
print(json.dumps(result))
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_strategies_on_two_logical_cpus():
    r = run_python(SCRIPT, timeout=180)
    assert r["cpus"] == 2 and len(r["compute"]) == 2
    assert r["default"]["replicas"] == 1 and r["one_device"]["replicas"] == 1
    assert r["mirrored"] == {"replicas": 2, "type": "MirroredStrategy", "value": 4.0}
    assert r["central_storage"]["replicas"] == 2 and r["central_storage"]["value"] == 4.0
    assert r["multi_worker_mirrored"]["type"] == "CollectiveAllReduceStrategy"
    assert r["late"].startswith("UserError: device setup failed")


def test_unknown_strategy_names_the_choices():
    with pytest.raises(UserError, match="unknown train.strategy 'mirorred'.*central_storage"):
        strategies.make_strategy("mirorred")


def test_tpu_without_a_tpu_is_a_clear_user_error():
    with pytest.raises(UserError, match="strategy 'tpu' found no TPU"):
        strategies.make_strategy("tpu")
