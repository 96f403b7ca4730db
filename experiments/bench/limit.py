"""The `limit` worker: the bare step on one batch already on the device(s); and `limit_input`,
the same loop fed by the config's distributed input.

A `tf.function` with the structure of TrainLoop's compiled loop (`steps_per_loop` steps per
call in a graph while loop, each `strategy.run` of the same replica step with the same XLA and
precision settings, its outputs added up on each replica and SUM-reduced once per call by the
loop's own `ReplicaTotals`), but no non-finite check, no hooks, no Python between steps; and,
for `limit`, no `next(iterator)` either: no input pipeline. What `limit_input` loses against
`limit` is what the input costs as the train loop reads it: the split gathered by index on the
devices where it is held there (trainer/data/device.py), else the distributed iterator (under a
strategy with several replicas mostly TensorFlow's, which splits each global batch per replica).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from experiments.bench.config import loop_data, setup
from experiments.bench.protocol import Channel


def run_limit(settings, channel: Channel, *, from_input: bool = False) -> None:
    """Runs to the steps the parent asks for, `steps_per_loop` steps per call (`from_input`: each step on
    the train data as the train loop reads it)."""
    run_steps, limit = bare_step(*setup(settings), settings, from_input=from_input)

    def run_until(until: int) -> float:
        """Runs to step `until`; returns the seconds inside the compiled calls."""
        seconds = 0.0
        while channel.done < until:
            count = min(settings.steps_per_loop, until - channel.done)
            started = time.monotonic()
            run_steps(count)
            seconds += time.monotonic() - started
            channel.done += count
        return seconds

    run_until(1)
    until = channel.ready()
    while until is not None:
        until = channel.chunk_done(step_seconds=run_until(until))
    channel.finished(limit.experimental_get_tracing_count())


def bare_step(dist, task, settings, *, from_input: bool = False) -> tuple[Callable[[int], None], Any]:
    """`run_steps(count)`, which runs `count` steps in one call and waits for them, and the compiled function.

    Apart from the worker so that the input bench (experiments/bench/input_only.py) measures
    what the step consumes with this same function, in its own process.
    """
    import tensorflow as tf

    from trainer import data
    from trainer.data.device import feed_of
    from trainer.distribution import devices
    from trainer.loops.totals import ReplicaTotals
    from trainer.update import xla

    gb = settings.global_batch_size
    dataset = data.train_dataset(task.input, gb, settings.seed, shard_policy=settings.shard_policy)
    batch = next(iter(dist.experimental_distribute_dataset(dataset)))
    if dist.num_replicas_in_sync == 1:
        with tf.device(devices.compute_devices()[0]):  # the default strategy leaves it on the host
            batch = tf.nest.map_structure(tf.identity, batch)
    del dataset
    step = xla.replica_step(dist, settings.step_fn, task.models, task.optimizers, gb, jit_compile=settings.jit_compile)

    feed = feed_of(loop_data(dist, task.input, settings)) if from_input else None
    replica_fn = (lambda item: step(feed.replica_batch(item))) if from_input else step
    totals = ReplicaTotals(dist, replica_fn, "train.step_fn", count_finite=False)

    @tf.function(autograph=False)
    def limit(source, num_steps):  # TrainLoop's loop, on the batch in memory or on the loop's input
        next_item = (lambda: feed.next_item(source)) if from_input else lambda: source
        return totals.sums(totals.accumulate(num_steps, next_item))

    source = feed.source if from_input else batch

    def run_steps(count: int) -> None:
        outputs = limit(source, tf.constant(count, tf.int32))
        {k: float(v) for k, v in outputs.items()}  # noqa: B018  (waits for the call, like ours does)

    return run_steps, limit
