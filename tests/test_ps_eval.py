"""Eval under parameter servers spread over the workers (issue 38, must-show 4): shards of consecutive eval
batches, one closure each, every example counted once, results the coordinator's bit for bit."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

from tests.support import read_jsonl, run_main
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
    assert count("auto") == (4, "2 per worker on other hosts")
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


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_eval_spread_over_two_workers_equals_the_coordinators_eval(tmp_path):
    """A run with 2 workers and 3 eval shards of the 6 batches; the sidecar then evaluates its checkpoint on
    one device (the coordinator's pass): the same results, bit for bit, and all 359 examples counted."""
    model_dir = tmp_path / "run"
    steps = ["--gin_bindings=train.total_steps=20"]
    run = run_main(
        "--gin_file=gin/ps.gin",
        f"--model_dir={model_dir}",
        *steps,
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
    assert_all_gone(server_pids(run.stdout, run.stderr))
    sidecar = run_main(
        "--gin_file=gin/ps.gin",
        "--mode=eval_continuous",
        f"--model_dir={model_dir}",
        *steps,
        "--gin_bindings=eval_continuous.timeout_secs=30",
        timeout=120,
    )
    assert sidecar.returncode == 0, sidecar.stderr[-4000:]
    records = [r for r in read_jsonl(model_dir / "metrics.jsonl") if r["split"] == "eval" and r["step"] == 20]
    spread, coordinator = records
    assert coordinator.pop("num_examples") == EXAMPLES
    assert spread == coordinator
