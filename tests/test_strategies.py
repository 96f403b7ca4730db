"""Strategies by name on logical devices carved out of the CPU, and the devices config."""

from __future__ import annotations

import re

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
devices.configure_devices(devices.DeviceConfig(logical_cpus_without_gpu=2))  # the same again: a second run's
result["again"] = len(tf.config.list_logical_devices("CPU"))
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
    assert r["again"] == 2
    assert r["late"].startswith("UserError: device setup failed") and "trainer.configure_devices(" in r["late"]


def test_unknown_strategy_names_the_choices():
    with pytest.raises(UserError, match="unknown train.strategy 'mirorred'.*central_storage"):
        strategies.make_strategy("mirorred")


def test_tpu_without_a_tpu_is_a_clear_user_error():
    with pytest.raises(UserError, match="strategy 'tpu' found no TPU"):
        strategies.make_strategy("tpu")


def test_a_parameter_server_cluster_is_checked_before_tensorflow_connects_to_it():
    import tensorflow as tf

    def resolver(jobs: dict, task_type: str = "chief") -> tf.distribute.cluster_resolver.ClusterResolver:
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(jobs), task_type=task_type, task_id=0, rpc_layer="grpc"
        )

    chief, worker, ps = ["localhost:1"], ["localhost:2"], ["localhost:3"]
    for cluster, expected in (
        (resolver({}), "needs a cluster with ps and worker tasks: run `python -m trainer.main --gin_file=gin/ps.gin`"),
        (resolver({"chief": chief, "worker": worker, "ps": ps}, "worker"), "this process is task worker 0"),
        (resolver({"chief": chief, "worker": worker}), "needs at least one 'ps' task in the cluster, which has"),
        (resolver({"chief": chief, "ps": ps}), "needs at least one 'worker' task in the cluster, which has chief, ps"),
    ):
        with pytest.raises(UserError, match=re.escape(expected)):
            strategies.make_strategy("parameter_server", cluster_resolver=cluster)
    with pytest.raises(UserError, match="a variable_partitioner shards variables across ps tasks .* not 'mirrored'"):
        strategies.make_strategy("mirrored", variable_partitioner=object())
    assert strategies.make_strategy("default") is tf.distribute.get_strategy()
