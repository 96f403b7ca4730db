"""The synchronous train loop: `num_steps` steps per compiled call (`ReplicaTotals`), hooks between calls;
the step's own `tf.summary` calls recorded every `log_every_steps` steps (trainer/loops/step_summaries.py).
Its batches come from a distributed dataset or from the split held on the devices (trainer/data/device.py).
"""

from __future__ import annotations

from typing import Callable, Mapping

import tensorflow as tf

from trainer.data.device import feed_of
from trainer.errors import UserError
from trainer.loops.step_summaries import StepSummaries, writes_summaries
from trainer.loops.totals import ReplicaTotals
from trainer.safety import tracing
from trainer.task import combine
from trainer.update import xla

StepFn = Callable[..., Mapping[str, tf.Tensor]]


class TrainLoop:
    """Runs `num_steps` training steps per call and returns the mean of each step output."""

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model,
        optimizer,
        step_fn: StepFn,
        global_batch_size: int,
        dataset,
        global_step: tf.Variable,
        *,
        jit_compile: bool = False,
        after_update: Callable[[], None] | None = None,
        summaries: StepSummaries | None = None,
        lengths_vary: bool = False,
    ):
        self._strategy = strategy
        self._jit_compile = jit_compile
        self._lengths_vary = lengths_vary  # batches of several lengths in one call (trainer/data/sequences.py)
        self._summaries = summaries = summaries or StepSummaries(None, 1)
        self._global_step = global_step
        self._feed = feed = feed_of(dataset)

        # XLA (if asked) on the replica function only: iterator ops and the reduce stay outside (rule 9).
        replica_step = xla.replica_step(strategy, step_fn, model, optimizer, global_batch_size, jit_compile=jit_compile)

        def step_at_top_scope(batch):
            # Summary tags take the name scope they are written in: the step's own summaries are
            # tagged as in a step called by itself (`first_weights`, not `while/first_weights`).
            with tf.name_scope(""):
                return replica_step(feed.replica_batch(batch))

        totals = self._totals = ReplicaTotals(
            strategy, step_at_top_scope, "train.step_fn", rule=combine.rule_of(step_fn)
        )
        self.rule = totals.rule  # how each output combines over steps (the progress hook combines calls alike)

        def train_steps(iterator, num_steps):
            with summaries.recording(global_step) as advance:

                def next_batch():
                    advance()  # the summaries' step: the global step of the step about to run
                    return feed.next_item(iterator)

                state = totals.accumulate(num_steps, next_batch, after_step=after_update)
            per_interval = totals.per_interval(state, num_steps)
            with tf.control_dependencies(tf.nest.flatten(per_interval)):  # a call that failed counts no steps
                global_step.assign_add(tf.cast(num_steps, global_step.dtype))
            return per_interval, totals.first_nonfinite(state, num_steps)

        # Plain TF ops throughout: no AutoGraph (see trainer/task/user_code.py; the step is converted).
        self._train_steps = tf.function(train_steps, autograph=False)
        self.last_nonfinite_offset: int | None = None

    def run(self, num_steps: int) -> dict[str, float]:
        """Trains `num_steps` steps; each output's mean over them. `last_nonfinite_offset` is then the index in
        this call of the first step with a non-finite output (None if none)."""
        self._summaries.start()
        means, first_nonfinite = self._train_steps(self._feed.source, tf.constant(num_steps, tf.int32))
        offset = int(first_nonfinite)
        self.last_nonfinite_offset = offset if offset >= 0 else None
        return {k: float(v) for k, v in means.items()}

    def trace(self, step_name: str) -> tuple[str, ...]:
        """Traces the compiled loop now (the trace the first call reuses), so a step that cannot take the batch is
        one UserError line before anything is written; the names of the step's outputs."""
        concrete = tracing.traced(
            "train.step_fn",
            step_name,
            lambda: self._train_steps.get_concrete_function(self._feed.source, tf.TensorSpec([], tf.int32)),
        )
        if self._lengths_vary and gathers_across_replicas(concrete):
            raise UserError(
                f"train.step_fn {step_name} gathers a value across replicas (a sparse gradient, an Embedding's, "
                "is summed by an all-gather) whose size follows the batch's length, and TensorFlow's collectives "
                "cannot change a size within one compiled call, where batches of several lengths run: set "
                "train.steps_per_loop = 1, or give the examples a fixed length"
            )
        if self._jit_compile and writes_summaries(concrete):
            raise UserError(
                f"train.step_fn {step_name} writes tf.summary inside the step, which XLA cannot compile "
                "(train.jit_compile); return the value from the step instead (each output is logged), "
                "or set train.jit_compile = False"
            )
        return tuple(self._totals.names)

    def set_dataset(self, dataset) -> None:
        self._feed.restart(dataset)

    @property
    def trace_count(self) -> int:
        return self._train_steps.experimental_get_tracing_count()


def gathers_across_replicas(concrete) -> bool:
    """Whether the traced loop holds a collective all-gather (measured: an Embedding's sparse gradient summed
    under mirrored and MultiWorkerMirrored; a collective caches its shape per instance within one call)."""
    graph = concrete.graph.as_graph_def()
    nodes = [*graph.node, *(node for function in graph.library.function for node in function.node_def)]
    return any(node.op.startswith("CollectiveGather") for node in nodes)
