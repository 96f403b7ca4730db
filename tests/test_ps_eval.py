"""Eval under parameter servers spread over the workers (issue 38, must-show 4): shards of consecutive eval
batches, one closure each, every example counted once (a worker killed mid-eval too), results the
coordinator's bit for bit."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

from tests.support import read_jsonl, run_main, run_python
from tests.test_ps import assert_all_gone, server_pids
from trainer import data
from trainer.errors import UserError
from trainer.loops import ps_eval
from trainer.loops.options import ParameterServerConfig
from trainer.loops.totals import ReplicaTotals

EXAMPLES, BATCH = 359, 64  # 6 batches, the last partial (39 examples)


def spec(chief: str, *workers: str) -> dict[str, list[str]]:
    return {"chief": [chief], "worker": list(workers), "ps": ["ps0:2222"]}


@pytest.mark.parametrize("num_batches, shards", [(6, 3), (6, 4), (6, 10), (79, 4), (1, 4), (7, 7)])
def test_shards_are_consecutive_batches_covering_the_pass_once(num_batches, shards):
    ranges = ps_eval.shard_ranges(num_batches, shards)
    assert len(ranges) == min(shards, num_batches)
    assert [b for first, count in ranges for b in range(first, first + count)] == list(range(num_batches))
    counts = [count for _, count in ranges]
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1


def test_shard_count_auto_spreads_over_other_hosts_and_refuses_what_cannot_work():
    local = spec("localhost:1", "127.0.0.1:2", "localhost:3")
    remote = spec("node0:1", "node1:2", "node2:2")
    count = lambda setting, **kw: ps_eval.shard_count(  # noqa: E731
        setting, **{"workers": 2, "replicas": 1, "cluster": remote, "has_metrics": False} | kw
    )
    assert ps_eval.on_one_host(local) and not ps_eval.on_one_host(remote)
    assert count("auto") == (2, "one per worker, the workers on other hosts")
    assert count("auto", cluster=local) == (0, "the workers share the coordinator's host")
    assert count(3, cluster=local) == (3, "asked for") and count(0)[0] == 0
    assert count("auto", has_metrics=True)[0] == 0 and count("auto", replicas=2)[0] == 0
    for kw, needle in [({"has_metrics": True}, "Keras metrics"), ({"replicas": 2}, "each worker here has 2")]:
        with pytest.raises(UserError) as refused:
            count(3, **kw)
        message = str(refused.value)
        assert needle in message and "parameter_server.eval_shards = 0" in message and "\n" not in message
    assert count(0, has_metrics=True)[0] == 0


@pytest.mark.parametrize("value", ["x", -1, True, 2.0, None])
def test_eval_shards_must_be_auto_or_a_count(value):
    with pytest.raises(UserError, match=r"parameter_server.eval_shards must be 'auto' or an integer >= 0"):
        ParameterServerConfig(eval_shards=value)
    assert ParameterServerConfig().eval_shards == "auto" and ParameterServerConfig(eval_shards=0).eval_shards == 0


def examples(split: str) -> tf.data.Dataset:
    x = tf.random.stateless_uniform([EXAMPLES, 3], seed=[1, 2], minval=-1e3, maxval=1e3)
    return tf.data.Dataset.from_tensor_slices((x, tf.range(EXAMPLES)))


def test_the_shards_batches_are_the_passs_and_their_rows_add_up_to_its_sums_bit_for_bit():
    """Each shard's `eval_dataset(batches=...)` holds exactly the pass's batches (the last, partial one once),
    and the rows `each_step` returns, added in order in float32, are the one-pass sums exactly."""
    whole = list(data.eval_dataset(examples, BATCH).as_numpy_iterator())
    assert [len(b[1]) for b in whole] == [64] * 5 + [39]
    parts = [
        batch
        for first, count in ps_eval.shard_ranges(len(whole), 4)
        for batch in data.eval_dataset(
            examples, BATCH, batches=(tf.constant(first, tf.int64), tf.constant(count, tf.int64))
        )
    ]
    assert len(parts) == len(whole)
    for mine, theirs in zip(parts, whole, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)

    def replica_fn(batch):  # sums whose float32 value depends on the order of the additions
        x, ids, weight = batch
        return {
            "x": tf.reduce_sum(x * x[:, :1]),
            "ids": tf.reduce_sum(tf.cast(ids, tf.float32)),
            "w": tf.reduce_sum(weight),
        }

    totals = ReplicaTotals(tf.distribute.get_strategy(), replica_fn, "eval", count_finite=False)
    steps = tf.constant(len(whole))
    iterator = iter(data.eval_dataset(examples, BATCH))
    one_pass = {
        k: v.numpy()
        for k, v in tf.function(lambda: totals.sums(totals.accumulate(steps, lambda: next(iterator))))().items()
    }
    iterator = iter(data.eval_dataset(examples, BATCH))
    rows = tf.function(lambda: totals.each_step(steps, lambda: next(iterator)))().numpy()
    added = dict(zip(totals.names, np.add.accumulate(rows, axis=0)[-1], strict=True))
    assert added == one_pass and added["w"] == EXAMPLES and added["ids"] == EXAMPLES * (EXAMPLES - 1) / 2


KILLED_MID_EVAL = r"""
import json, os, signal, threading, time
import keras, tensorflow as tf
from trainer import data
from trainer.cli import flush_and_exit
from trainer.distribution import local_cluster
from trainer.loops.evaluator import Evaluator
from trainer.loops.ps_eval import WorkerEvaluator

