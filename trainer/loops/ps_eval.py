"""Eval under parameter servers spread over the workers, every eval example counted once.

The coordinator's eval pass (trainer/loops/evaluator.py) is cut into shards of consecutive batches of the
same eval data, one closure per shard scheduled with the ClusterCoordinator (as tf_keras'
`pss_evaluation_shards`): each builds its shard's batches on its worker, from the shard's first example
(the ones before it are skipped, not mapped), runs them all and returns each batch's sums. A closure whose
worker fails is run again whole on another, and only a finished closure's values come back, so each batch
(the last, partial one too) counts exactly once. The coordinator adds the rows in batch order in float32,
as the one-pass loop does: with one replica per worker the results are the coordinator's eval bit for bit.

Keras metrics (`train.eval_metrics_fn`) are state on the coordinator that shards cannot add up, and a worker
with several replicas would need each batch split across them: in both cases eval stays on the coordinator
(`'auto'`), or a number of shards asked for is refused. `'auto'` spreads only over workers on other hosts.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from trainer import internals
from trainer.errors import UserError
from trainer.loops.evaluator import Evaluator
from trainer.loops.totals import ReplicaTotals
from trainer.task.structure import all_variables

AUTO = "auto"
# Each shard reads the examples before its first batch to skip them (through the input's own preprocessing), about
# (shards - 1) / 2 extra reading passes in all, and costs a closure: 2 shards on 2 one-core workers evaluated 1.95x
# as fast as the coordinator, 4 shards 1.44x. More shards would shorten a re-run after a failure (1 / shards).
SHARDS_PER_WORKER = 1
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}


def on_one_host(cluster: Mapping[str, Sequence[str]]) -> bool:
    """Whether the coordinator and every worker of `cluster` (job -> addresses) share one host (the embedded
    cluster, `trainer.launch`): there the workers' processes take the cores the coordinator's eval would use."""
    hosts = {address.rsplit(":", 1)[0] for job in ("chief", "worker") for address in cluster.get(job, [])}
    return len({"localhost" if host in _LOOPBACK else host for host in hosts}) == 1


def shard_count(
    setting: int | str, *, workers: int, replicas: int, cluster: Mapping[str, Sequence[str]], has_metrics: bool
) -> tuple[int, str]:
    """The shards per eval pass that `parameter_server.eval_shards` gives (0: eval on the coordinator) and why,
    or UserError where a number asked for cannot work (see module doc); `replicas` per worker."""
    if setting == 0:
        return 0, "asked for"
    reason = None
    if has_metrics:
        reason = "cannot add up the Keras metrics of train.eval_metrics_fn across shards"
    elif replicas > 1:
        reason = f"needs one replica per worker, and each worker here has {replicas}"
    if reason is not None and setting != AUTO:
        raise UserError(
            f"parameter_server.eval_shards = {setting} spreads eval over the workers, which {reason}; set "
            "parameter_server.eval_shards = 0 to evaluate on the coordinator"
        )
    if reason is not None:
        return 0, f"spreading it {reason}"
    if setting != AUTO:
        return setting, "asked for"
    if on_one_host(cluster):
        return 0, "the workers share the coordinator's host"
    return SHARDS_PER_WORKER * workers, "one per worker, the workers on other hosts"


def shard_ranges(num_batches: int, shards: int) -> list[tuple[int, int]]:
    """`(first batch, batch count)` of each shard: consecutive, `min(shards, num_batches)` of them, sizes within 1."""
    count = min(shards, num_batches)
    size, extra = divmod(num_batches, count)
    sizes = [size + 1] * extra + [size] * (count - extra)
    return [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]


class WorkerEvaluator:
    """The eval pass of `evaluator` as closures on the workers, each over its shard of the `num_batches`
    batches: `dataset_fn(first, count)` gives batches first..first+count-1 of the coordinator's eval data."""

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        coordinator: tf.distribute.coordinator.ClusterCoordinator,
        evaluator: Evaluator,
        dataset_fn: Callable[[tf.Tensor, tf.Tensor], tf.data.Dataset],
        num_batches: int,
        shards: int,
    ):
        self._evaluator = evaluator
        self._coordinator = coordinator
        self.ranges = shard_ranges(num_batches, shards)
        totals = self._totals = ReplicaTotals(strategy, evaluator.replica_fn, "train.eval_step_fn", count_finite=False)

        def shard_rows(first, count):
            iterator = iter(dataset_fn(first, count))  # built on the worker, fresh for every run of the closure
            with internals.cached_variable_reads():  # each model variable read once, before the first batch
                for variable in all_variables(evaluator.model):
                    tf.convert_to_tensor(variable)  # the read every batch's step reuses
                return totals.each_step(count, lambda: next(iterator))

        self._shard_rows = tf.function(shard_rows, autograph=False)

    def trace(self) -> tuple[str, ...]:
        return self._evaluator.trace()  # on the coordinator: the same step, checked before anything is written

    def evaluate(self) -> dict[str, float]:
        scheduled = [
            self._coordinator.schedule(
                self._shard_rows, args=(tf.constant(first, tf.int64), tf.constant(count, tf.int64))
            )
            for first, count in self.ranges
        ]
        self._coordinator.join()
        rows = np.concatenate([result.fetch() for result in scheduled]).astype(np.float32)
        sums = np.add.accumulate(rows, axis=0)[-1]  # in batch order, one float32 add at a time
        return self._evaluator.results(dict(zip(self._totals.names, sums.tolist(), strict=True)))
