"""Eval under parameter servers spread over the workers, every eval example counted once.

The coordinator's eval pass (trainer/loops/evaluator.py) is cut into shards of consecutive batches of the
same eval dataset, one closure per shard scheduled with the ClusterCoordinator: each runs its whole shard on
one worker, from a fresh iterator over its batches, and returns each batch's sums. A closure whose worker
fails is run again whole on another, and only a finished closure's values come back, so each batch (the
last, partial one too, its padding weighted 0 as ever) counts exactly once. The coordinator adds the rows in
batch order in float32, as the one-pass loop does: with one replica per worker the results are the
coordinator's eval bit for bit.

Keras metrics (`train.eval_metrics_fn`) are state on the coordinator that shards cannot add up, and a worker
with several replicas would need each batch split across them: in both cases eval stays on the coordinator
(`'auto'`), or a number of shards asked for is refused.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from trainer.errors import UserError
from trainer.loops.evaluator import Evaluator
from trainer.loops.ps import split_steps
from trainer.loops.totals import ReplicaTotals

AUTO = "auto"
SHARDS_PER_WORKER = 5  # a re-run after a failure repeats a tenth of the pass with 2 workers; a fast worker takes more


def shard_count(setting: int | str, strategy: tf.distribute.Strategy, workers: int, has_metrics: bool) -> int:
    """The shards per eval pass that `parameter_server.eval_shards` asks for (0: eval on the coordinator),
    or UserError where a number asked for cannot work (see module doc)."""
    if setting == 0:
        return 0
    reason = None
    if has_metrics:
        reason = "cannot add up the Keras metrics of train.eval_metrics_fn across shards"
    elif (replicas := strategy.num_replicas_in_sync) > 1:
        reason = f"needs one replica per worker, and each worker here has {replicas}"
    if reason is None:
        return SHARDS_PER_WORKER * workers if setting == AUTO else setting
    if setting == AUTO:
        return 0
    raise UserError(
        f"parameter_server.eval_shards = {setting} spreads eval over the workers, which {reason}; set "
        "parameter_server.eval_shards = 0 to evaluate on the coordinator"
    )


def shard_ranges(num_batches: int, shards: int) -> list[tuple[int, int]]:
    """`(first batch, batch count)` of each shard: consecutive, at most `shards`, none empty."""
    ranges, first = [], 0
    for count in split_steps(num_batches, -(-num_batches // shards)):
        ranges.append((first, count))
        first += count
    return ranges


class WorkerEvaluator:
    """The eval pass of `evaluator` as closures on the workers, each over one shard of `num_batches` batches
    of `dataset_fn()` (the coordinator's eval dataset, built on every worker)."""

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        coordinator: tf.distribute.coordinator.ClusterCoordinator,
        evaluator: Evaluator,
        dataset_fn: Callable[[], tf.data.Dataset],
        num_batches: int,
        shards: int,
    ):
        self._evaluator = evaluator
        self._coordinator = coordinator
        self._dataset = coordinator.create_per_worker_dataset(dataset_fn).build()
        self.ranges = shard_ranges(num_batches, shards)
        totals = self._totals = ReplicaTotals(strategy, evaluator.replica_fn, "train.eval_step_fn", count_finite=False)

        def shard_rows(dataset, first, count):
            iterator = iter(dataset.skip(first).take(count))
            return totals.each_step(count, lambda: next(iterator))

        self._shard_rows = tf.function(shard_rows, autograph=False)

    def trace(self) -> tuple[str, ...]:
        return self._evaluator.trace()  # on the coordinator: the same step, checked before anything is written

    def evaluate(self) -> dict[str, float]:
        scheduled = [
            self._coordinator.schedule(
                self._shard_rows, args=(self._dataset, tf.constant(first, tf.int64), tf.constant(count, tf.int64))
            )
            for first, count in self.ranges
        ]
        self._coordinator.join()
        rows = np.concatenate([result.fetch() for result in scheduled]).astype(np.float32)
        sums = np.add.accumulate(rows, axis=0)[-1]  # in order, one float32 add at a time
        return self._evaluator.results(dict(zip(self._totals.names, sums.tolist(), strict=True)))
