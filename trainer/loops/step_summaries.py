"""`tf.summary` calls inside the step (scalar, histogram, image, ...): written to the chief's
train event file every `train.log_every_steps` steps under every synchronous strategy, refused in
one line under parameter_server.

How. TensorFlow writes a summary op only if a default writer is set when the op is traced, so
the train loop traces its compiled function inside `StepSummaries.recording`: on the chief, the
train event writer of model_dir (the one the train records go to, trainer/files/event_writers.py)
is the default writer, the default step is a counter that is the global step of the step running,
and recording is on only where that step is a multiple of `every_steps`: the step's summaries land
at the steps of the train records. Each summary op sits in a `tf.cond` whose branch (the summary's
own computation too, such as a histogram's buckets) runs only on those steps; the other steps pay
the counter's increment and the false condition. Other workers (MultiWorkerMirrored) trace with
a no-op writer, under which TensorFlow traces no summary op at all.

Which replica. In replica context TensorFlow records a summary from replica 0 only (every
`tf.distribute.ReplicaContext` makes recording conditional on `replica_id_in_sync_group == 0`),
so under MirroredStrategy and MultiWorkerMirrored the values written are those of the first
replica: its own batch, and a loss scaled by `compute_average_loss` is its share of the
global-batch mean (the loop's own `loss` record is the SUM over replicas).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import tensorflow as tf

from trainer.errors import UserError
from trainer.files.event_writers import EventWriter


class StepSummaries:
    """The default summary writer, step and recording condition of the train loop's trace.

    `writer`: the chief's train `EventWriter`; a no-op writer on other workers; None where the
    loop has no model_dir (nothing is recorded, as without this class).
    """

    def __init__(self, writer: tf.summary.SummaryWriter | None, every_steps: int):
        self._writer = writer
        self._every = every_steps
        self._step: tf.Variable | None = None
        if isinstance(writer, EventWriter):
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="summary_step")

    @contextlib.contextmanager
    def recording(self, global_step: tf.Variable) -> Iterator[Callable[[], None]]:
        """Around the body of the compiled loop (cross-replica context), starting at `global_step`;
        yields `advance`, to call before each step."""
        if self._step is None:
            with self._writer.as_default() if self._writer is not None else contextlib.nullcontext():
                yield lambda: None
            return
        step, every = self._step, self._every
        step.assign(tf.cast(global_step.read_value(), tf.int64))
        with self._writer.as_default(step=step), tf.summary.record_if(lambda: tf.equal(step % every, 0)):
            yield lambda: step.assign_add(1)

    def start(self) -> None:
        """Before the first loop call: the writer's event file (after the run's checks)."""
        if isinstance(self._writer, EventWriter):
            self._writer.init()


def writes_summaries(concrete_function) -> bool:
    """Whether a traced function writes summaries (its graph or any function it calls: loop and
    branch bodies, nested tf.functions)."""
    graph = concrete_function.graph.as_graph_def()
    nodes = [*graph.node, *(node for function in graph.library.function for node in function.node_def)]
    return any(node.op.startswith("Write") and node.op.endswith("Summary") for node in nodes)


@contextlib.contextmanager
def tracing_for_summaries() -> Iterator[None]:
    """A writer that is never created as the default writer, recording on: traced under it, a
    step's summary calls become summary ops (`writes_summaries`) instead of nothing."""
    with EventWriter("never-created").as_default(step=0), tf.summary.record_if(True):
        yield


def refuse_under_parameter_server(step_name: str) -> UserError:
    return UserError(
        f"train.step_fn {step_name} writes tf.summary inside the step, which parameter_server cannot record: the "
        "step runs on the workers, and the event files are the chief's; return the value from the step instead "
        "(each output is logged to metrics.jsonl and TensorBoard), or use a synchronous strategy (gin/mwms.gin)"
    )