N, BATCH, SHARDS = 6000, 50, 6  # 120 batches, 20 a shard


def examples(split):
    return tf.data.Dataset.range(N).map(lambda i: (tf.fill([256], tf.cast(i % 97, tf.float32) / 97), i))


printed = []
config = local_cluster.LocalClusterConfig(num_workers=2, num_ps=1, max_worker_restarts=1)
with local_cluster.embedded_cluster(config, print_fn=printed.append) as cluster:
    strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((256,)), *[keras.layers.Dense(512, "relu") for _ in range(3)], keras.layers.Dense(1)])
        batches_run = tf.Variable(0, dtype=tf.int64)  # on the ps: every batch any closure ran, re-runs too

    def eval_step(model, batch):
        x, ids, weight = batch
        batches_run.assign_add(1)
        return {
            "y": tf.reduce_sum(model(x)[:, 0] * weight),
            "ids": tf.reduce_sum(tf.cast(ids, tf.float32) * weight),
            "num_examples": tf.reduce_sum(weight),
        }

    def evaluator():
        return Evaluator(tf.distribute.get_strategy(), model, eval_step, data.eval_dataset(examples, BATCH), N // BATCH)

    spread = WorkerEvaluator(
        strategy, coordinator, evaluator(), lambda *b: data.eval_dataset(examples, BATCH, batches=b), N // BATCH, SHARDS
    )
    before = spread.evaluate()
    batches_run.assign(0)
    after = {}
    thread = threading.Thread(target=lambda: after.update(spread.evaluate()))
    thread.start()
    while int(batches_run.numpy()) < 3:  # both workers are inside their first shards
        time.sleep(0.01)
    os.kill(cluster.pids["worker 1"], signal.SIGKILL)
    thread.join(timeout=150)
    ran = int(batches_run.numpy())
    on_coordinator = evaluator().evaluate()
print(json.dumps({"before": before, "after": after, "coordinator": on_coordinator, "ran": ran, "printed": printed}))
flush_and_exit(0)
"""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_worker_killed_mid_eval_has_its_shard_run_again_and_every_example_counts_once():
    """Exactly once under failure: worker 1 SIGKILLed inside its shard; the coordinator runs that shard again
    whole on a worker (more batches ran than the pass has), and the results are still the coordinator's own
    pass, bit for bit, every example once (their count and the sum of their ids)."""
    out = run_python(KILLED_MID_EVAL, timeout=180)
    assert any("worker 1 exited with code -9; restarted it" in line for line in out["printed"]), out["printed"]
    assert out["ran"] > 120, out  # the killed closure's batches ran twice, but counted once
    assert out["after"] == out["before"] == out["coordinator"]
    assert out["after"]["num_examples"] == 6000


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_eval_shards_spread_a_runs_eval_over_two_workers(tmp_path):
    """`parameter_server.eval_shards = 3` in a run with 2 workers: the chief says so, and each eval counts the
    359 examples (6 batches, the last partial) once."""
    model_dir = tmp_path / "run"
    run = run_main(
        "--gin_file=gin/ps.gin",
        f"--model_dir={model_dir}",
        "--gin_bindings=train.total_steps=20",
        "--gin_bindings=train.steps_per_loop=10",
        "--gin_bindings=train.eval_every_steps=10",
        "--gin_bindings=train.checkpoint_every_steps=20",
        "--gin_bindings=parameter_server.eval_shards=3",
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert (
        "eval under parameter_server: spread over 2 worker(s) in up to 3 shards "
        "(parameter_server.eval_shards = 3: asked for)" in run.stdout
    ), run.stdout[-3000:]
    assert re.findall(r"eval at step (\d+): .*\((\d+) examples\)", run.stdout) == [("10", "359"), ("20", "359")]
    assert [r["step"] for r in read_jsonl(model_dir / "metrics.jsonl") if r["split"] == "eval"] == [10, 20]
    assert_all_gone(server_pids(run.stdout, run.stderr))
